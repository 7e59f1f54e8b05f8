"""``--smoke``, the flag every benchmark takes: its smallest settings that still run the whole
path (the same functions, actors, runs and output; seconds, a minute or two for the scripts that
train), so that a test can run every script as a user would (``tests/e2e/test_benchmarks_smoke.py``)
and none rots unseen. A smoke's figures mean nothing; its JSON says ``"smoke": true``."""

from __future__ import annotations

import argparse
import sys

HELP = ("the smallest settings that still run the whole path: checks that the script runs (its figures "
        "mean nothing); a flag given beside it still wins")


def parse_args(parser: argparse.ArgumentParser, smoke: dict, argv: list[str] | None = None) -> argparse.Namespace:
    """Adds ``--smoke`` to ``parser`` and parses; under ``--smoke`` the settings in ``smoke``
    (argument dest -> value) are the defaults, so a flag given beside it still wins."""
    parser.add_argument("--smoke", action="store_true", help=HELP)
    args = sys.argv[1:] if argv is None else argv
    if "--smoke" in args:
        parser.set_defaults(**smoke)
    return parser.parse_args(args)
