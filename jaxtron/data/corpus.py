"""Built-in offline corpora, prepared into a token store on first use."""

from __future__ import annotations

import logging
import os
import sysconfig

import numpy as np

from jaxtron.data.errors import DataError
from jaxtron.data.store import MANIFEST

log = logging.getLogger(__name__)


def stdlib_files(root: str | None = None) -> list[str]:
    """Sorted UTF-8 .py files of the Python standard library, without tests and installed packages."""
    root = root or sysconfig.get_paths()["stdlib"]
    found = []
    for directory, subdirs, names in os.walk(root):
        subdirs[:] = sorted(d for d in subdirs if d not in ("site-packages", "dist-packages", "test", "tests",
                                                            "idlelib", "__pycache__"))
        for name in names:
            path = os.path.join(directory, name)
            if name.endswith(".py") and _is_utf8(path):
                found.append(path)
    return sorted(found)


def _is_utf8(path: str) -> bool:
    try:
        with open(path, "rb") as f:
            f.read().decode("utf-8")
        return True
    except (UnicodeDecodeError, OSError):
        return False


def ensure_builtin(name: str, path: str) -> None:
    """Prepares built-in corpus ``name`` into ``path`` unless a complete store is already there."""
    if os.path.isfile(os.path.join(path, MANIFEST)):
        return
    if name != "stdlib":
        raise DataError(f"built-in corpus '{name}' does not exist; use data.prepare='stdlib' or ''.")
    if os.path.isdir(path) and os.listdir(path) or os.path.isfile(path):
        raise DataError(f"data.path '{path}' exists but holds no token store; point data.path at an empty or "
                        "missing directory for data.prepare, or remove it.")
    from jaxtron.data.prepare import prepare
    files = stdlib_files()
    if not files:
        raise DataError("no Python source files were found in the standard library; use "
                        "--config.data.source=synthetic on this machine.")
    log.info("preparing the standard library's %d source files as byte tokens into %s (once)", len(files), path)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    prepare(files, "byte", path)


def unigram_entropy(tokens: np.ndarray | list[np.ndarray], vocab_size: int) -> float:
    """Entropy in nats of the token frequency distribution (of one array or several together): the loss of
    the best context-free model."""
    counts = np.zeros(vocab_size, np.float64)
    for part in tokens if isinstance(tokens, list) else [tokens]:
        for i in range(0, part.size, 1 << 22):  # bincount widens to int64: chunks keep that copy small
            counts += np.bincount(part[i:i + (1 << 22)], minlength=vocab_size)
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())
