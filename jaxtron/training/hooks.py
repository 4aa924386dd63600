"""What runs beside the training loop: the ``Hook``s that run after a step, each at its cadence, and the parts a
run opens together (``RunParts``). A run's hooks (``jaxtron.training.loop.Trainer.hooks``) are, in order: the
profiler's window, the metrics' log line, the progress bar, the validation loss, the caller's hooks (lm-eval's
tasks among them, ``jaxtron.inference.downstream.task_hook``), and the checkpoint.

``jaxtron.Hook(every=N, run=fn)`` is this class: ``fn(step, metrics)`` runs after every N-th step, with the step's
metrics as numbers.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from jaxtron.config.checks import ConfigError

if TYPE_CHECKING:
    from jaxtron.data.loader import BatchIterator
    from jaxtron.metrics.writers import MetricsWriter
    from jaxtron.training.preemption import PreemptionWatcher, StopVotes
    from jaxtron.training.profiling import ProfileWindow
    from jaxtron.training.step_flags import StepFlags
    from jaxtron.training.watchdog import Watchdog


@dataclasses.dataclass(frozen=True)
class Hook:
    """Work after a step: ``run(step, metrics)`` after every ``every``-th step (0: never by its cadence)."""

    every: int
    run: Callable[[int, dict[str, Any]], None]  # (steps done, that step's metrics)
    name: str = ""
    # after the run's last step: True always, False never, None by its cadence
    last: bool | None = None
    # whether it reads the state or the step's outputs, so that the loop reads the step's flags first
    reads_step: bool = True
    # the metrics as the step's device arrays (the built-in hooks, which must not wait for the device) rather
    # than numbers
    device_metrics: bool = False
    # its time is not training time: the slow-step watchdog pauses and the throughput clock restarts after it
    pauses: bool = True
    start: Callable[[Any], None] | None = None  # called once with the Trainer, after the step is compiled

    def __post_init__(self):
        if not isinstance(self.every, int) or isinstance(self.every, bool) or self.every < 0:
            raise ConfigError(f"Hook(every={self.every!r}) must be a whole number of steps, 0 or more.")
        if not callable(self.run):
            raise ConfigError(f"Hook(run={self.run!r}) must be a function of (step, metrics).")

    def due(self, done: int, steps: int) -> bool:
        """Whether it runs after ``done`` of the run's ``steps`` steps."""
        if done == steps and self.last is not None:
            return self.last
        return bool(self.every) and done % self.every == 0


@dataclasses.dataclass
class RunParts:
    """What a run with steps left opens beside its state (``Trainer._open_parts``), closed by the run's stack."""
    batches: BatchIterator
    votes: StopVotes
    writer: MetricsWriter | None  # the main process's
    profile: ProfileWindow
    preemption: PreemptionWatcher
    watchdog: Watchdog
    flags: StepFlags
