"""What a training run ended with (``RunSummary``), its last log line, and the final metrics ``jaxtron.train``
returns."""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass
class RunSummary:
    """What a training run ended with."""

    state: Any  # the final train state
    history: list[dict[str, Any]]  # the lines this process logged in this run, each with its step
    preempted: str | None = None  # why the run stopped before train.steps (a signal, another process's request)
    stopped_at: int | None = None  # the step it checkpointed then
    final_loss: float | None = None  # mean train loss of the last log interval
    validation_loss: float | None = None  # mean cross-entropy over the validation batches at the end
    compile_time_s: float | None = None
    slow_steps: int = 0  # steps the watchdog reported as slow
    tokens_per_sec: float | None = None  # of the last log interval, as the next three
    tflops_per_device: float | None = None
    mfu: float | None = None
    data: dict[str, Any] = dataclasses.field(default_factory=dict)  # facts of the training text (tokens, entropy)
    scores: dict[str, float] = dataclasses.field(default_factory=dict)  # each evaluation's newest values

    def metrics(self) -> dict[str, Any]:
        """The final metrics: the last logged line of this run, the newest evaluation scores, and how it ended
        (``preempted``: None, or why it stopped early; ``stopped_at``: that step)."""
        last = self.history[-1] if self.history else {}
        return {**last, **self.scores, "preempted": self.preempted, "stopped_at": self.stopped_at}


def summary_line(summary: RunSummary) -> str:
    """The run's last log line: what it reached, each number saying what it is a mean of."""
    steps = (summary.history[-1].get("interval_steps") if summary.history else None) or 0
    over = f"the last {steps} steps" if steps != 1 else "the last step"
    parts = [f"train loss {summary.final_loss:.4f} nats/token (mean of {over})"]
    if summary.validation_loss is not None:
        parts.append(f"validation loss {summary.validation_loss:.4f}")
    if summary.data.get("unigram_entropy") is not None:
        parts.append(f"unigram entropy of the text {summary.data['unigram_entropy']:.4f}")
    return "done: " + "; ".join(parts)
