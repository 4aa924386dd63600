"""`python -m jaxtron.plan`: the same as `jaxtron plan` (the code lives in `jaxtron/planning/cli.py`)."""

if __name__ == "__main__":
    import sys

    from jaxtron.cli import run
    sys.exit(run("plan"))
