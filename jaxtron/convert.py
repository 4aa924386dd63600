"""`python -m jaxtron.convert`: the same as `jaxtron convert` (the code lives in `jaxtron/interop/convert.py`)."""

if __name__ == "__main__":
    import sys

    from jaxtron.cli import run
    sys.exit(run("convert"))
