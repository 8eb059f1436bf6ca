"""``python -m xavier_async.demo [options]``."""

from __future__ import annotations

import argparse
import sys

from . import add_arguments, run


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m xavier_async.demo",
        description="Prefix sharing between Qwen2 replicas (random weights), each a batched engine, over NIXL.")
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
