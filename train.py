"""`python train.py ARGS`: the same as `jaxtron train ARGS` (the code lives in `jaxtron/training/cli.py`, wired in
`jaxtron/train.py`)."""

import sys

from jaxtron.cli import run


def main(argv: list[str] | None = None) -> int:
    return run("train", argv)


if __name__ == "__main__":
    sys.exit(main())
