"""Checksums of the files of a checkpoint: recorded after a save, verified before a restore.

Every process records the files it wrote in ``<step>/integrity.process_<i>.json`` (path relative to the
step directory, size, xxh3-128 hash). Attribution: orbax writes each process's array data into paths
named after the process (``ocdbt.process_<i>/``, ``array_metadatas/process_<i>``); everything else (the
tree metadata, shardings, the merged OCDBT root, the JSON items, commit markers) is written by process 0
alone. So a path with a ``process_<i>`` component belongs to process i and every other path to process 0:
each file is recorded exactly once, by the process whose page cache still holds it.

Files are hashed while the save is still running (``Watcher``): orbax writes its array files front to
back, and each is read back chunk by chunk right behind the writer, from the page cache that has just
received it, in parallel with the rest of the save. At the commit only what the watcher has not read
(each file's last partial chunk, small metadata files, anything rewritten) is read, plus a few sampled
chunks per file that confirm the running hash still describes the file.

Verification does not follow that attribution (a run may restore with another number of processes):
the recorded files are split over the verifying processes by size, each hashes its share, and the
verdicts are gathered so that every process reaches the same decision.
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
import threading
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import xxhash

log = logging.getLogger(__name__)

MANIFEST = "integrity.process_{}.json"
DAMAGED_DIR = "checkpoints_damaged"
NO_MANIFEST = ("no integrity manifest (cut off between the save and its checksums, or written by a version "
               "without checksums)")
CHUNK_BYTES = 8 << 20  # memory per hashing thread stays bounded whatever the file size
THREADS = min(4, os.cpu_count() or 1)  # xxhash releases the GIL: files are hashed in parallel
_PROCESS_PART = re.compile(r"(?:^|\.)process_(\d+)$")
MESSAGE_BYTES = 400  # a verdict travels between processes as a fixed-size byte array
POLL_S = 0.25  # how often a Watcher looks for new whole chunks (a page cache holds far more than 0.25 s of writes)
SAMPLED_CHUNKS = 2  # chunks re-read at the commit, besides the first and the last, to confirm a running hash


def hash_file(path: str) -> str:
    """xxh3-128 of a file's contents (hex), read in chunks."""
    digest, buffer = xxhash.xxh3_128(), bytearray(CHUNK_BYTES)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buffer):
            digest.update(view[:n])
    return digest.hexdigest()


def writer_of(relative_path: str) -> int:
    """The process that wrote a file of a step directory (see the module docstring)."""
    for part in relative_path.split("/"):
        match = _PROCESS_PART.search(part)
        if match:
            return int(match.group(1))
    return 0


def _files(step_dir: str, process_index: int) -> list[str]:
    """The files of a step directory that process ``process_index`` wrote (relative paths, sorted); other
    processes' folders are never listed (on a shared file system every process does this)."""
    found = []
    for root, dirs, names in os.walk(step_dir):
        dirs[:] = [d for d in dirs if (m := _PROCESS_PART.search(d)) is None or int(m.group(1)) == process_index]
        for name in names:
            rel = os.path.relpath(os.path.join(root, name), step_dir).replace(os.sep, "/")
            # the manifests themselves (also while being written) are not recorded
            if not rel.startswith("integrity.") and writer_of(rel) == process_index:
                found.append(rel)
    return sorted(found)


def _hash_all(step_dir: str, paths: list[str]) -> list[str]:
    with ThreadPoolExecutor(THREADS) as pool:
        return list(pool.map(lambda p: hash_file(os.path.join(step_dir, p)), paths))


class _Progress:
    """What a Watcher has read of one file so far: the running hash of its first ``offset`` bytes (whole
    chunks) and each of those chunks' own hash, to check later that they were not written again."""
    __slots__ = ("chunks", "digest", "offset")

    def __init__(self):
        self.digest, self.offset, self.chunks = xxhash.xxh3_128(), 0, []


def _read_chunk(f, offset: int, buffer: bytearray) -> memoryview | None:
    """CHUNK_BYTES of an open file from ``offset``, or None if the file ends before."""
    f.seek(offset)
    n, view = 0, memoryview(buffer)
    while n < len(buffer) and (got := f.readinto(view[n:])):
        n += got
    return view if n == len(buffer) else None


class Watcher:
    """Hashes the files this process writes for one step while orbax is still writing them (module
    docstring): ``start()`` before the save, then ``record(..., known=watcher.stop())`` once it is committed.

    Each file's whole chunks are fed to a running hash as soon as they exist, from the page cache that has
    just received them. A file is known by its device and inode, which orbax's renames of the temporary
    step directory keep. Reading behind the writer is exact for files written once, front to back, which is
    how tensorstore writes the OCDBT data files that hold the arrays. ``record`` checks that assumption
    before it trusts a running hash: it re-reads the first and last chunk and SAMPLED_CHUNKS others, and
    hashes the whole file again if any differs, if the file shrank, or if it is new."""

    def __init__(self, checkpoints_dir: str, step: int, process_index: int = 0):
        self.directory, self.step, self.process_index = checkpoints_dir, str(step), process_index
        self.files: dict[tuple[int, int], _Progress] = {}
        self.hash_s = 0.0  # time spent reading and hashing in the background, for benchmarks
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"checksums-watch-{step}", daemon=True)
        self._error: BaseException | None = None

    def start(self) -> Watcher:
        self._thread.start()
        return self

    def stop(self) -> dict[tuple[int, int], _Progress]:
        """Ends the watch (after the chunks being read) and returns what was read of each file."""
        self._stop.set()
        self._thread.join()
        if self._error is not None:  # a failed watch only costs the reading it did not do
            log.warning("hashing checkpoint files during the save failed (%s); they are hashed after it", self._error)
        return self.files

    def _growing(self) -> list[tuple[str, _Progress, int]]:
        """This process's files of the step with at least one whole chunk not read yet."""
        found = []
        try:
            tops = [n for n in os.listdir(self.directory) if n == self.step or n.startswith(self.step + ".")]
        except FileNotFoundError:
            return found
        for top in tops:
            for rel in _files(os.path.join(self.directory, top), self.process_index):
                path = os.path.join(self.directory, top, rel)
                try:
                    st = os.stat(path)
                except FileNotFoundError:  # renamed or removed meanwhile
                    continue
                progress = self.files.setdefault((st.st_dev, st.st_ino), _Progress())
                if st.st_size < progress.offset:  # written anew: start over
                    progress = self.files[(st.st_dev, st.st_ino)] = _Progress()
                if st.st_size - progress.offset >= CHUNK_BYTES:
                    found.append((path, progress, st.st_size))
        return found

    @staticmethod
    def _advance(path: str, progress: _Progress, size: int) -> None:
        buffer = bytearray(CHUNK_BYTES)
        try:
            with open(path, "rb", buffering=0) as f:
                while progress.offset + CHUNK_BYTES <= size:
                    view = _read_chunk(f, progress.offset, buffer)
                    if view is None:
                        return
                    progress.digest.update(view)
                    progress.chunks.append(xxhash.xxh3_64_intdigest(view))
                    progress.offset += CHUNK_BYTES
        except FileNotFoundError:
            pass

    def _run(self) -> None:
        try:
            with ThreadPoolExecutor(THREADS) as pool:
                while not self._stop.wait(POLL_S):
                    growing = self._growing()
                    if growing:
                        start = time.perf_counter()
                        list(pool.map(lambda g: self._advance(*g), growing))
                        self.hash_s += time.perf_counter() - start
        except BaseException as e:  # noqa: BLE001 - reported by stop()
            self._error = e


def _finish(path: str, progress: _Progress | None) -> str:
    """The file's hash: the watcher's running hash completed with the bytes after it, if the sampled chunks
    still hold what it read; otherwise the whole file read again."""
    if progress is None or not progress.chunks:
        return hash_file(path)
    n = len(progress.chunks)
    sampled = {0, n - 1} | set(random.Random(path).sample(range(n), min(n, SAMPLED_CHUNKS)))
    buffer = bytearray(CHUNK_BYTES)
    with open(path, "rb", buffering=0) as f:
        for i in sorted(sampled):
            view = _read_chunk(f, i * CHUNK_BYTES, buffer)
            if view is None or xxhash.xxh3_64_intdigest(view) != progress.chunks[i]:
                log.warning("%s changed after it was hashed during the save; hashing it again", path)
                return hash_file(path)
        digest = progress.digest.copy()
        f.seek(progress.offset)
        while got := f.readinto(buffer):
            digest.update(memoryview(buffer)[:got])
    return digest.hexdigest()


def record(step_dir: str, process_index: int = 0, process_count: int = 1,
           known: dict[tuple[int, int], _Progress] | None = None) -> dict:
    """Hashes the files of a committed step directory that this process wrote (completing what a ``Watcher``
    read of them during the save) and writes its manifest (atomically: a manifest is either complete or
    absent)."""
    paths = _files(step_dir, process_index)
    stats = [os.stat(os.path.join(step_dir, p)) for p in paths]
    known = known or {}
    with ThreadPoolExecutor(THREADS) as pool:
        hashes = list(pool.map(lambda p, st: _finish(os.path.join(step_dir, p), known.get((st.st_dev, st.st_ino))),
                               paths, stats))
    manifest = {"process_index": process_index, "process_count": process_count, "hash": "xxh3_128",
                "files": {p: {"size": st.st_size, "hash": h} for p, st, h in zip(paths, stats, hashes, strict=True)}}
    path = os.path.join(step_dir, MANIFEST.format(process_index))
    with open(path + ".tmp", "w") as f:
        json.dump(manifest, f, indent=0)
        f.flush()
        os.fsync(f.fileno())
    os.replace(path + ".tmp", path)
    return manifest


class Damage(Exception):
    """Why a checkpoint cannot be trusted (the message is the reason alone)."""


def read_manifests(step_dir: str) -> dict[str, dict]:
    """{relative path: {"size", "hash"}} of every recorded file; raises Damage when a manifest is absent."""
    def load(i: int) -> dict:
        path = os.path.join(step_dir, MANIFEST.format(i))
        if not os.path.exists(path):
            raise Damage(NO_MANIFEST if i == 0 else f"no integrity manifest of process {i} ({MANIFEST.format(i)})")
        try:
            with open(path) as f:
                return json.load(f)
        except (OSError, ValueError) as e:
            raise Damage(f"unreadable integrity manifest {MANIFEST.format(i)} ({type(e).__name__})") from None
    first = load(0)
    files = dict(first["files"])
    for i in range(1, int(first["process_count"])):
        files.update(load(i)["files"])
    return files


def share(files: dict[str, dict], process_index: int, process_count: int) -> list[str]:
    """The files process ``process_index`` verifies: largest first to the least-loaded process, so the
    shares cover every file once and take about equally long; the same on every process."""
    load, owner = [0] * process_count, {}
    for path in sorted(files, key=lambda p: (-files[p]["size"], p)):
        least = load.index(min(load))
        owner[path] = least
        load[least] += files[path]["size"]
    return sorted(p for p, o in owner.items() if o == process_index)


def check(step_dir: str, process_index: int = 0, process_count: int = 1) -> str | None:
    """The reason this process's share of a step directory is damaged, or None if it is intact. Sizes and
    presence are checked before anything is hashed, so a truncated or deleted file is found at once."""
    try:
        files = read_manifests(step_dir)
    except Damage as e:
        return str(e)
    mine = share(files, process_index, process_count)
    problems = []
    for p in mine:
        try:
            size = os.path.getsize(os.path.join(step_dir, p))
        except OSError:
            problems.append(f"{p} missing")
            continue
        if size != files[p]["size"]:
            what = "truncated" if size < files[p]["size"] else "longer than recorded"
            problems.append(f"{p} {what} ({size} of {files[p]['size']} bytes)")
    if not problems:
        problems = [f"{p} checksum mismatch" for p, h in zip(mine, _hash_all(step_dir, mine), strict=True)
                    if h != files[p]["hash"]]
    if not problems:
        return None
    return problems[0] + (f" and {len(problems) - 1} more file(s)" if len(problems) > 1 else "")


def first_reason(reasons: Iterable[str | None]) -> str | None:
    """The verdict of all processes from each one's verdict: damaged if any process found damage."""
    return next((r for r in reasons if r), None)


def agree(reason: str | None) -> str | None:
    """Every process's verdict gathered, so that all of them fall back to the same step (one small
    allgather; nothing to gather with a single process)."""
    import jax
    if jax.process_count() == 1:
        return reason
    from jax.experimental import multihost_utils
    encoded = np.zeros(MESSAGE_BYTES, np.uint8)
    raw = (reason or "").encode()[:MESSAGE_BYTES]
    encoded[:len(raw)] = np.frombuffer(raw, np.uint8)
    gathered = np.asarray(multihost_utils.process_allgather(encoded))
    return first_reason(bytes(row).rstrip(b"\0").decode(errors="replace") or None for row in gathered)


def check_everywhere(step_dir: str) -> str | None:
    """The reason a step directory is damaged, as agreed by all processes (each hashes its share)."""
    import jax
    return agree(check(step_dir, jax.process_index(), jax.process_count()))


def steps_in(checkpoints_dir: str) -> list[int]:
    """The committed steps of a checkpoint directory, oldest first."""
    names = os.listdir(checkpoints_dir) if os.path.isdir(checkpoints_dir) else []
    return sorted(int(n) for n in names if n.isdigit())


def newest_intact(checkpoints_dir: str, steps: list[int], load=None) -> tuple[int | None, object, list[tuple]]:
    """Walks ``steps`` newest first to the first whose files verify (agreed by all processes) and that
    ``load(step) -> (value, reason)`` reads with no reason; returns (that step or None, its value, the
    (step, reason) of each newer damaged one, each named in a warning as it is found)."""
    damaged = []
    for step in sorted(steps, reverse=True):
        reason, value = check_everywhere(os.path.join(checkpoints_dir, str(step))), None
        if reason is None and load is not None:
            value, reason = load(step)
        if reason is None:
            return step, value, damaged
        damaged.append((step, reason))
        if reason == NO_MANIFEST and step == max(steps):
            log.warning("checkpoint %d in %s is unfinished: the run stopped before its checksums were recorded; %s",
                        step, checkpoints_dir,
                        "falling back to an earlier one" if len(steps) > 1 else "the run starts from step 0")
        else:
            log.warning("checkpoint %d in %s is damaged: %s; falling back to an earlier one", step,
                        checkpoints_dir, reason)
    return None, None, damaged


def none_intact(checkpoints_dir: str, damaged: list[tuple], then: str = "") -> str:
    """The sentence for a run none of whose checkpoints is intact (``damaged`` newest first), ending in ``then``."""
    step, reason = damaged[0]
    return (f"none of the {len(damaged)} checkpoint(s) in '{checkpoints_dir}' is intact (the newest, step {step}: "
            f"{reason}); list them with `jaxtron verify {os.path.dirname(checkpoints_dir)}`"
            f"{then}.")


def move_aside(step_dir: str) -> str:
    """Moves a damaged step directory to ``<workdir>/checkpoints_damaged/`` (kept, never deleted: its step
    number is free again for a new save); returns where it went."""
    parent = os.path.join(os.path.dirname(os.path.dirname(step_dir)), DAMAGED_DIR)
    os.makedirs(parent, exist_ok=True)
    target, n = os.path.join(parent, os.path.basename(step_dir)), 1
    while os.path.exists(target):
        target, n = os.path.join(parent, f"{os.path.basename(step_dir)}.{n}"), n + 1
    os.rename(step_dir, target)
    return target


def incomplete_saves(checkpoints_dir: str) -> list[str]:
    """The names of the saves in ``checkpoints_dir`` that were cut off while being written (orbax's temporary
    directories, never loaded)."""
    names = os.listdir(checkpoints_dir) if os.path.isdir(checkpoints_dir) else []
    return sorted(n for n in names if ".orbax-checkpoint-tmp" in n)
