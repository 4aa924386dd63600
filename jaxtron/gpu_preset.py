"""`python -m jaxtron.gpu_preset`: the GPU environment and XLA flags, or --check against the installed jaxlib (the code lives in `jaxtron/gpu/preset.py`)."""

import sys

from jaxtron.gpu.preset import main

if __name__ == "__main__":
    sys.exit(main())
