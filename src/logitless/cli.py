"""The logitless command line: demo, bench, refcache."""

from __future__ import annotations

import argparse
import sys


def build_parser() -> argparse.ArgumentParser:
    """The ``logitless`` parser with its subcommands."""
    from . import __version__, demo
    from .bench import cli as bench_cli
    from .refcache import cli as refcache_cli

    parser = argparse.ArgumentParser(
        prog="logitless",
        description="LLM output-head losses and metrics without materializing logits: a demo, benchmarks, and "
                    "the reference log-prob cache.")
    parser.add_argument("--version", action="version", version=f"logitless {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="{demo,bench,refcache}")
    demo.add_arguments(sub.add_parser("demo", help="train a small model with TRL GRPO through logitless"))
    bench_cli.add_arguments(sub.add_parser("bench", help="benchmark against the cuBLAS floor, TRL and other "
                                                         "libraries"))
    refcache_cli.add_arguments(sub.add_parser("refcache", help="build / inspect / verify a reference log-prob "
                                                               "cache"))
    parser.set_defaults(func=lambda _args: parser.print_help() or 0)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``logitless`` command; returns the exit status (2: a usage error)."""
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser.parse_args(argv)
    args.argv = argv[1:]  # the subcommand's own arguments, recorded by bench
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
