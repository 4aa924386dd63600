"""An MoE block's tokens in chunks (``execution.moe_chunks``), each chunk's way through the experts split into
stages (``Stages``: send, compute, finish) and run in the order that lets one chunk's exchanges run beside another's
expert GEMMs (``models/experts.py``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp


def chunk_rows(b: int, t: int, chunks: int, row_capacity: int | None) -> list[slice]:
    """The slices of one device's tokens that run through the experts one after another (``execution.moe_chunks``):
    each chunk's exchanges are independent of the others' expert GEMMs, so they can overlap. Dropless chunks split
    the flattened tokens, capacity chunks the batch rows (their slots are per row); a count that does not divide
    them is lowered to one that does."""
    n = b * t if row_capacity is None else b
    chunks = max(c for c in range(1, min(chunks, n) + 1) if n % c == 0)
    return [slice(i * n // chunks, (i + 1) * n // chunks) for i in range(chunks)]


class Stages(NamedTuple):
    """One chunk's way through the experts, its bookkeeping (sorting, the exchange's layout) already done: ``send``
    the rows to the expert shards, ``compute`` the local experts on what arrived, ``finish``: the outputs home
    -> (outputs, assignments a full receive buffer dropped). The outputs are per assignment [assignments, d] in
    assignment order (``models/experts.py``: ``_dropless``, ``_with_capacity``), or each token's weighted sum
    [tokens, d] (``summed``, ``_exchange_nodes``)."""
    send: Callable[[], Any]
    compute: Callable[[Any], Any]
    finish: Callable[[Any], tuple[jax.Array, jax.Array]]


def summed(stages: Stages, k: int) -> Stages:
    """``stages`` whose outputs are per assignment (already weighted), finished as each token's sum of its k."""
    def finish(computed):
        out, lost = stages.finish(computed)
        return jnp.sum(out.reshape(-1, k, out.shape[-1]), axis=1), lost
    return Stages(stages.send, stages.compute, finish)


def overlapped(stages: list[Stages]) -> list[tuple[jax.Array, jax.Array]]:
    """Runs the chunks' stages in the order that overlaps them: the next chunk's send, this chunk's experts, the
    previous chunk's way home. Nothing ties one chunk's exchanges to another's kernels, so a scheduler may run them
    side by side (XLA's latency-hiding scheduler, ``models/moe.py`` COMPILER_OPTIONS); which ones it does is in
    ``benchmarks/moe_overlap.md``, measured on programs traced in this order."""
    count = len(stages)
    received, computed, finished = [None] * count, [None] * count, [None] * count
    received[0] = stages[0].send()
    for i in range(count):
        if i + 1 < count:
            received[i + 1] = stages[i + 1].send()
        computed[i] = stages[i].compute(received[i])
        if i:
            finished[i - 1] = stages[i - 1].finish(computed[i - 1])
    finished[-1] = stages[-1].finish(computed[-1])
    return finished
