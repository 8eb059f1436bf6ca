"""``python -m xavier_async.demo [options]``."""

from __future__ import annotations

import argparse
import sys

from . import add_arguments, run


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m xavier_async.demo",
        description="Prefix sharing between two replicas of a Qwen2 model (random weights) over NIXL.")
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
