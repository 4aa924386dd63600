"""Batch sources and the iterator that assembles global jax.Arrays from process-local data.

A batch is a dict of int32 [global_batch, seq_len] arrays: 'inputs', 'targets' (inputs shifted by
one), 'segment_ids' (documents inside a packed row, from 1), 'positions' (restarting at each
document and at the row's start, so below model.max_seq_len, which the loader checks) and 'loss_mask'.
When the mesh shards the sequence, the columns of a row follow the rules table's load-balanced layout
(``jaxtron.parallel.sharding.sequence_order``): each token keeps its position and document id, only the column
that holds it changes. Batch ``step`` depends only on (seed, step): the iterator's whole state is the next step
number, and a resumed run sees exactly the batches it would have seen.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os
from typing import Any, Protocol

import jax
import numpy as np
from jax.sharding import Mesh

from jaxtron.config.schema import Config, ConfigError
from jaxtron.data.errors import DataError
from jaxtron.parallel.sharding import batch_sharding, sequence_order, shard_count


class Source(Protocol):
    seq_len: int

    def rows(self, samples: np.ndarray) -> dict[str, np.ndarray]:
        """The rows of global samples ``samples`` (sample = step * global_batch + row)."""


class SyntheticSource:
    """Uniformly random tokens in the same batch format, with no I/O: for benchmarks."""

    def __init__(self, vocab_size: int, seq_len: int, seed: int):
        self.vocab_size, self.seq_len, self.seed = vocab_size, seq_len, seed

    def rows(self, samples: np.ndarray) -> dict[str, np.ndarray]:
        tokens = np.stack([np.random.default_rng([self.seed, int(g)]).integers(
            0, self.vocab_size, self.seq_len + 1, dtype=np.int32) for g in samples])
        ones = np.ones((len(samples), self.seq_len), np.int32)
        return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "segment_ids": ones,
                "positions": np.broadcast_to(np.arange(self.seq_len, dtype=np.int32), ones.shape).copy(),
                "loss_mask": ones}


def _local_indices(sharding, shape: tuple[int, ...], dim: int) -> np.ndarray:
    """Indices along ``dim`` that this process's devices hold, in order, each once."""
    spans = sorted({(i[dim].start or 0, shape[dim] if i[dim].stop is None else i[dim].stop)
                    for i in sharding.addressable_devices_indices_map(shape).values()})
    return np.concatenate([np.arange(a, b) for a, b in spans])


def _local_columns(sharding, shape: tuple[int, ...]) -> np.ndarray:
    """The tokens of a row that this process's devices hold, in the order of their columns: the rules table's
    load-balanced layout of the sequence shards (``sequence_order``)."""
    order = sequence_order(shape[1], shard_count(dict(sharding.mesh.shape), "activation_length"))
    return order[_local_indices(sharding, shape, 1)]


@dataclasses.dataclass(frozen=True)
class BatchLimits:
    """What the model accepts of a batch (None: no limit); a batch beyond it is refused before it reaches
    the devices: positions below ``max_positions`` (model.max_seq_len: a learned table has no row beyond it),
    at most ``max_segments`` documents a row (cuDNN's packed attention is built for that many)."""

    max_positions: int | None = None
    max_segments: int | None = None

    def check(self, local: dict[str, np.ndarray], step: int) -> None:
        check_positions(local, self.max_positions, step)
        check_segments(local, self.max_segments, step)


def check_segments(local: dict[str, np.ndarray], max_segments: int | None, step: int) -> None:
    """Refuses a batch with a row of more documents than the attention kernel was built for."""
    if max_segments and "segment_ids" in local and local["segment_ids"].size:
        most = int(local["segment_ids"].max())  # documents are numbered 1, 2, ... inside each row
        if most > max_segments:
            raise DataError(f"a row of batch {step} packs {most} documents, more than "
                            f"execution.attention_max_segments ({max_segments}) that the cuDNN attention is built "
                            "for; raise execution.attention_max_segments.")


def check_positions(local: dict[str, np.ndarray], max_positions: int | None, step: int) -> None:
    """Refuses a batch with a position outside [0, max_positions): the model has no embedding for it."""
    if max_positions and "positions" in local and local["positions"].size:
        low, high = int(local["positions"].min()), int(local["positions"].max())
        if low < 0 or high >= max_positions:
            raise DataError(f"batch {step} holds position {low if low < 0 else high}, outside the range [0, "
                            f"{max_positions}) of model.max_seq_len; positions must restart inside every row.")


class LocalBatch:
    """This process's part of batch ``step``: the rows and the tokens of each row (``cols``, in column order) its
    devices hold.

    ``limits``: what the model accepts of a row (``BatchLimits``), checked on every batch.
    """

    def __init__(self, source: Source, rows: np.ndarray, cols: np.ndarray, batch_size: int,
                 limits: BatchLimits = BatchLimits(), sample_offset: int = 0):
        self.source, self.rows, self.cols, self.batch_size = source, rows, cols, batch_size
        self.limits, self.sample_offset = limits, sample_offset
        self.whole_rows = np.array_equal(cols, np.arange(source.seq_len))  # every token, in order: no gather

    def __call__(self, step: int) -> dict[str, np.ndarray]:
        local = self.source.rows(self.sample_offset + step * self.batch_size + self.rows)
        self.limits.check(local, step)
        if self.whole_rows:
            return local
        return {k: np.ascontiguousarray(v[:, self.cols]) for k, v in local.items()}


class BatchIterator:
    """Global batches for steps ``step, step+1, ...``, loaded ahead while the device computes.

    workers=0 loads in one background thread; workers>0 uses that many grain worker processes. Row r of step s
    is sample ``sample_offset + s * batch_size + r`` (jaxtron.data.position).
    """

    def __init__(self, source: Source, mesh: Mesh, batch_size: int, step: int = 0, workers: int = 0,
                 prefetch: int = 2, limits: BatchLimits = BatchLimits(), sample_offset: int = 0):
        self.sharding = batch_sharding(mesh)
        self.shape = (batch_size, source.seq_len)
        self.local = LocalBatch(source, _local_indices(self.sharding, self.shape, 0),
                                _local_columns(self.sharding, self.shape), batch_size, limits, sample_offset)
        self.step, self.workers, self.prefetch = step, workers, prefetch
        self._start()

    def _start(self) -> None:
        if self.workers:
            import grain
            from absl import flags
            if not flags.FLAGS.is_parsed():  # grain reads its own absl flags, which the program parses
                raise ConfigError("config field 'data.workers' asks for grain worker processes, which read absl "
                                  "flags that this program has not parsed; call absl.flags.FLAGS(sys.argv) first "
                                  "(train.py does) or set data.workers=0.")
            dataset = grain.MapDataset.range(self.step, 1 << 62).map(self.local).to_iter_dataset()
            self._it = iter(dataset.mp_prefetch(grain.MultiprocessingOptions(num_workers=self.workers)))
        else:
            self._pool = concurrent.futures.ThreadPoolExecutor(1)
            self._queue = [self._pool.submit(self.local, self.step + i) for i in range(self.prefetch)]

    def next_local(self) -> dict[str, np.ndarray]:
        if self.workers:
            local = next(self._it)
        else:
            local = self._queue.pop(0).result()
            self._queue.append(self._pool.submit(self.local, self.step + self.prefetch))
        self.step += 1
        return local

    def __next__(self) -> dict[str, jax.Array]:
        local = self.next_local()
        return {k: jax.make_array_from_process_local_data(self.sharding, v, self.shape) for k, v in local.items()}

    def __iter__(self):
        return self

    def get_state(self) -> dict[str, int]:
        """A few numbers that resume the iterator exactly: the next step."""
        return {"step": self.step}

    def close(self) -> None:
        if self.workers:
            self._it.close()  # stops grain's worker processes now, not whenever the iterator is collected
        else:
            self._pool.shutdown(wait=False, cancel_futures=True)


def global_batch(source: Source, step: int, mesh: Mesh, batch_size: int,
                 limits: BatchLimits = BatchLimits()) -> dict[str, jax.Array]:
    """Batch ``step`` alone (for evaluation and tests), assembled from this process's part."""
    sharding = batch_sharding(mesh)
    shape = (batch_size, source.seq_len)
    local = LocalBatch(source, _local_indices(sharding, shape, 0), _local_columns(sharding, shape), batch_size,
                       limits)
    return {k: jax.make_array_from_process_local_data(sharding, v, shape) for k, v in local(step).items()}


def _record_split(cfg: Config, stores: list, split: str, seed: int) -> Any:
    """A post-training objective's source: one pair store's rows, two a pair (DPO, ``jaxtron.data.pairs``), or
    one prompt store's prompts with their records (GRPO, ``jaxtron.data.prompts``)."""
    from jaxtron.data.pairs import PairSplit
    from jaxtron.data.prompts import PromptSplit
    kind = "pair" if cfg.train.objective == "dpo" else "prompt"
    if len(stores) != 1:
        raise DataError(f"data.path names {len(stores)} stores but train.objective={cfg.train.objective!r} reads one "
                        f"{kind} store; name one.")
    split_class = PairSplit if kind == "pair" else PromptSplit
    return split_class(stores[0], cfg.data.seq_len, split, cfg.data.validation_fraction, seed)


def place_rows(rows: dict[str, np.ndarray], mesh: Mesh) -> dict[str, jax.Array]:
    """Global arrays from whole [batch, seq_len] rows that every process holds (RL's rollouts): each process
    places its devices' rows and tokens, the columns in the rules table's order, as ``global_batch`` does."""
    sharding = batch_sharding(mesh)
    shape = next(iter(rows.values())).shape
    local_rows, columns = _local_indices(sharding, shape, 0), _local_columns(sharding, shape)
    return {k: jax.make_array_from_process_local_data(sharding, np.ascontiguousarray(v[local_rows][:, columns]),
                                                      shape) for k, v in rows.items()}


def _open_split(cfg: Config, split: str) -> tuple[Source, list]:
    from jaxtron.data.packing import Mixture, PackedSplit
    from jaxtron.data.store import TokenStore
    d = cfg.data
    paths = [os.path.expanduser(p.strip()) for p in d.path.split(",") if p.strip()]
    stores = [TokenStore(p) for p in paths]  # checks the manifests and every file's size
    if d.verify and split == "train":
        # each process hashes its share of all the shards: the run reads the corpus once, not once per process
        shards = [(store, i) for store in stores for i in range(len(store.shards))]
        for store, i in shards[jax.process_index()::jax.process_count()]:
            store.verify([i])
    for store in stores:
        if store.vocab_size > cfg.model.vocab_size:
            raise DataError(f"store '{store.path}' has a vocabulary of {store.vocab_size} tokens but "
                            f"model.vocab_size is {cfg.model.vocab_size}; use a model vocabulary of at least "
                            f"{store.vocab_size} or a store made with the model's tokenizer.")
    seed = cfg.train.seed if split == "train" else cfg.train.seed + 1
    if cfg.train.objective != "language_model":
        return _record_split(cfg, stores, split, seed), stores
    for store in stores:
        for kind, what, objective in (("pairs", "chosen/rejected pairs", "dpo"), ("prompts", "RL prompts", "grpo")):
            if store.manifest.get(kind):
                raise DataError(f"store '{store.path}' holds {what}, which train.objective={cfg.train.objective!r} "
                                f"does not read; set train.objective='{objective}'.")
    if not d.packing:  # one document a row: whole conversations, however short
        from jaxtron.data.pairs import DocumentRows
        if len(stores) != 1:
            raise DataError(f"data.packing=False reads one store, but data.path names {len(stores)}; name one.")
        return DocumentRows(stores[0], d.seq_len, split, d.validation_fraction, seed), stores
    parts = [PackedSplit(s, d.seq_len, split, d.validation_fraction, seed + i) for i, s in enumerate(stores)]
    if len(parts) == 1:
        return parts[0], stores
    weights = [float(w) for w in d.weights.split(",")] if d.weights.strip() else [1.0] * len(parts)
    mixture = Mixture(parts, weights)
    mixture.seq_len = d.seq_len
    return mixture, stores


def make_sources(cfg: Config) -> tuple[Source, Source | None, dict[str, float]]:
    """Train source, validation source (or None) and facts about the data to log."""
    d, t = cfg.data, cfg.train
    if d.source == "synthetic":
        return SyntheticSource(cfg.model.vocab_size, d.seq_len, t.seed), None, {}
    if d.prepare:
        from jaxtron.data.corpus import ensure_builtin
        if jax.process_index() == 0:
            ensure_builtin(d.prepare, os.path.expanduser(d.path))
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils
            multihost_utils.sync_global_devices("token store prepared")
    train, stores = _open_split(cfg, "train")
    # GRPO evaluates no held-out loss: its measure is the reward of what it samples
    evaluated = d.validation_fraction > 0 and t.eval_batches and t.objective != "grpo"
    validation = _open_split(cfg, "validation")[0] if evaluated else None
    facts: dict[str, Any] = {"train_tokens": float(sum(s.num_tokens for s in stores))}
    # the loss a context-free model would reach (pretraining and conversation stores)
    if len(stores) == 1 and stores[0].vocab_size <= 1 << 16 and hasattr(train, "token_parts"):
        from jaxtron.data.corpus import unigram_entropy

        # 16M tokens from across the store: the estimate's bias, (vocab - 1) / (2 * tokens), stays below 0.002
        facts["unigram_entropy"] = unigram_entropy(train.token_parts(1 << 24), stores[0].vocab_size)
    return train, validation, facts
