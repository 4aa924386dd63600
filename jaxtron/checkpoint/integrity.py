"""Checksums of the files of a checkpoint: recorded after a save, verified before a restore.

Every process records the files it wrote in ``<step>/integrity.process_<i>.json`` (path relative to the
step directory, size, xxh3-128 hash). Attribution: orbax writes each process's array data into paths
named after the process (``ocdbt.process_<i>/``, ``array_metadatas/process_<i>``); everything else (the
tree metadata, shardings, the merged OCDBT root, the JSON items, commit markers) is written by process 0
alone. So a path with a ``process_<i>`` component belongs to process i and every other path to process 0:
each file is recorded exactly once, by the process whose page cache still holds it.

Verification does not follow that attribution (a run may restore with another number of processes):
the recorded files are split over the verifying processes by size, each hashes its share, and the
verdicts are gathered so that every process reaches the same decision.
"""

from __future__ import annotations

import json
import logging
import os
import re
from concurrent.futures import ThreadPoolExecutor
from typing import Iterable

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


def _files(step_dir: str) -> list[str]:
    found = []
    for root, _, names in os.walk(step_dir):
        for name in names:
            rel = os.path.relpath(os.path.join(root, name), step_dir).replace(os.sep, "/")
            if not rel.startswith("integrity."):  # the manifests themselves, also while being written
                found.append(rel)
    return sorted(found)


def _hash_all(step_dir: str, paths: list[str]) -> list[str]:
    with ThreadPoolExecutor(THREADS) as pool:
        return list(pool.map(lambda p: hash_file(os.path.join(step_dir, p)), paths))


def record(step_dir: str, process_index: int = 0, process_count: int = 1) -> dict:
    """Hashes the files of a committed step directory that this process wrote and writes its manifest
    (atomically: a manifest is either complete or absent)."""
    paths = [p for p in _files(step_dir) if writer_of(p) == process_index]
    sizes = [os.path.getsize(os.path.join(step_dir, p)) for p in paths]
    manifest = {"process_index": process_index, "process_count": process_count, "hash": "xxh3_128",
                "files": {p: {"size": s, "hash": h} for p, s, h in zip(paths, sizes, _hash_all(step_dir, paths))}}
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
        problems = [f"{p} checksum mismatch" for p, h in zip(mine, _hash_all(step_dir, mine))
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
        log.warning("checkpoint %d in %s is damaged: %s; falling back to an earlier one", step, checkpoints_dir,
                    reason)
    return None, None, damaged


def none_intact(checkpoints_dir: str, damaged: list[tuple], then: str = "") -> str:
    """The sentence for a run none of whose checkpoints is intact (``damaged`` newest first), ending in ``then``."""
    step, reason = damaged[0]
    return (f"none of the {len(damaged)} checkpoint(s) in '{checkpoints_dir}' is intact (the newest, step {step}: "
            f"{reason}); list them with `python -m jaxtron.checkpoint verify {os.path.dirname(checkpoints_dir)}`"
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


def report(workdir: str) -> tuple[list[str], int]:
    """One line per checkpoint of a run (intact, or damaged and why) and the exit code: 0 if all are
    intact, 2 if any is damaged or there is none."""
    directory = os.path.join(os.path.abspath(workdir), "checkpoints")
    steps = steps_in(directory)
    if not steps:
        return [f"'{directory}' holds no checkpoint; point verify at the --workdir of a run that saved one."], 2
    lines, damaged = [], 0
    for step in steps:
        step_dir = os.path.join(directory, str(step))
        reason = check(step_dir)
        damaged += reason is not None
        if reason:
            lines.append(f"step {step}: damaged: {reason}")
        else:
            files = read_manifests(step_dir)
            total = sum(f["size"] for f in files.values())
            lines.append(f"step {step}: intact ({len(files)} files, {total / 1e6:.1f} MB)")
    incomplete = sorted(n for n in os.listdir(directory) if "tmp" in n)
    lines += [f"{n}: a save cut off while being written; never loaded" for n in incomplete]
    lines.append(f"{len(steps) - damaged} of {len(steps)} checkpoints intact in {directory}")
    return lines, 2 if damaged else 0
