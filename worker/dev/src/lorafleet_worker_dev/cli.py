"""`lorafleet-dev make-tiny-model | make-tiny-adapter`: the dev tools' command line (the chart's
`model.generateTiny` init container runs `lorafleet-dev make-tiny-model` in the worker's -dev image)."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

from lorafleet_worker_dev.tiny import ALL_TARGETS, ARCHS


def _positive(value: str) -> int:
    n = int(value)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {n}")
    return n


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lorafleet-dev", description="lorafleet worker's dev tools.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    tiny = sub.add_parser("make-tiny-model", help="write a random tiny model")
    tiny.add_argument("dir", type=Path, help="output directory")
    tiny.add_argument("--arch", default="llama", choices=ARCHS)
    tiny.add_argument("--seed", type=int, default=0)

    adapter = sub.add_parser("make-tiny-adapter", help="write a real PEFT LoRA adapter for a model")
    adapter.add_argument("dir", type=Path, help="output directory")
    adapter.add_argument("--base", required=True, type=Path, help="base model directory")
    adapter.add_argument("--rank", required=True, type=_positive)
    adapter.add_argument("--alpha", type=float, help="lora_alpha (default 2 x rank)")
    adapter.add_argument("--rslora", action="store_true", help="rank-stabilized scaling alpha/sqrt(r)")
    adapter.add_argument("--targets", nargs="+", help="target modules (default: all seven projections)")
    adapter.add_argument("--seed", type=int, default=0)
    return parser


def _make_tiny_model(args: argparse.Namespace) -> int:
    from lorafleet_worker_dev.tiny import make_tiny_model

    out = make_tiny_model(args.dir, args.arch, seed=args.seed)
    print(f"wrote a tiny {args.arch} model to {out}")
    return 0


def _make_tiny_adapter(args: argparse.Namespace) -> int:
    from lorafleet_worker_dev.tiny import make_tiny_adapter

    out = make_tiny_adapter(
        args.dir,
        args.base,
        rank=args.rank,
        alpha=args.alpha,
        rslora=args.rslora,
        targets=args.targets or ALL_TARGETS,
        seed=args.seed,
    )
    print(f"wrote a rank-{args.rank} LoRA adapter to {out}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    commands = {"make-tiny-model": _make_tiny_model, "make-tiny-adapter": _make_tiny_adapter}
    return commands[args.command](args)
