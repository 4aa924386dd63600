"""Token-wise work over a tensor group in chunks of the sequence, so that one chunk's collectives run beside another
chunk's GEMMs.

Under sequence parallelism the residual stream is split along the sequence over the tensor group. A block gathers
its normed input before the projections that split their outputs over the group, and reduce-scatters the
projections that sum over it. Each collective feeds, or is fed by, the GEMM beside it, so XLA can only run it
alone. Split each device's rows into ``chunks`` parts, and chunk j's gather is independent of chunk j-1's GEMMs:
the latency-hiding scheduler runs them side by side (Megatron overlaps the same collectives inside its GEMMs).

A chunk takes rows ``j*r .. (j+1)*r`` of every shard (``r`` = rows a shard / ``chunks``), so each chunk is split
over the group as the residual stream is, and the results go back in order with local copies only. The work is
token-wise, so the chunks compute what the whole would, row for row.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from jaxtron.parallel.sharding import shard_count

# XLA's reduce-scatter combiner merges independent reduce-scatters into one: the chunks' would run as one again, after
# the last chunk's GEMM (Llama-3 70B at tensor=8: 10 reduce-scatters a step with it, 14 without; 2 and 6 of them
# beside GEMMs). Programs that chunk keep them apart.
COMPILER_OPTIONS = {"xla_gpu_reduce_scatter_combine_threshold_bytes": 1}

RESIDUAL_LENGTH = "activation_residual_length"
SPLIT_AXIS = "mlp"  # the logical axis whose devices split a projection's outputs


def compiler_options(chunks: int, tensor: int) -> dict[str, object]:
    """The XLA options of a program with ``chunks`` on a tensor group of ``tensor`` devices."""
    return dict(COMPILER_OPTIONS) if chunks > 1 and tensor > 1 else {}


def tensor_size() -> int:
    """Devices in the tensor group of the mesh being traced (those that split the MLP's width; 1 without a mesh)."""
    mesh = jax.sharding.get_abstract_mesh()
    return 1 if mesh.empty else shard_count(dict(mesh.shape), SPLIT_AXIS)


def shards() -> int:
    """How many parts the residual stream's sequence is split into on the mesh being traced."""
    mesh = jax.sharding.get_abstract_mesh()
    return 1 if mesh.empty else shard_count(dict(mesh.shape), RESIDUAL_LENGTH)


def usable(chunks: int, length: int, whole_rows: bool = False) -> int:
    """The chunks to run for a sequence of ``length``: ``chunks`` where a tensor group exists and every shard's rows
    divide evenly, else 1. ``whole_rows``: the work reads all of the rows at once (FP8's per-tensor scales,
    LoRA's dropout masks), so runs them whole."""
    parts = shards()
    if chunks <= 1 or whole_rows or tensor_size() == 1 or length % (parts * chunks):
        return 1
    return chunks


def _take(x: jax.Array, j: int, chunks: int) -> jax.Array:
    """Chunk ``j`` of ``x`` [b, s, ...]: rows ``j*r .. (j+1)*r`` of every shard of the stream, as [b, parts*r, ...]."""
    parts = shards()
    b, s, *rest = x.shape
    r = s // (parts * chunks)
    return x.reshape(b, parts, chunks, r, *rest)[:, :, j].reshape(b, parts * r, *rest)


def _join(pieces: list[jax.Array], chunks: int) -> jax.Array:
    """The inverse of ``_take`` over all chunks: [b, parts*r, ...] pieces -> [b, s, ...] in sequence order."""
    parts = shards()
    b, rows, *rest = pieces[0].shape
    r = rows // parts
    stacked = jnp.stack([p.reshape(b, parts, r, *rest) for p in pieces], axis=2)
    return stacked.reshape(b, parts * chunks * r, *rest)


def over_chunks(fn: Callable[..., Any], chunks: int, *xs: jax.Array) -> Any:
    """``fn(*xs)`` computed chunk by chunk: every ``x`` [b, s, ...] is cut into the same ``chunks`` (``_take``) and
    ``fn``'s outputs (a pytree of [b, rows, ...]) are put back in order. ``chunks`` 1 calls ``fn`` once."""
    if chunks == 1:
        return fn(*xs)
    outs = [fn(*(_take(x, j, chunks) for x in xs)) for j in range(chunks)]
    return jax.tree.map(lambda *pieces: _join(list(pieces), chunks), *outs)

