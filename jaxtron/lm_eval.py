"""`python -m jaxtron.lm_eval`: the same as `jaxtron lm-eval` (the code lives in `jaxtron/inference/harness.py`)."""

if __name__ == "__main__":
    import sys

    from jaxtron.cli import run
    sys.exit(run("lm-eval"))
