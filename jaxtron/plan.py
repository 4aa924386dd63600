"""`python -m jaxtron.plan`: ranked meshes and memory for a model on N GPUs (the code lives in `jaxtron/planning/cli.py`)."""

import sys

from jaxtron.planning.cli import main

if __name__ == "__main__":
    sys.exit(main())
