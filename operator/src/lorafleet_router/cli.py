"""``lorafleet-router``: the router's entry point (``build_parser`` lists its flags)."""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Sequence

from lorafleet_router.settings import RouterSettings

DESCRIPTION = (
    "OpenAI-compatible router: sends each request to a worker pod that holds its adapter "
    "(fewest in-flight requests) or serves its base model; watches DynamoModels and worker pods."
)


def build_parser() -> argparse.ArgumentParser:
    """``lorafleet-router``'s flags: one per ``RouterSettings`` field, and ``--verbose``."""
    return RouterSettings.build_parser("lorafleet-router", DESCRIPTION)


def parse_settings(argv: Sequence[str] | None = None) -> RouterSettings:
    """Settings from the flags in ``argv`` and the environment; sets up logging (``--verbose``)."""
    return RouterSettings.from_command_line(build_parser(), argv)


def main(argv: Sequence[str] | None = None) -> None:
    """Run the OpenAI-compatible router in front of the workers until SIGTERM/SIGINT."""
    settings = parse_settings(argv)
    from lorafleet_router.router import run_router

    try:
        asyncio.run(run_router(settings))
    except KeyboardInterrupt:
        sys.exit(0)


if __name__ == "__main__":  # pragma: no cover
    main()
