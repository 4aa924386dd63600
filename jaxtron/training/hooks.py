"""What runs beside the training loop: the parts a run builds together (``RunParts``), and the ``Hook``s that run
after a step, each at its cadence (a name, a step interval, ``run(done, metrics)``). A run's hooks
(``jaxtron.training.loop.Trainer.hooks``) are, in order: the profiler's window, the metrics' log line, the progress
bar, the mid-run evaluation and the checkpoint."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from jaxtron.data.loader import BatchIterator
    from jaxtron.metrics.writers import MetricsWriter
    from jaxtron.training.preemption import PreemptionWatcher, StopVotes
    from jaxtron.training.profiling import Meter, ProfileWindow
    from jaxtron.training.step_flags import StepFlags
    from jaxtron.training.watchdog import Watchdog


@dataclasses.dataclass(frozen=True)
class Hook:
    name: str
    every: int  # runs after every ``every``-th step (0: never by its cadence)
    run: Callable[[int, dict[str, Any]], None]  # (steps done, that step's metrics)
    # after the run's last step: True always, False never (the run's end does that work), None by its cadence
    last: bool | None = None
    # whether it reads the state or the step's outputs, so that the loop reads the step's flags first
    reads_step: bool = False

    def due(self, done: int, steps: int) -> bool:
        """Whether it runs after ``done`` of the run's ``steps`` steps."""
        if done == steps and self.last is not None:
            return self.last
        return bool(self.every) and done % self.every == 0


@dataclasses.dataclass
class RunParts:
    """What a run with steps left runs beside its state, built together (``Trainer._parts``), closed together."""
    batches: BatchIterator
    votes: StopVotes
    compiled: Any
    compile_s: float
    eval_fn: Callable
    tasks: Callable | None  # train.eval_tasks' evaluator
    writer: MetricsWriter | None  # the main process's
    meter: Meter
    profile: ProfileWindow
    preemption: PreemptionWatcher
    watchdog: Watchdog
    flags: StepFlags
