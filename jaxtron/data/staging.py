"""A store writer's private directory beside its output, and its lock.

Each writer fills a directory of its own and renames it into place when done. Two processes preparing the same
output at once (two runs of one built-in corpus) therefore never mix shards. A lock file inside marks a live
writer; the kernel releases it when the process dies, so the next writer removes what a killed one left.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import tempfile
import time

TMP_MARK = ".tmp-"  # a writer's directory beside its output: "<output>.tmp-<random>"
WRITER_LOCK = ".writer.lock"  # held while a writer lives; the kernel drops it when the process dies
UNLOCKED_GRACE_S = 60.0  # a directory without a lock file yet may be a writer between creating and locking it


def _remove_if_abandoned(tmp: str) -> None:
    """Removes a writer's directory whose process is gone: nobody holds its lock."""
    try:
        lock = open(os.path.join(tmp, WRITER_LOCK), "a")  # noqa: SIM115 (held across the removal)
    except FileNotFoundError:
        if time.time() - os.path.getmtime(tmp) > UNLOCKED_GRACE_S:
            shutil.rmtree(tmp, ignore_errors=True)
        return
    with lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return  # a live writer: another process preparing the same output
        shutil.rmtree(tmp, ignore_errors=True)


def claim_writer_dir(output: str):
    """A fresh directory beside ``output`` and its held lock. Writers at one output never share a directory, so
    two preparing at once cannot mix shards; a killed one's directory goes at the next claim."""
    parent, name = os.path.split(output)
    os.makedirs(parent, exist_ok=True)
    for entry in os.listdir(parent):
        if entry.startswith(name + TMP_MARK):
            _remove_if_abandoned(os.path.join(parent, entry))
    tmp = tempfile.mkdtemp(prefix=name + TMP_MARK, dir=parent)
    lock = open(os.path.join(tmp, WRITER_LOCK), "w")  # noqa: SIM115 (held until the store is published)
    fcntl.flock(lock, fcntl.LOCK_EX)
    return tmp, lock
