"""`python -m jaxtron.gpu_preset`: the same as `jaxtron gpu-preset` (the code lives in `jaxtron/gpu/preset.py`)."""

if __name__ == "__main__":
    import sys

    from jaxtron.cli import run
    sys.exit(run("gpu-preset"))
