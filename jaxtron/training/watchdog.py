"""Step watchdog: a warning, naming the step and the process, when a step takes far longer than usual.

The loop reports each step when its result is read back (``completed``); the time between two reports, less
the time the loop spent waiting for input batches, is the step's duration: a slow device, a slow collective or
a straggling peer process show up there. The wait for a step's input batch is reported on its own
(``input``) and names that step. Either one above ``factor`` times the median of the recent step
durations logs a warning; a background thread also reports a step that has not ended yet (a hang: a stuck
collective, a dead peer). Host work that is not training (evaluation, a checkpoint save) is bracketed by
``pause``/``resume`` and not counted.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import statistics
import threading
import time
from collections.abc import Callable

log = logging.getLogger(__name__)


class Watchdog:
    def __init__(self, factor: float, process: int, *, window: int = 50, min_steps: int = 5,
                 poll_s: float = 1.0, clock: Callable[[], float] = time.perf_counter, thread: bool = True):
        self.factor, self.process, self.min_steps, self.poll_s = factor, process, min_steps, poll_s
        self.clock = clock
        self.durations: collections.deque[float] = collections.deque(maxlen=window)
        self.slow_steps = 0  # steps reported as slow, when they ended
        self._lock = threading.Lock()
        self._last_step: int | None = None  # the last step that ended
        self._since: float | None = None  # when it ended (None: paused)
        self._hang_reported: tuple[str, int] | None = None  # ("step" or "input", step) last reported hung
        self._input_s = 0.0  # input waits since the last step ended, not part of any step's duration
        self._input_since: float | None = None  # when the loop began waiting for an input batch
        self._input_step = 0
        self._stop = threading.Event()
        self._thread = None
        if factor and thread:
            self._thread = threading.Thread(target=self._watch, name="jaxtron-watchdog", daemon=True)
            self._thread.start()

    def start(self, step: int) -> None:
        """Training resumes after ``step`` (the last one done): the clock runs for the next one."""
        with self._lock:
            self._last_step, self._since = step, self.clock()

    def pause(self) -> None:
        with self._lock:
            self._since = None
            self._input_s = 0.0

    def resume(self) -> None:
        with self._lock:
            self._since = self.clock()

    def _median(self) -> float | None:
        """The median recent step duration, once there are enough steps to trust it (None: too few or off)."""
        if not self.factor or len(self.durations) < self.min_steps:
            return None
        return statistics.median(self.durations)

    def completed(self, step: int) -> None:
        """Step ``step`` has ended (its result was read)."""
        now = self.clock()
        with self._lock:
            since, self._last_step, self._since = self._since, step, now
            input_s, self._input_s = self._input_s, 0.0
            if since is None:
                return
            duration, median = now - since - input_s, self._median()
            if median is not None and duration > self.factor * median:
                self.slow_steps += 1
                log.warning("watchdog: step %d took %.3g s on process %d, %.1f times the median of the last %d "
                            "steps (%.3g s)", step, duration, self.process, duration / median,
                            len(self.durations), median)
            self.durations.append(duration)

    @contextlib.contextmanager
    def input(self, step: int):
        """Brackets the loop's wait for the input batch of step ``step``."""
        with self._lock:
            self._input_since, self._input_step = self.clock(), step
        try:
            yield
        finally:
            with self._lock:
                seconds, self._input_since = self.clock() - self._input_since, None
                if self._since is not None:
                    self._input_s += seconds
                median = self._median()
                slow = median is not None and seconds > self.factor * median
                if slow:
                    self.slow_steps += 1
            if slow:
                log.warning("watchdog: the input batch of step %d took %.3g s to arrive on process %d, %.1f times "
                            "the median step (%.3g s)", step, seconds, self.process, seconds / median, median)

    def check(self) -> bool:
        """Reports a step (or an input batch) still running past the threshold, once; True when it did."""
        now = self.clock()
        with self._lock:
            median = self._median()
            if self._since is None or self._last_step is None or median is None:
                return False
            if self._input_since is not None:
                what, step, running = "input", self._input_step, now - self._input_since
            else:
                what, step, running = "step", self._last_step + 1, now - self._since - self._input_s
            if running <= self.factor * median or self._hang_reported == (what, step):
                return False
            self._hang_reported = (what, step)
        if what == "input":
            log.warning("watchdog: the input batch of step %d has not arrived after %.3g s on process %d, %.1f "
                        "times the median step (%.3g s); the input pipeline may be stuck", step, running,
                        self.process, running / median, median)
        else:
            log.warning("watchdog: step %d has run for %.3g s on process %d and has not finished, %.1f times the "
                        "median of the last %d steps (%.3g s); a peer process may be stuck or gone", step,
                        running, self.process, running / median, len(self.durations), median)
        return True

    def _watch(self) -> None:
        while not self._stop.wait(self.poll_s):
            self.check()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
