"""The ragged exchange of dropless experts: each device sends each peer only the rows routed to that peer.

``ragged_all_to_all`` has ``jax.lax.ragged_all_to_all``'s signature and meaning. On a GPU (and when compiling for
one, ``grouped.on_target``) it is that collective, which moves the routed rows alone. XLA:CPU does not implement it
(UNIMPLEMENTED, jax 0.10.2), so on a CPU it is emulated with the fixed-size ``all_to_all`` (every chunk padded to
the operand's length, the receiver's offsets exchanged beside it): the same result, so the index arithmetic
around it is tested on CPU meshes; on a GPU the real collective is checked against it.

``layout`` computes every offset and size both exchanges of an MoE block need from the per-peer row counts, and
``fit`` which rows fit receive buffers smaller than the worst case.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from jaxtron.ops import grouped


def native() -> bool:
    """Whether the program is for a GPU, where XLA implements ragged_all_to_all."""
    return grouped.target_gpu() is not None


def resolve(choice: str, receive_factor: float = 0.0, node_shards: int = 0) -> str:
    """``execution.moe_exchange``: 'auto' -> 'ragged' on a GPU, wherever ``receive_factor`` bounds the receive
    buffers (only the ragged exchange has them) and wherever rows go once per node (``node_shards``: only the
    ragged exchange sends some peers nothing); 'padded' elsewhere. 'ragged' off a GPU runs the emulation (what
    tests compare with 'padded')."""
    if choice == "auto":
        return "ragged" if native() or receive_factor or node_shards else "padded"
    return choice


@dataclasses.dataclass(frozen=True)
class Layout:
    """One device's view of a ragged exchange over ``ep`` peers, from the matrix ``counts[s, j]`` of rows peer s
    sends peer j: where its outgoing chunks start and land, and where incoming chunks sit in its receive buffer
    (peer by peer, without gaps)."""
    send_offsets: jax.Array  # [ep] start of the chunk for peer j in this device's sorted rows
    send_sizes: jax.Array  # [ep] rows for peer j
    remote_offsets: jax.Array  # [ep] where that chunk lands in peer j's receive buffer
    recv_offsets: jax.Array  # [ep] where peer s's chunk sits in this device's receive buffer
    recv_sizes: jax.Array  # [ep] rows from peer s
    home_offsets: jax.Array  # [ep] where peer s's chunk started in peer s's sorted rows (the way back)


def layout(counts: jax.Array, me: jax.Array, sent: jax.Array | None = None) -> Layout:
    """``counts`` [ep, ep] (every device's rows for every peer, gathered), ``me`` this device's index along the
    exchange axes. ``sent`` [ep, ep] (default ``counts``): the rows that actually go, the first ``sent[s, j]`` of
    each chunk (``fit``); the rest of a chunk stays home and gets no output."""
    sent = counts if sent is None else sent
    chunk_starts = jnp.cumsum(counts, axis=1) - counts  # [s, j]: where s's chunk for j starts among s's rows
    landing = jnp.cumsum(sent, axis=0) - sent  # [s, j]: where s's chunk lands among j's received rows
    return Layout(send_offsets=chunk_starts[me], send_sizes=sent[me], remote_offsets=landing[me],
                  recv_offsets=landing[:, me], recv_sizes=sent[:, me], home_offsets=chunk_starts[:, me])


def fit(counts: jax.Array, capacity: int) -> jax.Array:
    """The rows of ``counts`` [ep, ep] that fit receive buffers of ``capacity`` rows: each receiver takes its
    peers' chunks in peer order until its buffer is full (the first rows of a chunk before its last)."""
    before = jnp.cumsum(counts, axis=0) - counts
    return jnp.clip(capacity - before, 0, counts)


def dispatch(rows: jax.Array, out_rows: int, plan: Layout, axes: tuple[str, ...], groups=None) -> jax.Array:
    """Sorted rows [m, d] -> the rows routed to this device [out_rows, d], peer by peer (zeros past them). ``groups``:
    the exchange runs within these groups of the axes' indices (``jax.lax.ragged_all_to_all``'s
    ``axis_index_groups``); ``plan``'s peers are then the group's."""
    return _exchanged(rows, _fields(plan), out_rows, axes, groups, True)


def combine(computed: jax.Array, out_rows: int, plan: Layout, axes: tuple[str, ...], groups=None) -> jax.Array:
    """``dispatch`` backwards: the computed rows [n, d] go home -> [out_rows, d] in the sorted order sent."""
    return _exchanged(computed, _fields(plan), out_rows, axes, groups, False)


def _fields(plan: Layout) -> tuple[jax.Array, ...]:
    return tuple(getattr(plan, f.name) for f in dataclasses.fields(plan))


def _moved(x, fields, out_rows: int, axes, groups, outward: bool) -> jax.Array:
    """One way of a ragged exchange: rows out (``outward``) or home, into a buffer of ``out_rows``."""
    plan = Layout(*fields)
    buffer = jnp.zeros((out_rows, *x.shape[1:]), x.dtype)
    if outward:
        return ragged_all_to_all(x, buffer, plan.send_offsets, plan.send_sizes, plan.remote_offsets,
                                 plan.recv_sizes, axes, groups)
    return ragged_all_to_all(x, buffer, plan.recv_offsets, plan.recv_sizes, plan.home_offsets, plan.send_sizes,
                             axes, groups)


def _exchanged(x, fields, out_rows: int, axes, groups, outward: bool) -> jax.Array:
    """``_moved``; within groups, differentiated as the other way on the same plan (each way moves rows to places
    and leaves the rest zero, so its transpose is the other way), which jax's own transpose of the grouped
    collective does not handle (jax 0.10.2). Ungrouped exchanges keep jax's transpose: the same rule on them
    changed the H100 schedule (Mixtral 8x7B at one chunk put a GEMM beside 1 of its 11 exchanges, not 3)."""
    if groups is None:
        return _moved(x, fields, out_rows, axes, groups, outward)
    return _within_groups(x, fields, out_rows, axes, groups, outward)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4, 5))
def _within_groups(x, fields, out_rows, axes, groups, outward):
    return _moved(x, fields, out_rows, axes, groups, outward)


def _within_groups_fwd(x, fields, out_rows, axes, groups, outward):
    return _moved(x, fields, out_rows, axes, groups, outward), (fields, x.shape[0])


def _within_groups_bwd(out_rows, axes, groups, outward, saved, cotangent):
    fields, rows = saved
    return _moved(cotangent, fields, rows, axes, groups, not outward), None


_within_groups.defvjp(_within_groups_fwd, _within_groups_bwd)


def ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes,
                      axes: tuple[str, ...], groups=None) -> jax.Array:
    """``jax.lax.ragged_all_to_all`` over ``axes`` (within ``groups`` of their indices, if given) on a GPU, its
    fixed-size emulation elsewhere."""
    if native():
        return jax.lax.ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes,
                                         axis_name=axes, axis_index_groups=groups)
    return _emulated(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, axes, groups)


def _emulated(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, axes, groups=None):
    """Each chunk padded to the operand's length and sent by ``all_to_all``, with the offset it must land at;
    the receiver writes the first ``recv_sizes[s]`` rows of peer s's chunk there."""
    m = operand.shape[0]
    ep = input_offsets.shape[0]
    slot = jnp.arange(m)
    take = jnp.clip(input_offsets[:, None] + slot[None, :], 0, m - 1)  # [ep, m]
    chunks = jnp.where((slot[None, :] < send_sizes[:, None])[..., None], operand[take], 0)
    chunks = jax.lax.all_to_all(chunks, axes, 0, 0, tiled=True, axis_index_groups=groups)  # [s]: peer s's, here
    lands = jax.lax.all_to_all(output_offsets.reshape(ep, 1), axes, 0, 0, tiled=True,
                               axis_index_groups=groups)[:, 0]  # [ep]
    place = jnp.where(slot[None, :] < recv_sizes[:, None], lands[:, None] + slot[None, :], output.shape[0])
    return output.at[place.reshape(-1)].set(chunks.reshape(ep * m, *operand.shape[1:]), mode="drop")
