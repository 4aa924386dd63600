"""Packed training sequences from token stores, addressed by a global sample index.

A store's tokens form one stream; window ``i`` of a split is the stream's tokens
[begin + i*L, begin + i*L + L + 1), so every token is a target once per epoch. A window may hold
the end of one document and the start of others: segment ids number the documents inside it,
positions restart at 0 for each document, and the loss mask drops targets that begin a new
document. Sample ``g`` of the run maps, through a seeded global shuffle (a new permutation each
epoch, jaxtron.data.shuffle), to a window. Everything is a pure function of (seed, g): any process can build any
row, and a run resumes from a step number.
"""

from __future__ import annotations

import math

import numpy as np

from jaxtron.data.errors import DataError
from jaxtron.data.shuffle import EpochPermutation
from jaxtron.data.store import TokenStore


class PackedSplit:
    """The windows of one split ('train' or 'validation') of a store."""

    def __init__(self, store: TokenStore, seq_len: int, split: str, validation_fraction: float, seed: int):
        self.store, self.seq_len = store, seq_len
        begin, end = 0, store.num_tokens
        if validation_fraction > 0:
            held = math.ceil(store.num_documents * validation_fraction)
            if held >= store.num_documents:
                raise DataError(f"store '{store.path}' has {store.num_documents} document(s), too few to hold out "
                                f"{validation_fraction:.0%} for validation; lower data.validation_fraction.")
            split_at = int(store.doc_starts[store.num_documents - held])
            begin, end = (0, split_at) if split == "train" else (split_at, store.num_tokens)
        self.begin = begin
        self.num_windows = (end - begin - 1) // seq_len
        if self.num_windows < 1:
            raise DataError(f"the {split} split of store '{store.path}' has {end - begin} tokens, fewer than one "
                            f"sequence of data.seq_len + 1 = {seq_len + 1}; use more data or a shorter sequence.")
        self._order = EpochPermutation(self.num_windows, seed)
        self._blocks: dict[int, np.ndarray] = {}

    BLOCK = 1 << 16  # samples whose windows are computed together: steps read neighbouring samples

    def windows(self, samples: np.ndarray) -> np.ndarray:
        samples = np.asarray(samples, dtype=np.int64)
        block = samples // self.BLOCK
        for b in np.unique(block):
            if int(b) not in self._blocks:
                if len(self._blocks) >= 4:
                    self._blocks.pop(next(iter(self._blocks)))
                self._blocks[int(b)] = self._order(np.arange(b * self.BLOCK, (b + 1) * self.BLOCK))
        if (block == block[0]).all():
            return self._blocks[int(block[0])][samples - block[0] * self.BLOCK]
        return np.array([self._blocks[int(b)][g - b * self.BLOCK] for g, b in zip(samples, block)], np.int64)

    def rows(self, samples: np.ndarray) -> dict[str, np.ndarray]:
        """The packed sequences of global samples ``samples``."""
        L = self.seq_len
        starts = self.begin + self.windows(samples) * L
        tokens = self.store.gather(starts, L + 1).astype(np.int32)
        where = starts[:, None] + np.arange(L + 1)
        doc = np.searchsorted(self.store.doc_starts, where, side="right") - 1
        positions = (where - self.store.doc_starts[doc]).astype(np.int32)
        segments = (doc - doc[:, :1] + 1).astype(np.int32)
        return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "segment_ids": segments[:, :-1],
                "positions": positions[:, :-1], "loss_mask": (doc[:, 1:] == doc[:, :-1]).astype(np.int32)}


class Mixture:
    """Several splits drawn with fixed weights, in a deterministic interleaving of period ``period``.

    Sample g goes to part schedule[g % period]; its index inside that part counts the earlier samples
    that went there, so each part is read in its own shuffled order without gaps or repeats.
    """

    def __init__(self, parts: list[PackedSplit], weights: list[float], period: int = 1000):
        self.parts, self.period = parts, period
        total = sum(weights)
        quotas = np.array([w / total for w in weights])
        # smooth weighted round robin: every prefix of the schedule follows the weights closely
        credit = np.zeros(len(parts))
        schedule = []
        for _ in range(period):
            credit += quotas
            pick = int(np.argmax(credit))
            credit[pick] -= 1
            schedule.append(pick)
        self.schedule = np.asarray(schedule)
        self.before = np.stack([np.cumsum(self.schedule == p) - (self.schedule == p) for p in range(len(parts))])
        self.per_period = np.bincount(self.schedule, minlength=len(parts))

    def rows(self, samples: np.ndarray) -> dict[str, np.ndarray]:
        samples = np.asarray(samples, dtype=np.int64)
        slot = samples % self.period
        part = self.schedule[slot]
        index = (samples // self.period) * self.per_period[part] + self.before[part, slot]
        out = None
        for p in np.unique(part):
            chosen = np.nonzero(part == p)[0]
            rows = self.parts[p].rows(index[chosen])
            if out is None:
                out = {k: np.empty((len(samples),) + v.shape[1:], v.dtype) for k, v in rows.items()}
            for k, v in rows.items():
                out[k][chosen] = v
        return out
