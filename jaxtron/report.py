"""`python -m jaxtron.report`: a run's sustained numbers and plots, or two runs compared (the code lives in `jaxtron/metrics/report.py`)."""

import sys

from jaxtron.metrics.report import main

if __name__ == "__main__":
    sys.exit(main())
