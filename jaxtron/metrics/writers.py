"""Metric sinks for the training loop: JSONL file, TensorBoard, console (tqdm bar or log lines), and any others.

Only process 0 should build a ``MetricsWriter``; the caller decides. Known metric keys get a fixed
console format: loss, grad_norm, lr, tokens_per_sec, tflops_per_device, mfu (a fraction; shown as a
percentage, 'n/a' when None), step_time_s. Other keys are shown after them.
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Self

import numpy as np

from jaxtron.common.files import drop_cut_tail

logger = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"


def _fmt_mfu(v: float) -> str:
    return f"mfu {100 * v:.1f}%"


# (key, format of a finite value, label used when the value is None)
_CONSOLE: tuple[tuple[str, Callable[[float], str], str], ...] = (
    ("loss", lambda v: f"loss {v:.4f}", "loss n/a"),
    ("grad_norm", lambda v: f"grad_norm {v:.3g}", "grad_norm n/a"),
    ("learning_rate", lambda v: f"lr {v:.1e}", "lr n/a"),
    ("tokens_per_sec", lambda v: f"{v:.2e} tok/s", "n/a tok/s"),
    ("tflops_per_device", lambda v: f"{v:.3g} TFLOP/s/dev", "n/a TFLOP/s/dev"),
    ("mfu", _fmt_mfu, "mfu n/a"),
    ("step_time_s", lambda v: f"{v:.3f} s/step", "n/a s/step"),
)
_CONSOLE_KEYS = {key for key, _, _ in _CONSOLE}
# in metrics.jsonl and TensorBoard, not on the console: one value per expert, and bookkeeping
_FILE_ONLY = ("expert_load/", "interval_steps", "data_wait_s")


def _plain(key: str, value: Any) -> Any:
    """Converts numpy / jax scalars to plain Python values (non-finite floats are kept here)."""
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, (int, np.integer)):
        return int(value)
    if isinstance(value, (float, np.floating)):
        return float(value)
    if hasattr(value, "__array__"):  # numpy / jax arrays holding one number
        array = np.asarray(value)
        if array.size == 1:
            return _plain(key, array.reshape(()).item())
    raise TypeError(f"metric {key!r} must be a number, string or None, not {type(value).__name__}")


def _json_value(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None  # JSON has no NaN/inf; null marks a non-finite value
    return value


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return "n/a" if value is None else str(value)


def format_line(step: int, total_steps: int, metrics: Mapping[str, Any]) -> str:
    """One console line, e.g. 'step 10/200 | loss 3.2101 | ... | mfu n/a | 0.512 s/step'."""
    parts = [f"step {step}/{total_steps}"]
    for key, fmt, missing in _CONSOLE:
        if key in metrics:
            value = metrics[key]
            parts.append(missing if value is None else fmt(value))
    for key, value in metrics.items():
        if key not in _CONSOLE_KEYS and not key.startswith(_FILE_ONLY):
            parts.append(f"{key} {_fmt(value)}")
    return " | ".join(parts)


class MetricsWriter:
    """Writes metrics to ``workdir/metrics.jsonl``, TensorBoard (``workdir``) and the console.

    Args:
      workdir: directory for metrics.jsonl and the TensorBoard event file (created if missing).
      total_steps: length of the progress bar and the denominator in 'step i/N'.
      use_tqdm: progress bar (True) or plain ``logging`` lines (False); None = bar iff stdout is a tty.
      tensorboard: write TensorBoard events (needs tensorboardX).
      sinks: more receivers of every record (``write(step, values)`` and ``close()``), e.g. W&B.
    """

    def __init__(self, workdir: str, total_steps: int, use_tqdm: bool | None = None,
                 tensorboard: bool = True, sinks: Sequence[Any] = ()):
        self.workdir = workdir
        self._sinks = list(sinks)
        self.total_steps = total_steps
        os.makedirs(workdir, exist_ok=True)
        self._tb = None
        if tensorboard:
            try:
                from tensorboardX import SummaryWriter
            except ImportError as e:
                raise ImportError("MetricsWriter needs tensorboardX for TensorBoard events; install it "
                                  "or pass tensorboard=False") from e
            self._tb = SummaryWriter(logdir=workdir, flush_secs=30)
        # Appending keeps the lines of an earlier (e.g. preempted) run in the same workdir, after the line a kill
        # may have cut; open for the writer's life, closed by close()
        drop_cut_tail(os.path.join(workdir, METRICS_FILE))
        self._jsonl = open(os.path.join(workdir, METRICS_FILE), "a", encoding="utf-8")  # noqa: SIM115
        if use_tqdm is None:
            use_tqdm = sys.stdout.isatty()
        self._bar = None
        if use_tqdm:
            from tqdm import tqdm
            self._bar = tqdm(total=total_steps, unit="step", dynamic_ncols=True)
        self._closed = False

    def write(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Records the metrics of ``step`` in every sink."""
        values = {key: _plain(key, value) for key, value in metrics.items()}
        record = {"step": int(step), **{k: _json_value(v) for k, v in values.items()}}
        self._jsonl.write(json.dumps(record, allow_nan=False) + "\n")
        self._jsonl.flush()  # a killed run keeps every line written so far
        if self._tb is not None:
            for key, value in values.items():
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    tag = key if "/" in key else f"train/{key}"
                    self._tb.add_scalar(tag, value, global_step=int(step))
        for sink in self._sinks:
            sink.write(int(step), {k: _json_value(v) for k, v in values.items()})
        if self._bar is None:
            logger.info(format_line(step, self.total_steps, values))
            return
        self._bar.update(max(0, int(step) - self._bar.n))
        postfix = {}
        if values.get("loss") is not None:
            postfix["loss"] = f"{values['loss']:.4f}"
        if values.get("tokens_per_sec") is not None:
            postfix["tok/s"] = f"{values['tokens_per_sec']:.3g}"
        if "mfu" in values:
            postfix["mfu"] = "n/a" if values["mfu"] is None else f"{100 * values['mfu']:.1f}%"
        if postfix:
            self._bar.set_postfix(postfix, refresh=True)
        if any(key.startswith("eval/") for key in values):
            self.log(format_line(step, self.total_steps, values))  # rare and worth a line of its own

    def advance(self, step: int) -> None:
        """Moves the progress bar to ``step`` (every step; the other sinks are written at log steps)."""
        if self._bar is not None and step > self._bar.n:
            self._bar.update(step - self._bar.n)

    def log(self, text: str) -> None:
        """Prints a line: above the progress bar when there is one, else through ``logging``."""
        if self._bar is not None:
            self._bar.write(text)
        else:
            logger.info(text)

    def flush(self) -> None:
        """Flushes the JSONL file and TensorBoard events."""
        self._jsonl.flush()
        if self._tb is not None:
            self._tb.flush()

    def close(self) -> None:
        """Flushes and closes every sink; safe to call twice."""
        if self._closed:
            return
        self._closed = True
        if self._bar is not None:
            self._bar.close()
        if self._tb is not None:
            self._tb.close()
        for sink in self._sinks:
            sink.close()
        self._jsonl.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
