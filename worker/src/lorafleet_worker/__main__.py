"""`python -m lorafleet_worker` = `lorafleet-worker`."""

import sys

from lorafleet_worker.cli import main

sys.exit(main())
