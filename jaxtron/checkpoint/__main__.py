"""`python -m jaxtron.checkpoint verify WORKDIR`: checks a run's checkpoints against their checksums."""

import sys

from jaxtron.checkpoint.train_state import main

if __name__ == "__main__":
    sys.exit(main())
