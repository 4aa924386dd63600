"""`python -m jaxtron.score`: logits of converted or trained parameters on given token ids (the code lives in `jaxtron/interop/score.py`)."""

import sys

from jaxtron.interop.score import main

if __name__ == "__main__":
    sys.exit(main())
