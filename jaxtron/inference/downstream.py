"""Downstream tasks scored during training: ``train.eval_tasks``, lm-evaluation-harness tasks from local files
(``train.eval_tasks_path``), run on the model in memory every ``train.eval_every`` steps and at the end, their
scores logged beside the validation loss as ``eval/<task>/<metric>``.

Training code does not import inference code (the layers of docs/layout.md), so the evaluator reaches a run as a
hook (``task_hook``), which ``jaxtron.train`` adds to every run."""

from __future__ import annotations

import logging
import os
from typing import Any

from jaxtron.config.schema import Config, ConfigError
from jaxtron.training.hooks import Hook

log = logging.getLogger(__name__)


def store_tokenizer(data_path: str):
    """The tokenizer the first token store of ``data.path`` was prepared with."""
    import json

    from jaxtron.data.errors import DataError
    from jaxtron.data.tokenizers import load_tokenizer

    manifest = os.path.join(os.path.expanduser(data_path.split(",")[0].strip()), "manifest.json")
    with open(manifest) as f:
        tokenizer = json.load(f).get("tokenizer") or {}
    try:
        return load_tokenizer("byte" if tokenizer.get("kind") == "byte" else tokenizer.get("path") or "")
    except DataError as e:
        raise ConfigError(f"train.eval_tasks needs the token store's tokenizer: {e}") from None


class TaskEvaluator:
    """Scores ``train.eval_tasks`` on the parameters it is given, with one compiled model reused every time."""

    def __init__(self, cfg: Config, graphdef: Any, mesh):
        try:
            from lm_eval.tasks import TaskManager
        except ImportError:
            raise ConfigError("train.eval_tasks needs lm-eval; install it with pip install -e \".[eval]\".") from None
        t = cfg.train
        self.graphdef, self.mesh, self.limit = graphdef, mesh, t.eval_tasks_limit or None
        self.tasks = [name.strip() for name in t.eval_tasks.split(",") if name.strip()]
        self.manager = TaskManager(include_path=os.path.expanduser(t.eval_tasks_path), include_defaults=False)
        missing = [name for name in self.tasks if name not in self.manager.all_tasks]
        if missing:
            raise ConfigError(f"config field 'train.eval_tasks' names {', '.join(repr(m) for m in missing)}, not a "
                              f"task of the YAML files in train.eval_tasks_path ('{t.eval_tasks_path}'); name tasks "
                              "defined there.")
        self.tokenizer = store_tokenizer(cfg.data.path)
        self.lm = None

    def __call__(self, params: Any) -> dict[str, float]:
        import lm_eval
        from flax import nnx

        from jaxtron.inference.harness import JaxtronLM

        model = nnx.merge(self.graphdef, params)
        if self.lm is None:
            self.lm = JaxtronLM.from_model(model, self.tokenizer, self.mesh)
        else:  # the same shapes: the programs compiled for the first evaluation run again
            self.lm.generator.state = nnx.state(model)
        results = lm_eval.simple_evaluate(model=self.lm, tasks=self.tasks, task_manager=self.manager,
                                          limit=self.limit, bootstrap_iters=0, log_samples=False)
        scores = {}
        for task in self.tasks:
            for key, value in results["results"][task].items():
                metric, _, _ = key.partition(",")
                if isinstance(value, (int, float)) and metric != "sample_len" and not metric.endswith("_stderr"):
                    scores[f"eval/{task}/{metric}"] = float(value)
        return scores


def task_hook(cfg: Config) -> list[Hook]:
    """``train.eval_tasks`` scored every ``train.eval_every`` steps and after the last, as a hook of the run (none
    when no task is named). Its scores go into metrics.jsonl and the run's summary (``Trainer.record``)."""
    if not cfg.train.eval_tasks.strip():
        return []
    bound: dict[str, Any] = {}

    def start(trainer) -> None:
        bound["trainer"] = trainer
        bound["score"] = TaskEvaluator(trainer.cfg, trainer.setup.graphdef, trainer.mesh)

    def run(done: int, metrics: dict[str, Any]) -> None:
        trainer = bound["trainer"]
        trainer.record(done, bound["score"](trainer.state.params))

    return [Hook(cfg.train.eval_every, run, name="tasks", last=True, start=start)]

