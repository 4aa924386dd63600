"""The attention operands' logical layout, and the ``shard_map`` that runs a kernel on each device's part of a
sequence split over the mesh (context parallelism).

Which mesh axes split the sequence is the rules table's answer for ``activation_length``; nothing here names a
mesh axis. The kernels that run inside (``ops/blockwise.py``, ``ops/chunked.py``) see one device's queries and
gather the keys and values they need through the ``gathered`` function they are given.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax

from jaxtron.parallel.sharding import logical_to_spec, spec_axes

Q_AXES = ("activation_batch", "activation_length", "activation_heads", "activation_head_dim")
KV_AXES = ("activation_batch", "activation_kv_length", "activation_kv_heads", "activation_head_dim")
# keys and values split along the sequence like the queries: how they enter a kernel that gathers them itself
KV_SHARDED_AXES = ("activation_batch", "activation_length", "activation_kv_heads", "activation_head_dim")
ROW_AXES = Q_AXES[:2]  # [batch, length] arrays of a row: positions, document ids

# local(q, k, v, rows, segment_ids, gathered, shard, shards) -> this device's attention output
Local = Callable[..., jax.Array]


def sequence_axes() -> tuple[str, ...]:
    """The mesh axes of more than one device that split the queries' sequence (none outside a mesh)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return ()
    return tuple(a for a in spec_axes(logical_to_spec(Q_AXES), 1) if mesh.shape[a] > 1)


def over_sequence(local: Local, q: jax.Array, k: jax.Array, v: jax.Array, rows: jax.Array,
                  segment_ids: jax.Array | None, with_stats: bool = False):
    """Runs ``local(q, k, v, rows, segment_ids, gathered, shard, shards)`` on each device's part of a sharded
    sequence, as the rules table splits queries, keys, values and [b, L] row arrays (a ``shard_map``):
    ``gathered(x)`` all-gathers a local array's columns over the sequence axes (in shard order), ``shard`` is this
    device's index among the ``shards`` along them. Returns the queries' shape, sharded like them (with
    ``with_stats``: ``local`` also returns each query's log-sum-exp [b, t, heads], and so does this)."""
    q_spec, kv_spec = logical_to_spec(Q_AXES), logical_to_spec(KV_SHARDED_AXES)
    row_spec = logical_to_spec(ROW_AXES)
    sequence = spec_axes(q_spec, 1)
    shards = math.prod(jax.sharding.get_abstract_mesh().shape[a] for a in sequence)

    def gathered(x):
        return jax.lax.all_gather(x, sequence, axis=1, tiled=True) if sequence else x

    def body(q, k, v, rows, segments):
        shard = jax.lax.axis_index(sequence) if sequence else 0
        return local(q, k, v, rows, segments, gathered, shard, shards)

    out_specs = (q_spec, logical_to_spec(Q_AXES[:3])) if with_stats else q_spec
    return jax.shard_map(body, in_specs=(q_spec, kv_spec, kv_spec, row_spec, row_spec), out_specs=out_specs,
                         check_vma=False)(q, k, v, rows, segment_ids)
