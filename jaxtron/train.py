"""`jaxtron train` (the code lives in `jaxtron/training/cli.py`), with the evaluator of ``train.eval_tasks``
(`jaxtron/inference/downstream.py`) plugged in here, above both: training code does not import inference code."""

from __future__ import annotations


def main(argv: list[str]) -> int:
    from jaxtron.inference.downstream import TaskEvaluator
    from jaxtron.training.cli import main as train

    return train(argv, evaluator=TaskEvaluator)


if __name__ == "__main__":
    import sys

    from jaxtron.cli import run
    sys.exit(run("train"))
