"""`python -m jaxtron.score`: the same as `jaxtron score` (the code lives in `jaxtron/interop/score.py`)."""

if __name__ == "__main__":
    import sys

    from jaxtron.cli import run
    sys.exit(run("score"))
