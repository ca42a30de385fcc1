"""``logitless`` command line: ``demo``, ``bench``, ``refcache``."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="logitless", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    from . import demo

    demo.add_arguments(sub.add_parser("demo", help="train a small model with TRL GRPO through logitless"))
    try:
        from .bench import cli as bench_cli
    except ImportError:  # optional module
        bench_cli = None
    if bench_cli is not None:
        bench_cli.add_arguments(sub.add_parser("bench", help="benchmark against the cuBLAS floor and other libraries"))
    try:
        from .refcache import cli as refcache_cli
    except ImportError:
        refcache_cli = None
    if refcache_cli is not None:
        refcache_cli.add_arguments(
            sub.add_parser("refcache", help="build / inspect / verify a reference log-prob cache"))

    args = parser.parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
