"""`python -m jaxtron.report`: the same as `jaxtron report` (the code lives in `jaxtron/metrics/report.py`)."""

if __name__ == "__main__":
    import sys

    from jaxtron.cli import run
    sys.exit(run("report"))
