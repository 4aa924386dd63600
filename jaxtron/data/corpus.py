"""An offline text corpus present on every machine: the Python standard library's own source."""

from __future__ import annotations

import dataclasses
import os
import sysconfig

import numpy as np

from jaxtron.config import ConfigError

HELD_OUT_EVERY = 20  # every 20th file (in sorted order) is held out for evaluation


@dataclasses.dataclass(frozen=True)
class ByteCorpus:
    train: np.ndarray  # uint8 tokens
    held_out: np.ndarray
    files: int


def stdlib_files(root: str | None = None) -> list[str]:
    """Sorted paths of the standard library's .py files, without tests and installed packages."""
    root = root or sysconfig.get_paths()["stdlib"]
    found = []
    for directory, subdirs, names in os.walk(root):
        subdirs[:] = sorted(d for d in subdirs if d not in ("site-packages", "dist-packages", "test", "tests",
                                                            "idlelib", "__pycache__"))
        found += [os.path.join(directory, n) for n in names if n.endswith(".py")]
    return sorted(found)


def load_stdlib_bytes(root: str | None = None) -> ByteCorpus:
    """Byte-level tokens (0..255) of the standard library, split by file into train and held-out."""
    files = stdlib_files(root)
    if not files:
        raise ConfigError(f"no Python source files were found under {root or sysconfig.get_paths()['stdlib']}; "
                          "use --config.data.source=synthetic on this machine.")
    train, held_out = [], []
    for i, path in enumerate(files):
        with open(path, "rb") as f:
            (held_out if i % HELD_OUT_EVERY == 0 else train).append(f.read())
    as_array = lambda parts: np.frombuffer(b"".join(parts), dtype=np.uint8)
    return ByteCorpus(train=as_array(train), held_out=as_array(held_out), files=len(files))


def unigram_entropy(tokens: np.ndarray, vocab_size: int) -> float:
    """Entropy in nats of the token frequency distribution: the loss of the best context-free model."""
    counts = np.bincount(tokens, minlength=vocab_size).astype(np.float64)
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())
