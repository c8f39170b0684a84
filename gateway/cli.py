"""The `tierlane` command: `tierlane serve` and the subcommands each package registers."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

# Each module here exposes `register(subparsers)`, adding its subcommand(s) with
# `set_defaults(func=callable(args) -> int)`.
COMMAND_MODULES: list[str] = [
    "gateway.serve_cli",
    "gateway.commands.cache",
    "gateway.replay.cli",
    "policies.router.cli",
    "policies.edge_quality.cli",
    "gateway.commands.edge_model",  # `tierlane edge pull`, beside calibrate and probe
    "gateway.commands.edge_learn",  # `tierlane edge learn-list | learn-forget`
    "policies.trim.cli",
    "gateway.commands.usage",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tierlane",
        description="LLM gateway: an OpenAI-compatible proxy that trims, caches, routes and meters.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    func = getattr(args, "func", None)
    if func is None:
        parser.print_help()
        return 2
    return int(func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
