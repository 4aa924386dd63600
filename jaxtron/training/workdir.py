"""A training run's directory: checked before the run, kept consistent with the state the run starts from, and left
as it was by a run that is refused."""

from __future__ import annotations

import json
import os
import shutil

import jax

from jaxtron.common.files import atomic_path, jsonl_lines
from jaxtron.config.schema import ConfigError


def listing(workdir: str) -> list[str] | None:
    """What ``workdir`` holds now (None: it does not exist), for ``remove_created`` after a refusal."""
    return sorted(os.listdir(workdir)) if os.path.isdir(workdir) else None


def check_writable(workdir: str) -> None:
    """Makes ``workdir`` if it is missing and writes a probe file there; a ConfigError if it cannot."""
    try:
        os.makedirs(workdir, exist_ok=True)
        probe = os.path.join(workdir, f".write_test.{jax.process_index()}")
        with open(probe, "w") as f:
            f.write("ok")
        os.remove(probe)
    except OSError as e:
        raise ConfigError(f"workdir '{workdir}' is not writable ({e.strerror}); pass a writable --workdir.") from None


def remove_created(workdir: str, before: list[str] | None) -> None:
    """Removes what a refused run made in ``workdir`` (all of it if the run made the directory itself); nothing
    that was there before has changed yet."""
    if jax.process_index() != 0:
        return
    if before is None:
        shutil.rmtree(workdir, ignore_errors=True)
        return
    for name in set(os.listdir(workdir)) - set(before):
        path = os.path.join(workdir, name)
        shutil.rmtree(path, ignore_errors=True) if os.path.isdir(path) else os.remove(path)


def drop_metrics_after(workdir: str, step: int) -> None:
    """Keeps metrics.jsonl consistent with the state the run starts from: lines of later steps (and a line cut by
    a kill) are dropped, to be logged again."""
    path = os.path.join(workdir, "metrics.jsonl")
    if not os.path.exists(path):
        return
    lines = [line + "\n" for line in jsonl_lines(path) if line.strip() and _logged_step(line) <= step]
    with atomic_path(path) as aside, open(aside, "w", encoding="utf-8") as f:
        f.writelines(lines)


def _logged_step(line: str) -> int:
    try:
        return int(json.loads(line).get("step", 0))
    except (ValueError, TypeError, AttributeError):
        raise ConfigError(f"metrics.jsonl holds a line that is not a logged step ({line[:60]!r}); the file is "
                          "damaged: move it aside to resume.") from None
