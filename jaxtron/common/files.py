"""Crash-consistent files: whatever moment a process dies at (a kill, a preemption, a full disk), every file it was
writing is either complete or recognisably incomplete, and the readers cope.

- Whole-file outputs (config.json, reports, plots, converted models) are written aside in the same directory and
  renamed over the target (``write_atomic``, ``atomic_path``): a reader sees the old file or the new one.
- Append-only logs (metrics.jsonl) are written a line at a time; a kill can leave only the last line cut, with no
  newline. ``complete_lines`` reads the lines before it and names the cut part, which readers drop with a warning,
  and ``drop_cut_tail`` removes it before a writer appends again.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator

log = logging.getLogger(__name__)

ASIDE = ".partial"  # the infix of a file being written aside; a leftover one is never read


def _umask() -> int:
    """The process's umask, read without setting it (setting it, even briefly, races the saving threads)."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1], 8) for line in f if line.startswith("Umask:"))
    except (OSError, StopIteration, ValueError):
        return 0o022  # the common default, where /proc says nothing


@contextlib.contextmanager
def atomic_path(path: str) -> Iterator[str]:
    """A path in ``path``'s directory to write the whole file to; renamed over ``path`` once the block ends
    without an exception (flushed to disk first), removed otherwise."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, aside = tempfile.mkstemp(prefix=f".{os.path.basename(path)}{ASIDE}.", dir=directory)
    os.chmod(aside, 0o666 & ~_umask())  # mkstemp makes it 0600; the file gets the mode open() would give it
    os.close(fd)
    try:
        yield aside
        with open(aside, "rb") as f:
            os.fsync(f.fileno())
        os.replace(aside, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(aside)
        raise
    _sync_directory(directory)


@contextlib.contextmanager
def staged_directory(out_dir: str) -> Iterator[str]:
    """A directory to build ``out_dir`` in, beside it (``.<name>.partial``), renamed to ``out_dir`` (which must be
    absent or empty) once the block ends without an exception and removed otherwise; one left by a killed process
    is removed first. A reader never sees part of ``out_dir``, and a retry finds nothing in its way."""
    out_dir = os.path.abspath(out_dir)
    parent = os.path.dirname(out_dir)
    staging = os.path.join(parent, f".{os.path.basename(out_dir)}{ASIDE}")
    shutil.rmtree(staging, ignore_errors=True)
    os.makedirs(staging)
    try:
        yield staging
        if os.path.isdir(out_dir):
            os.rmdir(out_dir)
        os.rename(staging, out_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    _sync_directory(parent)


def user_path(path: str) -> str:
    """A path as a user typed it (relative, ``~``, a trailing slash) made absolute."""
    return os.path.abspath(os.path.expanduser(path))


def write_atomic(path: str, data: str | bytes) -> None:
    """Writes ``data`` (text as UTF-8) to ``path`` as one step: a reader never sees part of it."""
    with atomic_path(path) as aside, open(aside, "wb") as f:
        f.write(data.encode("utf-8") if isinstance(data, str) else data)


def write_json(path: str, value, indent: int | None = 1) -> None:
    """``value`` as JSON in ``path``, written atomically (``write_atomic``)."""
    import json

    write_atomic(path, json.dumps(value, indent=indent) + "\n")


def _sync_directory(directory: str) -> None:
    """Makes a rename in ``directory`` durable (a no-op where directories cannot be opened)."""
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def complete_lines(path: str) -> tuple[list[str], str]:
    """(the complete lines of the text file ``path``, each without its newline; the cut last line, or '' when the
    file ends in a newline). A process killed while appending leaves at most its last line cut."""
    with open(path, "rb") as f:
        data = f.read()
    end = data.rfind(b"\n") + 1
    return data[:end].decode("utf-8", errors="replace").splitlines(), data[end:].decode("utf-8", errors="replace")


def drop_cut_tail(path: str) -> str:
    """Truncates the log ``path`` after its last complete line, so that the next append starts a line of its own;
    returns what was dropped ('' if nothing), after a warning naming it."""
    if not os.path.exists(path):
        return ""
    with open(path, "rb+") as f:
        data = f.read()
        end = data.rfind(b"\n") + 1
        if end == len(data):
            return ""
        f.truncate(end)
    cut = data[end:].decode("utf-8", errors="replace")
    log.warning("%s ended in a cut line (%d bytes, a process stopped while writing it); dropped it", path, len(cut))
    return cut


def jsonl_lines(path: str) -> list[str]:
    """The lines of the JSON Lines log ``path``: a last line cut by a kill is left out with a warning (one that is
    whole JSON but for its newline is kept)."""
    import json

    lines, cut = complete_lines(path)
    if cut.strip():
        try:
            json.loads(cut)
            lines.append(cut)
        except ValueError:
            log.warning("%s: its last line is cut (the writer stopped midway); left out", path)
    return lines
