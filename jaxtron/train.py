"""`jaxtron train` (the code lives in `jaxtron/training/cli.py`), with the evaluator of ``train.eval_tasks``
(`jaxtron/inference/downstream.py`) and the planner's choice of execution.remat='auto'
(`jaxtron/planning/remat.py`) plugged in here, above all three: training code imports neither."""

from __future__ import annotations


def main(argv: list[str]) -> int:
    from jaxtron.inference.downstream import TaskEvaluator
    from jaxtron.planning.remat import resolve_for_devices
    from jaxtron.training.cli import main as train

    return train(argv, evaluator=TaskEvaluator, resolve_remat=resolve_for_devices)


if __name__ == "__main__":
    import sys

    from jaxtron.cli import run
    sys.exit(run("train"))
