"""Preemption: SIGTERM or SIGUSR1 (what Slurm sends before preemption or the time limit, e.g.
``#SBATCH --signal=USR1@120``) asks the loop to checkpoint at the next step boundary and exit with
PREEMPTED_EXIT_CODE, so a job script can tell "stopped early, requeue me" from success or failure. Ctrl-C
(SIGINT) does the same, so an interrupted run keeps its progress; a second Ctrl-C ends the process at once.
With several processes, the request travels inside the train step (``StopVotes``), so all of them stop after
the same step even when the signal reaches only one, or reaches them at different steps.
"""

from __future__ import annotations

import logging
import signal
import threading

import jax
import numpy as np
from jax.sharding import Mesh

from jaxtron.parallel.sharding import per_device_sharding

log = logging.getLogger(__name__)

PREEMPTED_EXIT_CODE = 75  # EX_TEMPFAIL: temporary failure, run again
SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)


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
        again = ""
        if signum == signal.SIGINT:  # the next Ctrl-C is the system's: the process ends at once, unsaved
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            again = " (Ctrl-C again to abort without it)"
        log.warning("received %s: checkpointing at the next step boundary, then exiting with %d%s",
                    self.requested, PREEMPTED_EXIT_CODE, again)

    def close(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


class StopVotes:
    """The ``stop_votes`` input of the train step: one int32 flag per device, each process setting its own.

    The step returns their maximum, so a signal that reached any one process is seen by all of them in the
    output of the same step, and every process stops after the same step. Both variants are built once.
    """

    def __init__(self, mesh: Mesh):
        sharding = per_device_sharding(mesh)
        self._arrays = [jax.make_array_from_callback((mesh.size,), sharding,
                                                     lambda index, v=v: np.full((1,), v, np.int32))
                        for v in (0, 1)]

    def __call__(self, requested: bool) -> jax.Array:
        return self._arrays[int(requested)]
