"""Where the dev cluster finds the repository, the project venv and the tool cache.

The package is installed editable from a lorafleet checkout (`make setup-python`), so the
repository is found from this file; `LORAFLEET_REPO` overrides it (e.g. for a non-editable
install). `LORAFLEET_VENV` and `LORAFLEET_CACHE` override the venv and the cache.
"""

from __future__ import annotations

import os
from pathlib import Path


def _repo_root() -> Path:
    if "LORAFLEET_REPO" in os.environ:
        return Path(os.environ["LORAFLEET_REPO"]).resolve()
    return Path(__file__).resolve().parents[3]  # devcluster/src/lorafleet_devcluster/paths.py


REPO_ROOT = _repo_root()
CHART = REPO_ROOT / "charts" / "lorafleet"


def venv_bin() -> Path:
    """The project venv's bin directory (`LORAFLEET_VENV` overrides `<repo>/.venv`)."""
    return Path(os.environ.get("LORAFLEET_VENV", REPO_ROOT / ".venv")) / "bin"


def cache_dir() -> Path:
    """Builds and downloads cached outside the repository (`LORAFLEET_CACHE`, default ~/.cache/lorafleet)."""
    return Path(os.environ.get("LORAFLEET_CACHE", Path.home() / ".cache" / "lorafleet"))
