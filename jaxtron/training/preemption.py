"""Preemption: SIGTERM or SIGUSR1 (what Slurm sends before preemption or the time limit, e.g.
``#SBATCH --signal=USR1@120``) asks the loop to checkpoint at the next step boundary and exit with
PREEMPTED_EXIT_CODE, so a job script can tell "stopped early, requeue me" from success or failure.
"""

from __future__ import annotations

import logging
import signal
import threading

log = logging.getLogger(__name__)

PREEMPTED_EXIT_CODE = 75  # EX_TEMPFAIL: temporary failure, run again
SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class PreemptionWatcher:
    """Records a stop request from a signal; restores the previous handlers on close."""

    def __init__(self):
        self.requested: str | None = None
        self._previous = {}
        if threading.current_thread() is threading.main_thread():  # handlers only work in the main thread
            for sig in SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        self.requested = signal.Signals(signum).name
        log.warning("received %s: checkpointing at the next step boundary, then exiting with %d",
                    self.requested, PREEMPTED_EXIT_CODE)

    def close(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
