"""Argument types shared by the CLI's parsers (graphrt/cli.py and the profile report's)."""

from __future__ import annotations

import argparse


def int_list(text: str) -> list[int]:
    """'1,8,64' or '1 8 64' -> [1, 8, 64]."""
    try:
        return [int(x) for x in text.replace(",", " ").split()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
