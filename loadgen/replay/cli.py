"""``tessera replay`` (filled in below once the replay core exists)."""

from __future__ import annotations

import argparse


def register_replay(subparsers: argparse._SubParsersAction) -> None:
    return None
