"""What the train step tells the loop besides its metrics: a stop request, a non-finite stop, and what was not
finite. The loop reads these flags one step late and decides on them."""

from __future__ import annotations

import collections
import logging
from typing import Any

import jax
import numpy as np

from jaxtron.parallel import launch
from jaxtron.training.watchdog import Watchdog

log = logging.getLogger(__name__)

STEP_FLAGS = ("stop_requested", "nonfinite_stopped", "nonfinite_kind")  # for the loop, not metrics
NONFINITE_KINDS = {1: "loss", 2: "gradients", 3: "loss and gradients"}


class NonFiniteError(RuntimeError):
    """Training stopped: too many non-finite steps in a row, or a non-finite state about to be saved."""


class NonFiniteStreak:
    """Follows the run of skipped (non-finite) steps from the flags the loop reads: warns at the first step of
    each run and names it, with what was not finite, when ``train.max_nonfinite_in_row`` stops training."""

    def __init__(self, limit: int, start: int, in_row_at_start: int):
        self.limit = limit
        # a resumed state may already be inside a run of skipped steps (those just before ``start``)
        self.first = start - in_row_at_start + 1 if in_row_at_start else None
        self.seen: tuple[int, int] | None = None  # (step, kind) of the run's first step seen here

    def record(self, step: int, kind: int) -> None:
        if not kind:
            self.first = self.seen = None
            return
        if self.seen is None:  # the first non-finite step of a run that this process saw
            self.first = step if self.first is None else self.first
            self.seen = (step, kind)
            limit = f"training stops after {self.limit} in a row" if self.limit else "train.max_nonfinite_in_row is 0"
            log.warning("step %d: the %s %s not finite; its update was skipped (%s)", step, NONFINITE_KINDS[kind],
                        "were" if kind > 1 else "was", limit)

    def stop_message(self, stopped: int) -> str:
        first = self.first if self.first is not None else stopped - self.limit + 1
        what = f" (step {self.seen[0]}: non-finite {NONFINITE_KINDS[self.seen[1]]})" if self.seen else ""
        return (f"{self.limit} non-finite steps in a row, from step {first} to step {stopped}{what}; their updates "
                "were skipped and training stopped.")


def scalar_metrics(metrics: dict[str, Any]) -> dict[str, float]:
    """Step metrics as floats; a vector such as ``expert_load`` becomes one key per entry (expert_load/0, ...)."""
    values = {}
    for key, value in metrics.items():
        if key in STEP_FLAGS:
            continue
        value = np.asarray(value)
        if value.ndim:
            values.update({f"{key}/{i}": float(v) for i, v in enumerate(value.reshape(-1))})
        else:
            values[key] = float(value)
    return values


class StepFlags:
    """The loop's decisions come from flags the step computes on the device (stop requested, non-finite stop,
    non-finite kind). They are read one step late, so reading never stalls the device; every
    process reads the same flags after the same steps, so all of them take the same decisions."""

    def __init__(self, streak: NonFiniteStreak, watchdog: Watchdog):
        self.streak, self.watchdog = streak, watchdog
        self.unread: collections.deque = collections.deque()  # (step, *STEP_FLAGS) dispatched but not read

    def push(self, step: int, metrics: dict[str, Any]) -> None:
        self.unread.append((step, *(metrics[k] for k in STEP_FLAGS)))

    def read(self, upto: int) -> bool:
        """Reads the flags of steps up to ``upto`` (waiting for them); raises NonFiniteError if training must stop;
        True if a process asked to stop."""
        requested = False
        while self.unread and self.unread[0][0] <= upto:
            step, *flags = self.unread.popleft()
            stop_requested, stopped, kind = (int(x) for x in jax.device_get(flags))
            self.watchdog.completed(step)
            launch.report_step(step)
            self.streak.record(step, kind)
            if stopped >= 0:
                raise NonFiniteError(self.streak.stop_message(stopped))
            requested |= bool(stop_requested)
        return requested
