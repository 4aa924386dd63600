"""`python train.py ARGS`: the same as `jaxtron train ARGS` (``jaxtron.cli.train``), from a checkout without the
package installed."""

import sys

from jaxtron.cli import run


def main(argv: list[str] | None = None) -> int:
    return run("train", argv)


if __name__ == "__main__":
    sys.exit(main())
