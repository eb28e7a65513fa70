"""`lorafleet-devcluster`: start, stop and inspect the local dev cluster; build the images it can run.

lorafleet-devcluster up [--dir DIR]       # control plane + node agent in the background; prints the kubeconfig
lorafleet-devcluster status [--dir DIR]   # the recorded processes, running or gone (exit 1 if any is gone)
lorafleet-devcluster down [--dir DIR]     # stops what `up` started
lorafleet-devcluster images [--build]     # how each image a pod may name is run here; --build runs `make images`
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from lorafleet_devcluster import images
from lorafleet_devcluster.cluster import COMMANDS, default_dir
from lorafleet_devcluster.paths import REPO_ROOT


def _cmd_images(build: bool) -> int:
    if build:
        return subprocess.call(["make", "-C", str(REPO_ROOT), "images"])
    print(images.describe())
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="lorafleet-devcluster", description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=[*COMMANDS, "images"])
    parser.add_argument("--dir", type=Path, default=default_dir(), help="state directory (default: %(default)s)")
    parser.add_argument("--build", action="store_true", help="images: build them (`make images`)")
    args = parser.parse_args(argv)
    if args.command == "images":
        return _cmd_images(args.build)
    return COMMANDS[args.command](args.dir)


if __name__ == "__main__":
    sys.exit(main())
