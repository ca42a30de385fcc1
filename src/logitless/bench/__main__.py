"""``python -m logitless.bench``: the ``logitless bench`` command without the top-level CLI."""

import argparse
import sys

from .cli import add_arguments


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="logitless bench")
    add_arguments(parser)
    args = parser.parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
