"""``python -m logitless.bench``: the bench subcommand without the top-level CLI."""

import argparse
import sys

from .cli import PROG, add_arguments


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=PROG)
    add_arguments(parser)
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser.parse_args(argv)
    args.argv = argv
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
