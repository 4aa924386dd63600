"""`python -m jaxtron.generate`: the same as `jaxtron generate` (the code lives in `jaxtron/inference/generate.py`)."""

if __name__ == "__main__":
    import sys

    from jaxtron.cli import run
    sys.exit(run("generate"))
