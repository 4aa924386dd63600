"""Packed training sequences from token stores, addressed by a global sample index.

A split ('train' or 'validation') is a list of runs of whole documents of a store (see ``split_ranges``);
its tokens, the runs back to back, form one stream, and window ``i`` is the stream's tokens
[i*L, i*L + L + 1), so every token is a target once per epoch. A window may hold the end of one
document and the start of others: segment ids number the documents inside it, positions count from 0
at the start of each document or, for a document that began before the window, at the window's start
(so every position is below L, whatever the document's length, as in Megatron and MaxText), and the
loss mask drops targets that begin a new document and, in a conversation store, targets the assistant did not
write. Sample ``g`` of the run maps, through a seeded global shuffle (a new permutation each epoch,
jaxtron.data.shuffle), to a window. Everything is a pure function
of (seed, g): any process can build any row, and a run resumes from a step number.
"""

from __future__ import annotations

import math

import numpy as np

from jaxtron.data.errors import DataError
from jaxtron.data.shuffle import EpochPermutation
from jaxtron.data.store import TokenStore

STRIPES = 100  # validation documents come from this many evenly spaced places in the store


def split_ranges(store: TokenStore, split: str, validation_fraction: float) -> np.ndarray:
    """Token ranges [begin, end) (an int64 array of shape (n, 2)) of the documents of ``split``.

    The store's documents, in order, are cut into S = min(STRIPES, held) stripes of equal document
    count, and the last documents of each stripe, ``held`` = ceil(fraction * documents) in all, are
    held out for validation: validation documents come from the whole (sorted) corpus, not from its
    last input files, and the split depends on nothing but the store and the fraction.
    """
    n = store.num_documents
    if validation_fraction <= 0:
        return np.array([[0, store.num_tokens]] if split == "train" else [], np.int64).reshape(-1, 2)
    held = math.ceil(n * validation_fraction)
    if held >= n:
        raise DataError(f"store '{store.path}' has {n} document(s), too few to hold out "
                        f"{validation_fraction:.0%} for validation; lower data.validation_fraction.")
    stripes = min(STRIPES, held)
    k = np.arange(stripes + 1, dtype=np.int64)
    bounds = k * n // stripes  # document index where each stripe begins
    quota = np.diff(k * held // stripes)  # held-out documents per stripe, adding up to `held`
    cut = bounds[1:] - np.minimum(quota, np.diff(bounds))  # first validation document of each stripe
    docs = np.stack([bounds[:-1], cut], 1) if split == "train" else np.stack([cut, bounds[1:]], 1)
    docs = docs[docs[:, 1] > docs[:, 0]]
    return store.doc_start(docs)


class PackedSplit:
    """The windows of one split ('train' or 'validation') of a store."""

    def __init__(self, store: TokenStore, seq_len: int, split: str, validation_fraction: float, seed: int):
        self.store, self.seq_len = store, seq_len
        self.ranges = split_ranges(store, split, validation_fraction)
        # the split's stream: token v of it is store token ranges[r, 0] + v - self._offsets[r]
        self._offsets = np.concatenate([[0], np.cumsum(self.ranges[:, 1] - self.ranges[:, 0])]).astype(np.int64)
        self.num_tokens = int(self._offsets[-1])
        self.num_windows = (self.num_tokens - 1) // seq_len
        if self.num_windows < 1:
            raise DataError(f"the {split} split of store '{store.path}' has {self.num_tokens} tokens, fewer than one "
                            f"sequence of data.seq_len + 1 = {seq_len + 1}; use more data or a shorter sequence.")
        self._order = EpochPermutation(self.num_windows, seed)
        self._blocks: dict[int, np.ndarray] = {}
        # a block spans a few epochs at most: each epoch of a small split costs its own permutation keys
        self._block = min(self.BLOCK, max(1024, self.num_windows))

    BLOCK = 1 << 16  # samples whose windows are computed together: steps read neighbouring samples

    def windows(self, samples: np.ndarray) -> np.ndarray:
        samples = np.asarray(samples, dtype=np.int64)
        size = self._block
        block = samples // size
        for b in np.unique(block):
            if int(b) not in self._blocks:
                if len(self._blocks) >= 4:
                    self._blocks.pop(next(iter(self._blocks)))
                self._blocks[int(b)] = self._order(np.arange(b * size, (b + 1) * size))
        if (block == block[0]).all():
            return self._blocks[int(block[0])][samples - block[0] * size]
        return np.array([self._blocks[int(b)][g - b * size] for g, b in zip(samples, block, strict=True)], np.int64)

    def store_positions(self, stream: np.ndarray) -> np.ndarray:
        """Store token positions of positions ``stream`` of this split's stream."""
        r = np.searchsorted(self._offsets, stream, side="right") - 1
        return self.ranges[r, 0] + (stream - self._offsets[r])

    def token_parts(self, limit: int) -> list[np.ndarray]:
        """At most ``limit`` tokens of the split, the same share from the start of each of its runs of
        documents (so from the whole store), one array (a view of the memory map) per run; in a conversation
        store, only those of them that carry loss."""
        share = max(1, limit // len(self.ranges))
        parts = [(int(b), int(min(e - b, share))) for b, e in self.ranges]
        if self.store.has_loss_mask:
            return [self.store.read(b, n)[self.store.take_mask(np.arange(b, b + n)).astype(bool)] for b, n in parts]
        return [self.store.read(b, n) for b, n in parts]

    def rows(self, samples: np.ndarray) -> dict[str, np.ndarray]:
        """The packed sequences of global samples ``samples``."""
        L = self.seq_len
        starts = self.windows(samples) * L
        where = self.store_positions(starts[:, None] + np.arange(L + 1))
        inside = where[:, -1] - where[:, 0] == L  # rows within one run of documents: one contiguous read
        if inside.all():
            tokens = self.store.gather(where[:, 0], L + 1)
        else:
            tokens = np.empty(where.shape, self.store.dtype)
            tokens[inside] = self.store.gather(where[inside, 0], L + 1)
            tokens[~inside] = self.store.take(where[~inside])
        tokens = tokens.astype(np.int32)
        doc = self.store.doc_index(where)
        new = np.ones(doc.shape, bool)
        new[:, 1:] = doc[:, 1:] != doc[:, :-1]  # a document (or the row) starts here
        t = np.broadcast_to(np.arange(L + 1), doc.shape)
        positions = (t - np.maximum.accumulate(np.where(new, t, 0), axis=1)).astype(np.int32)
        segments = np.cumsum(new, axis=1).astype(np.int32)
        loss_mask = ~new[:, 1:]
        if self.store.has_loss_mask:  # a conversation store: only what the assistant wrote is a target
            loss_mask &= self.store.take_mask(where[:, 1:]).astype(bool)
        return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "segment_ids": segments[:, :-1],
                "positions": positions[:, :-1], "loss_mask": loss_mask.astype(np.int32)}


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
