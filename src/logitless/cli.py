"""``logitless`` command line: ``demo``, ``bench``, ``refcache``."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``logitless`` command; returns the exit status."""
    from . import demo
    from .bench import cli as bench_cli
    from .refcache import cli as refcache_cli

    parser = argparse.ArgumentParser(prog="logitless", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo.add_arguments(sub.add_parser("demo", help="train a small model with TRL GRPO through logitless"))
    bench_cli.add_arguments(sub.add_parser("bench", help="benchmark against the cuBLAS floor and other libraries"))
    refcache_cli.add_arguments(sub.add_parser("refcache", help="build / inspect / verify a reference log-prob cache"))
    args = parser.parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
