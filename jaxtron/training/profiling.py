"""What the loop measures: a profiler window over chosen steps, step annotations, device memory readings, and each
log interval's losses, time and data wait (``Meter``).

The trace (``jax.profiler``, viewable in TensorBoard's profile plugin or Perfetto) starts once step
``profile.start_step`` has finished on the device and stops once step ``profile.end_step`` has, so it holds
exactly the steps numbered start_step+1 .. end_step in metrics.jsonl, each dispatched under a
``StepTraceAnnotation`` named 'train' with its step number. Waiting for the device at the two window edges is
what keeps other steps out; the steps inside run as usual. Next to the trace, ``window.json`` records the
window, its wall time and the number of devices the trace covers (``jaxtron.metrics.report`` reads it).
"""

from __future__ import annotations

import glob
import logging
import os
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from jaxtron.common.files import write_json
from jaxtron.config.schema import ProfileConfig
from jaxtron.metrics.throughput import Throughput
from jaxtron.training.step_flags import scalar_metrics

log = logging.getLogger(__name__)

WINDOW_FILE = "window.json"
PIPELINE_FILE = "pipeline.json"


def trace_files(directory: str) -> list[str]:
    """Perfetto traces (``perfetto_trace.json.gz``) under a profile directory, oldest first."""
    return sorted(glob.glob(os.path.join(directory, "plugins", "profile", "*", "perfetto_trace.json.gz")),
                  key=os.path.getmtime)


class ProfileWindow:
    def __init__(self, cfg: ProfileConfig, workdir: str, start: int):
        """``start``: the step the run starts from (a resumed run that is past the window's start skips it)."""
        self.cfg = cfg
        self.directory = cfg.dir or os.path.join(workdir, "profile")
        if jax.process_count() > 1 and cfg.processes.strip() != "0":  # several processes trace: one folder each
            self.directory = os.path.join(self.directory, f"process_{jax.process_index()}")
        self.enabled = cfg.traces(jax.process_index())
        self.running = False
        self._began = 0.0
        if self.enabled and start > cfg.start_step:
            log.warning("the run starts at step %d, after profile.start_step (%d): no trace is written", start,
                        cfg.start_step)
            self.enabled = False

    def before_step(self, finished: int, wait: Callable[[], None]) -> None:
        """Called before dispatching step ``finished + 1``; starts the trace at the window's start."""
        if self.enabled and not self.running and finished == self.cfg.start_step:
            wait()  # the steps before the window finish outside the trace
            os.makedirs(self.directory, exist_ok=True)
            jax.profiler.start_trace(self.directory, create_perfetto_trace=True)
            self.running, self._began = True, time.perf_counter()
            log.info("profiling steps %d to %d into %s", self.cfg.start_step + 1, self.cfg.end_step, self.directory)

    def write_pipeline_layout(self, mesh, schedule, hlo: str | None) -> None:
        """``pipeline.json`` next to the trace: the schedule, its loops in the compiled step's HLO text and the
        stage of each traced device (``jaxtron.metrics.bubble``); nothing without the HLO text."""
        from jaxtron.metrics.bubble import phase_ops, schedule_loops, schedule_steps, stage_layout
        from jaxtron.training.pipeline.fill_drain import SCOPE
        from jaxtron.training.pipeline.one_f_one_b import BACKWARD_PHASE, FORWARD_PHASE

        if hlo is None:
            return
        loops = schedule_loops(hlo, SCOPE)
        phases = None
        if schedule.kind in ("1f1b", "interleaved"):  # one loop: its iterations' two phases, by their scopes
            phases = phase_ops(hlo, loops.get("forward", []), {"forward": FORWARD_PHASE, "backward": BACKWARD_PHASE})
        os.makedirs(self.directory, exist_ok=True)
        write_json(os.path.join(self.directory, PIPELINE_FILE),
                   stage_layout(mesh, schedule, loops, phases, schedule_steps(hlo, SCOPE)))

    def annotate(self, step: int):
        """The context to dispatch step ``step`` in: named 'train' with its number in the trace."""
        return jax.profiler.StepTraceAnnotation("train", step_num=step)

    def after_step(self, done: int, wait: Callable[[], None]) -> None:
        """Called after dispatching step ``done``; stops the trace at the window's end."""
        if self.running and done == self.cfg.end_step:
            wait()  # the last step of the window completes inside the trace
            self._stop(done)

    def close(self, done: int) -> None:
        """Stops a trace still running (the run ended inside the window) and says so in window.json."""
        if self.running:
            self._stop(done)

    def _stop(self, done: int) -> None:
        wall = time.perf_counter() - self._began
        jax.profiler.stop_trace()
        self.running = False
        traces = trace_files(self.directory)
        window = {"start_step": self.cfg.start_step, "end_step": done, "complete": done == self.cfg.end_step,
                  "steps": done - self.cfg.start_step, "wall_s": wall, "devices": jax.local_device_count(),
                  "process_index": jax.process_index(),
                  "trace": os.path.relpath(traces[-1], self.directory) if traces else None}
        write_json(os.path.join(self.directory, WINDOW_FILE), window)
        log.info("profile of steps %d to %d written to %s (%.2f s)", self.cfg.start_step + 1, done,
                 self.directory, wall)


def device_memory() -> dict[str, float]:
    """GiB in use and at peak on the fullest local device, where the backend reports it (GPUs do; the CPU
    backend reports nothing, and then this is empty)."""
    in_use, peak = [], []
    for device in jax.local_devices():
        stats = device.memory_stats() or {}
        if "bytes_in_use" in stats:
            in_use.append(stats["bytes_in_use"])
        if "peak_bytes_in_use" in stats:
            peak.append(stats["peak_bytes_in_use"])
    out = {}
    if in_use:
        out["memory_in_use_gib"] = max(in_use) / 2**30
    if peak:
        out["memory_peak_gib"] = max(peak) / 2**30
    return out


class Meter:
    """What one log interval measured: its losses (kept on the device until the log step), wall time and the
    time the host blocked on the loader."""

    def __init__(self, throughput: Throughput, constants: dict[str, float] | None = None):
        self.throughput, self.constants = throughput, constants or {}
        self.reset()

    def reset(self) -> None:
        self.start, self.losses, self.data_wait = time.perf_counter(), [], 0.0

    def restart_clock(self) -> None:  # evaluation time is not training time
        self.start, self.data_wait = time.perf_counter(), 0.0

    def values(self, metrics: dict[str, Any]) -> dict[str, float]:
        steps, interval = len(self.losses), time.perf_counter() - self.start
        values = scalar_metrics(jax.device_get(metrics))
        values["loss_avg"] = float(np.mean(jax.device_get(self.losses)))  # since the last log line
        values.update(self.throughput(interval, steps))
        values.update(interval_steps=steps, data_wait_s=self.data_wait / steps,  # per step, host blocked on data
                      data_wait_share=self.data_wait / interval)
        values.update(device_memory())
        values.update(self.constants)
        return values
