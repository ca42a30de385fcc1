"""Value types and one-line usage errors shared by the ``logitless`` subcommands.

Each type is an ``argparse`` ``type=`` callable: a bad value raises
``argparse.ArgumentTypeError``, so argparse exits with status 2 and a usage message before any
work runs. Checks that need several options or the machine (a GPU, a path) call
:func:`usage_error`.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from typing import NoReturn


def usage_error(prog: str, message: str) -> NoReturn:
    """Print ``prog: error: message`` on one line to stderr and exit with status 2."""
    print(f"{prog}: error: {message}", file=sys.stderr)
    raise SystemExit(2)


def _number(text: str, kind: type, what: str) -> int | float:
    t = text.strip().lower()
    try:
        if kind is int and t.endswith("k"):  # 8k = 8192 tokens
            return int(t[:-1]) * 1024
        return kind(t)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None


def positive_int(text: str) -> int:
    """An integer > 0 (``8k`` = 8192)."""
    n = _number(text, int, "an integer")
    if n <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text!r}")
    return int(n)


def non_negative_int(text: str) -> int:
    """An integer >= 0."""
    n = _number(text, int, "an integer")
    if n < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text!r}")
    return int(n)


def positive_float(text: str) -> float:
    """A finite number > 0."""
    x = _number(text, float, "a number")
    if not 0 < x < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text!r}")
    return float(x)


def non_negative_float(text: str) -> float:
    """A finite number >= 0."""
    x = _number(text, float, "a number")
    if not 0 <= x < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text!r}")
    return float(x)


def csv_of(item: Callable[[str], object] | None = None,
           choices: Sequence[str] | None = None) -> Callable[[str], list]:
    """A comma-separated list, each item converted by ``item`` or checked against ``choices``."""

    def parse(text: str) -> list:
        items = [t.strip() for t in text.split(",") if t.strip()]
        if not items:
            raise argparse.ArgumentTypeError("expected a comma-separated list, got nothing")
        if choices is not None:
            bad = [t for t in items if t not in choices]
            if bad:
                raise argparse.ArgumentTypeError(f"unknown {', '.join(map(repr, bad))}; choose from "
                                                 f"{', '.join(choices)}")
        return [item(t) for t in items] if item is not None else items

    return parse
