"""The ``tessera`` command.

Each command group lives beside the code it drives, in a ``cli.py`` module exposing
``register(subparsers)``; this module only finds and wires them. Handlers import heavy
dependencies (torch, ray, grpc) lazily so that ``tessera --help`` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys

# Order is the order shown in --help. A module that does not exist (yet) is skipped.
COMMAND_MODULES = (
    "services.engine.cli",      # tessera model ...
    "services.kvstore.cli",     # tessera kvstore ...
    "services.launch.cli",      # tessera up / down / certs / demo
    "services.launch.chaos",    # tessera chaos
    "loadgen.cli",              # tessera trace / replay / simulate
    "loadgen.quality.cli",      # tessera quality ...
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tessera",
        description="Tessera: position-agnostic chunk KV reuse for RAG serving.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        try:
            found = importlib.util.find_spec(name) is not None
        except ModuleNotFoundError:
            found = False
        if found:
            importlib.import_module(name).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    handler = getattr(args, "handler", None)
    if handler is None:
        parser.print_help()
        return 2
    try:
        rc = handler(args)
    except (ValueError, FileNotFoundError) as exc:
        # Bad input at the boundary: one clear line, no traceback.
        print(f"tessera {args.command}: error: {exc}", file=sys.stderr)
        return 2
    return int(rc or 0)


if __name__ == "__main__":
    sys.exit(main())
