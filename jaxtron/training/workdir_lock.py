"""One run per workdir: process 0 holds an advisory lock (``fcntl.flock``) on ``<workdir>/run.lock`` for the
run's life. A second run on the same workdir is refused in one sentence naming the holder (exit 2). The kernel
drops the lock when its holder dies, so a SIGKILLed run leaves nothing stuck: the next run takes it over.

Several processes of one run agree: process 0 decides and shares its verdict through the coordination service,
so every process is refused together or none is. The lock protects a workdir on one file system that honours
``flock`` (local disks and NFSv4 do).
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import socket
import time

import jax

from jaxtron.config.schema import ConfigError

log = logging.getLogger(__name__)

LOCK_FILE = "run.lock"
_VERDICT = "jaxtron/workdir_lock"  # the coordination key process 0 shares its verdict under
_WAIT_MS = 600_000  # what the other processes wait for it: process 0 may still be starting
_ORPHAN_WAIT_S = 30.0  # how long a dead holder's children (forked data workers) may keep the lock


def _holder(path: str) -> str:
    """Who the lock file says holds it, as words for a sentence."""
    try:
        with open(path) as f:
            held = json.load(f)
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(held["since"]))
        return f"process {held['pid']} on {held['host']}, since {since}"
    except (OSError, ValueError, KeyError, TypeError):
        return "another process"


def _holder_is_gone(path: str) -> bool:
    """Whether the lock file names a process of this host that no longer runs. Its forked children may still
    hold the lock for a moment after it was killed."""
    try:
        with open(path) as f:
            held = json.load(f)
        if held["host"] != socket.gethostname():
            return False
        os.kill(int(held["pid"]), 0)
    except ProcessLookupError:
        return True
    except (OSError, ValueError, KeyError, TypeError):
        return False
    return False


class WorkdirLock:
    """The lock of ``workdir``, taken by ``acquire`` and given back by ``release`` (``close``)."""

    def __init__(self, workdir: str):
        self.workdir, self.path = workdir, os.path.join(workdir, LOCK_FILE)
        self._fd: int | None = None

    def acquire(self) -> WorkdirLock:
        """Takes the lock, or raises ConfigError naming its holder. With several processes, process 0 takes it
        and the others raise the same sentence when it could not."""
        refusal = self._take() if jax.process_index() == 0 else None
        if jax.process_count() > 1:
            from jaxtron.parallel import coordination
            if jax.process_index() == 0:
                coordination.share(_VERDICT, refusal or "")
            else:
                refusal = coordination.wait_for(_VERDICT, _WAIT_MS) or None
        if refusal:
            raise ConfigError(refusal)
        return self

    def _take(self) -> str | None:
        """None when this process now holds the lock; else the sentence refusing the run."""
        os.makedirs(self.workdir, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o666)
        deadline = time.monotonic() + _ORPHAN_WAIT_S
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError as e:
                if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    os.close(fd)
                    raise
            if not _holder_is_gone(self.path) or time.monotonic() > deadline:
                os.close(fd)
                return (f"workdir '{self.workdir}' is in use by another run ({_holder(self.path)}); wait for it "
                        "to end, stop it, or pass another --workdir.")
            time.sleep(0.2)
        previous = _holder(self.path) if os.path.getsize(self.path) else None
        if previous is not None:  # the holder ended without giving it back (killed): nothing is stuck
            log.info("took over the lock of workdir %s from %s, which no longer runs", self.workdir, previous)
        os.ftruncate(fd, 0)
        os.write(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "since": time.time()}).encode())
        self._fd = fd
        return None

    def close(self) -> None:
        """Gives the lock back; the file stays empty, which says that no run holds it."""
        if self._fd is None:
            return
        os.ftruncate(self._fd, 0)
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        os.close(self._fd)
        self._fd = None
