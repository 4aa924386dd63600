"""Weights & Biases beside metrics.jsonl and TensorBoard (``train.wandb_project``; empty: off).

The run id is kept in ``workdir/wandb_run_id``, so a run resumed after preemption or requeue goes on in the same
W&B run. W&B receives every metric metrics.jsonl holds, under the same keys, the run's config with its workdir,
and the run's name (``train.wandb_name``, else the workdir's name). ``WANDB_MODE`` (offline, disabled) and
``WANDB_DIR`` are W&B's own; without ``WANDB_DIR`` its files go into the workdir. W&B runs in a process of
its own and reads metrics after they are computed, so it cannot change a loss.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import secrets
import string
from collections.abc import Mapping
from typing import Any

from jaxtron.common.files import write_atomic

log = logging.getLogger(__name__)

RUN_ID_FILE = "wandb_run_id"


def wandb_missing(project: str) -> str | None:
    """The sentence that refuses a run asking for W&B without the package (None: fine)."""
    if not project or importlib.util.find_spec("wandb") is not None:
        return None
    return ("config field 'train.wandb_project' is set but the wandb package is not installed; install it (pip "
            "install 'jaxtron[wandb]') or leave the field empty.")


def run_id(workdir: str) -> str:
    """The W&B run id of the run in ``workdir``: the one it used before, else a new one, kept for a resume."""
    path = os.path.join(workdir, RUN_ID_FILE)
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            kept = f.read().strip()
        if kept:
            return kept
    alphabet = string.ascii_lowercase + string.digits  # what W&B's own run ids are made of
    new = "".join(secrets.choice(alphabet) for _ in range(8))
    write_atomic(path, new + "\n")  # atomic: a kill leaves the old file or the new one
    return new


class WandbSink:
    """One W&B run that the metrics writer hands every record to."""

    def __init__(self, workdir: str, project: str, name: str, config: Mapping[str, Any]):
        import wandb
        workdir = os.path.abspath(workdir)
        self.id = run_id(workdir)
        self.run = wandb.init(project=project, name=name or os.path.basename(workdir), id=self.id, resume="allow",
                              dir=os.environ.get("WANDB_DIR") or workdir, config={**config, "workdir": workdir},
                              notes=f"workdir: {workdir}")
        log.info("W&B run %s (%s) in project %s", self.id, self.run.name, project)

    def write(self, step: int, values: Mapping[str, Any]) -> None:
        """Logs one metrics.jsonl record at its step (None values, which JSON writes as null, are left out)."""
        record = {key: value for key, value in values.items() if value is not None}
        if step < self.run.step:  # a resumed run repeats the steps after its checkpoint, with the same values
            return
        self.run.log(record, step=int(step))

    def close(self) -> None:
        self.run.finish()
