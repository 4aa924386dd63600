"""Batch sources and the assembly of global jax.Arrays from process-local data.

A batch is a dict of int32 [global_batch, seq_len] arrays: 'inputs' and 'targets' (inputs shifted
by one). Batch ``i`` depends only on (seed, i), so a resumed run sees the same batches.
"""

from __future__ import annotations

from typing import Protocol

import jax
import numpy as np
from jax.sharding import Mesh

from jaxtron.config import Config, ConfigError
from jaxtron.sharding import batch_sharding


class Source(Protocol):
    seq_len: int

    def local_batch(self, step: int, rows: np.ndarray | slice) -> dict[str, np.ndarray]:
        """The given rows (indices into the global batch) of batch ``step``."""


class WindowSource:
    """Random fixed-length windows of one token array (seeded per step)."""

    def __init__(self, tokens: np.ndarray, seq_len: int, global_batch: int, seed: int):
        if tokens.size < seq_len + 2:
            raise ConfigError(f"the corpus has {tokens.size} tokens, fewer than data.seq_len + 2 = {seq_len + 2}; "
                              "shorten --config.data.seq_len.")
        self.tokens, self.seq_len, self.global_batch, self.seed = tokens, seq_len, global_batch, seed

    def local_batch(self, step: int, rows: np.ndarray | slice) -> dict[str, np.ndarray]:
        rng = np.random.default_rng([self.seed, step])
        starts = rng.integers(0, self.tokens.size - self.seq_len - 1, size=self.global_batch)[rows]
        windows = np.stack([self.tokens[s:s + self.seq_len + 1] for s in starts]).astype(np.int32)
        return {"inputs": windows[:, :-1], "targets": windows[:, 1:]}


class SyntheticSource:
    """Uniformly random tokens: the same batch format with no I/O, for benchmarks."""

    def __init__(self, vocab_size: int, seq_len: int, global_batch: int, seed: int):
        self.vocab_size, self.seq_len, self.global_batch, self.seed = vocab_size, seq_len, global_batch, seed

    def local_batch(self, step: int, rows: np.ndarray | slice) -> dict[str, np.ndarray]:
        rng = np.random.default_rng([self.seed, step])
        windows = rng.integers(0, self.vocab_size, size=(self.global_batch, self.seq_len + 1), dtype=np.int32)[rows]
        return {"inputs": windows[:, :-1], "targets": windows[:, 1:]}


def _local_indices(sharding, shape: tuple[int, ...], dim: int) -> np.ndarray:
    """Indices along ``dim`` that this process's devices hold, in order, each once."""
    spans = sorted({(i[dim].start or 0, shape[dim] if i[dim].stop is None else i[dim].stop)
                    for i in sharding.addressable_devices_indices_map(shape).values()})
    return np.concatenate([np.arange(a, b) for a, b in spans])


def global_batch(source: Source, step: int, mesh: Mesh, batch_size: int) -> dict[str, jax.Array]:
    """Loads only this process's part of batch ``step`` and assembles the sharded global arrays.

    Which rows (and sequence positions) a process needs follows from the batch sharding, so it is
    right for any mesh, including tensor or sequence parallelism across processes.
    """
    sharding = batch_sharding(mesh)
    shape = (batch_size, source.seq_len)
    rows, cols = _local_indices(sharding, shape, 0), _local_indices(sharding, shape, 1)
    local = source.local_batch(step, rows)
    return {k: jax.make_array_from_process_local_data(sharding, np.ascontiguousarray(v[:, cols]), shape)
            for k, v in local.items()}


def make_sources(cfg: Config) -> tuple[Source, Source | None, dict[str, float]]:
    """Train source, held-out source (or None) and facts about the data to log."""
    d, t = cfg.data, cfg.train
    if d.source == "synthetic":
        return SyntheticSource(cfg.model.vocab_size, d.seq_len, t.global_batch_size, t.seed), None, {}
    from jaxtron.data.corpus import load_stdlib_bytes, unigram_entropy
    corpus = load_stdlib_bytes()
    facts = {"train_tokens": float(corpus.train.size), "held_out_tokens": float(corpus.held_out.size),
             "unigram_entropy": unigram_entropy(corpus.train, 256)}
    train = WindowSource(corpus.train, d.seq_len, t.global_batch_size, t.seed)
    held_out = WindowSource(corpus.held_out, d.seq_len, t.global_batch_size, t.seed + 1)
    return train, held_out, facts
