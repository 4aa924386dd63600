"""`python -m jaxtron.convert`: Hugging Face checkpoints to jaxtron parameters and back (the code lives in `jaxtron/interop/convert.py`)."""

import sys

from jaxtron.interop.convert import main

if __name__ == "__main__":
    sys.exit(main())
