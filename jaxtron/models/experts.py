"""The experts of an MoE block on one device: how its routed rows reach the devices that hold their experts, run through
them and come back (``models/moe.py`` routes them).

The experts run inside ``shard_map`` over every mesh axis. Each device holds the tokens of its batch and sequence
shard and its shard of the experts. Which mesh axes those are comes from the rules table (``ExpertAxes``), never from
names written here; with the default table the experts are split over ``expert``, their hidden width over ``fsdp``
(gathered before use) and their intermediate width over ``tensor`` like a dense MLP. Where the experts are split,
rows travel to the shard that owns their expert and back by all-to-all, with their router weights, which scale the
hidden values there. At the end each token's k outputs are summed, and so are the partial products of the split
intermediate width.

- dropless: a device sorts its assignments by expert and runs one grouped GEMM per matrix over its experts' rows. The
  padded exchange gives each destination a buffer of all of the device's assignments (the worst case, because nothing
  may be dropped); the ragged one (``ops/exchange.py``) moves the routed rows alone.
- capacity: every expert has ``capacity`` fixed slots per batch row; kept assignments are scattered into them, and
  each expert runs one dense batched GEMM over its slots. Buffers and FLOPs are ``capacity_factor`` times the routed
  work, on any backend.

Each device's tokens may run in chunks (``execution.moe_chunks``), each chunk's way split into stages
(``models/expert_chunks.py``) so that one chunk's exchanges are independent of another's GEMMs.

The grouped GEMM is ``ops/grouped.py``'s (``execution.expert_gemm``): ``jax.lax.ragged_dot``, which XLA (CPU and GPU
alike) expands to a dense GEMM of every row with every local expert (E_local times the routed FLOPs), or tokamax's
grouped kernel, which 'auto' takes on Hopper GPUs.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxtron.models.expert_chunks import Stages, chunk_rows, overlapped, summed
from jaxtron.models.layers import GatedActivation
from jaxtron.ops import exchange, grouped, grouped_blockwise, grouped_fp8
from jaxtron.ops import fp8 as fp8_ops
from jaxtron.ops.expert_recipes import expert_einsum
from jaxtron.parallel.sharding import logical_to_spec, spec_axes

TOKEN_AXES = ("activation_batch", "activation_length", "activation_embed")
GATE_UP_AXES = ("experts", "embed", "mlp")
DOWN_AXES = ("experts", "mlp", "embed")


@dataclasses.dataclass(frozen=True)
class ExpertAxes:
    """The mesh axes the expert computation communicates over, as the rules table maps the weights' names."""
    experts: tuple[str, ...]  # split the experts: rows travel to their expert's shard and back (all_to_all)
    embed: tuple[str, ...]  # split the experts' hidden width: weights are gathered over them before use
    mlp: tuple[str, ...]  # split the intermediate width: the partial outputs are summed over them

    @classmethod
    def from_rules(cls) -> ExpertAxes:
        gate, down = logical_to_spec(GATE_UP_AXES), logical_to_spec(DOWN_AXES)
        axes = cls(spec_axes(gate, 0), spec_axes(gate, 1), spec_axes(gate, 2))
        if (spec_axes(down, 0), spec_axes(down, 2), spec_axes(down, 1)) != (axes.experts, axes.embed, axes.mlp):
            raise ValueError(f"the rules table splits the experts' gate/up weights ({gate}) and down weights "
                             f"({down}) over different mesh axes; the expert computation needs the same split")
        tokens = logical_to_spec(TOKEN_AXES)
        shared = set(axes.mlp) & set(spec_axes(tokens, 0) + spec_axes(tokens, 1))
        if shared:
            raise ValueError(f"the rules table splits both the tokens and the experts' intermediate width over "
                             f"{sorted(shared)}; the partial outputs summed over those axes would mix tokens")
        return axes


def rank_in_row(chosen: jax.Array) -> jax.Array:
    """Index of each assignment [b, t, k] among the assignments of the same expert in its row (``chosen``:
    one-hot [b, t, k, E], zero rows for dropped ones). Order: the first choices of the whole row, then the
    second choices, each in token order."""
    b, t, k, e = chosen.shape
    ordered = jnp.swapaxes(chosen, 1, 2).reshape(b, k * t, e)  # [b, (choice, token), E]
    rank = jnp.sum((jnp.cumsum(ordered, axis=1) - 1) * ordered, axis=-1)
    return jnp.swapaxes(rank.reshape(b, k, t), 1, 2)


@dataclasses.dataclass(frozen=True)
class ExpertRun:
    """How the experts run, the execution config's choices resolved (``ops/grouped.py``, ``ops/exchange.py``)."""
    gemm: str = "xla"  # dropless mode's grouped GEMM
    exchange: str = "padded"  # dropless mode's all-to-all
    receive_factor: float = 0.0  # dropless receive buffers: 0 the worst case, else this many times the routed rows
    fp8: bool = False  # the expert GEMMs in FP8, each expert's weights with their own scale: capacity mode's batched
    # ones (ops/fp8.py), dropless mode's grouped ones (ops/grouped_fp8.py)
    chunks: int = 1  # each device's tokens run through the experts in this many chunks (``chunk_rows``)
    node_shards: int = 0  # dropless: expert shards a node, rows sent once per node (``_exchange_nodes``); 0: one hop
    activation: GatedActivation = dataclasses.field(default_factory=GatedActivation)  # ``model.activation``
    scale_input: bool = False  # the router weights scale the rows going in, not the hidden values (Llama 4)
    recipe: str = "tensorwise"  # with fp8, execution.fp8_recipe (ops/expert_recipes.py, ops/grouped_blockwise.py)


def _packed(rows: jax.Array, weights: jax.Array) -> jax.Array:
    """Rows [..., d] with their router weights [...] in a column after them, in the rows' dtype (the precision the
    weights multiply in), padded to a multiple of 8 columns: the weights travel in the rows' exchanges."""
    pad = 8 - rows.shape[-1] % 8
    extra = jnp.zeros((*rows.shape[:-1], pad - 1), rows.dtype)
    return jnp.concatenate([rows, weights[..., None].astype(rows.dtype), extra], axis=-1)


class ExpertWeights(NamedTuple):
    """One device's experts: gate and up [E_local, d, f], down [E_local, f, d], and with ``model.moe.expert_bias``
    the gate's and up's biases [E_local, f] (the down projection's is added outside, ``models/moe.py``)."""
    gate: jax.Array
    up: jax.Array
    down: jax.Array
    gate_bias: jax.Array | None = None
    up_bias: jax.Array | None = None


def _weighted_swiglu(packed: jax.Array, d: int, project: Callable[[jax.Array, str], jax.Array],
                     activation: GatedActivation, biases: tuple[jax.Array, jax.Array] | None,
                     scale_input: bool = False) -> jax.Array:
    """``_packed`` rows [..., d + pad] -> gated outputs [..., d] weighted by their router weights: ``project(x,
    matrix)`` with 'gate', 'up', 'down', the gate's and up's ``biases`` (None, or broadcast to their outputs) added,
    then ``activation``. The weights scale the hidden values ahead of the (linear) down projection, which gives the
    same product: the router's gradient is then each row's hidden values against their gradient, so the backward
    pass needs no expert output and remat runs neither the down projection nor the way home again. With
    ``scale_input`` the weights scale the rows before the gate and up projections instead (Llama 4)."""
    rows, weights = packed[..., :d], packed[..., d:d + 1]
    if scale_input:
        rows = rows * weights
    add = (lambda y, i: y + biases[i].astype(y.dtype)) if biases is not None else (lambda y, i: y)
    gated = activation.gated(add(project(rows, "gate"), 0))
    hidden = activation.combine(gated, add(project(rows, "up"), 1))
    return project(hidden if scale_input else hidden * weights, "down")


def _swiglu_grouped(packed: jax.Array, w: ExpertWeights, group_sizes: jax.Array, run: ExpertRun) -> jax.Array:
    """``_packed`` rows sorted by expert [m, d + pad] -> weighted expert outputs [m, d]; rows past sum(group_sizes)
    give zeros (zero router weight). ``run``: the grouped GEMM (``ops/grouped.py``), its precision, the activation."""
    matrices = {"gate": w.gate, "up": w.up, "down": w.down}
    biases = None
    if w.gate_bias is not None:  # each row's expert, from the groups' sizes
        expert = jnp.minimum(jnp.searchsorted(jnp.cumsum(group_sizes), jnp.arange(packed.shape[0]), side="right"),
                             w.gate.shape[0] - 1)
        biases = (w.gate_bias[expert], w.up_bias[expert])
    gemm = grouped_blockwise.matmul if run.fp8 and run.recipe == "blockwise" else \
        grouped_fp8.matmul if run.fp8 else grouped.matmul
    return _weighted_swiglu(packed, w.gate.shape[1], lambda x, name: gemm(x, matrices[name], group_sizes, run.gemm),
                            run.activation, biases, run.scale_input)


def _swiglu_batched(slots: jax.Array, w: ExpertWeights, run: ExpertRun) -> jax.Array:
    """Fixed slots of each expert, ``_packed`` [E, m, d + pad] -> weighted outputs [E, m, d]: one batched GEMM per
    matrix. With ``run.fp8`` each is a batched FP8 GEMM with current scaling, one scale for all slots and one per
    expert for the weights (``ops/fp8.py``, ``batched_einsum``), or each expert's GEMMs by a block-scaled
    ``run.recipe`` (``expert_einsum``)."""
    einsum = jnp.einsum if not run.fp8 else fp8_ops.batched_einsum if run.recipe == "tensorwise" else \
        functools.partial(expert_einsum, run.recipe)
    matrices = {"gate": (w.gate, "emd,edf->emf"), "up": (w.up, "emd,edf->emf"), "down": (w.down, "emf,efd->emd")}
    biases = None if w.gate_bias is None else (w.gate_bias[:, None, :], w.up_bias[:, None, :])
    return _weighted_swiglu(slots, w.gate.shape[1], lambda x, name: einsum(matrices[name][1], x, matrices[name][0]),
                            run.activation, biases, run.scale_input)


def experts_local(x: jax.Array, ids: jax.Array, weights: jax.Array, w: ExpertWeights, num_experts: int,
                  row_capacity: int | None, axes: ExpertAxes | None,
                  run: ExpertRun = ExpertRun()) -> tuple[jax.Array, jax.Array]:
    """One device's part of the expert computation (called inside shard_map with the mesh axes to talk over,
    or alone without a mesh: ``axes`` None).

    x [b, t, d], ids/weights [b, t, k] (id ``num_experts`` = dropped); ``w``: gate/up [E_local, d_shard, f_shard],
    down [E_local, f_shard, d_shard], biases [E_local, f_shard]. ``row_capacity``: slots per expert and row
    (capacity mode) or None (dropless). ``run``: the kernels, exchange, precision, chunks and activation. ->
    (outputs [b, t, d], how many of this device's assignments a full receive buffer dropped).
    """
    axes = axes or ExpertAxes((), (), ())
    b, t, d = x.shape
    k = ids.shape[-1]
    if axes.embed:  # weights gathered to their whole hidden width (their gradients are reduce-scattered back)
        gate, up = (jax.lax.all_gather(m, axes.embed, axis=1, tiled=True) for m in (w.gate, w.up))
        w = w._replace(gate=gate, up=up, down=jax.lax.all_gather(w.down, axes.embed, axis=2, tiled=True))
    ep = jax.lax.axis_size(axes.experts) if axes.experts else 1  # expert shards
    n = b * t
    stages = []
    # chunks only where rows travel: their point is exchanges beside GEMMs (on one device they only add bookkeeping)
    for rows in chunk_rows(b, t, run.chunks if ep > 1 else 1, row_capacity):
        if row_capacity is None and ep > 1 and 0 < run.node_shards < ep:  # the chunk's tokens, once per node
            stages.append(_exchange_nodes(x.reshape(n, d)[rows], ids.reshape(n, k)[rows],
                                          weights.reshape(n, k)[rows], w, num_experts, axes.experts, ep,
                                          run))
        elif row_capacity is None:  # the chunk's tokens, flattened, each assignment straight to its expert
            part = x.reshape(n, d)[rows]
            stages.append(summed(_dropless(part, ids.reshape(n, k)[rows].reshape(-1),
                                            weights.reshape(n, k)[rows].reshape(-1), w, num_experts,
                                            axes.experts, ep, run, _receive_rows(run, ep, part.shape[0] * k)), k))
        else:  # capacity mode's slots are per batch row: the chunk's rows, whole
            stages.append(summed(_with_capacity(x[rows], ids[rows], weights[rows], w, num_experts,
                                                 min(row_capacity, t), axes.experts, ep, run), k))
    ys, dropped = [], jnp.zeros((), jnp.float32)
    for y, lost in overlapped(stages):
        ys.append(jax.lax.psum(y, axes.mlp) if axes.mlp else y)  # each shard computed its slice of the width
        dropped = dropped + lost
    return jnp.concatenate(ys).reshape(b, t, d), dropped


def _receive_rows(run: ExpertRun, senders: int, own_rows: int, sent_rows: int | None = None) -> int:
    """A dropless receive buffer: every row that ``senders`` peers may send (``sent_rows`` each, default
    ``own_rows``: what this device routes), or ``run.receive_factor`` times ``own_rows``."""
    worst = senders * (own_rows if sent_rows is None else sent_rows)
    return min(worst, math.ceil(run.receive_factor * own_rows)) if run.receive_factor else worst


def _dropless(tokens, ids, weights, w, num_experts: int, expert_axes: tuple[str, ...], ep: int,
              run: ExpertRun, receive_rows: int, node: int = 0) -> Stages:
    """Assignments sorted by expert, one grouped GEMM (ragged_dot) per matrix; the stages' outputs [n * k, d] in
    assignment order, each weighted by its router weight (``weights`` [n * k]; ids ``num_experts`` and up get
    zeros); the weights travel with the rows. With the experts split over ``expert_axes`` (``ep``
    shards) the padded exchange gives each destination shard a buffer of all n * k rows (the worst case); the
    ragged one receives into ``receive_rows`` (``_receive_rows``), and if that is less than the worst case
    ``finish`` also says how many rows did not fit. ``node``: where every row's expert lies in this device's node
    of that many shards, the ragged exchange runs among the node's devices alone."""
    k = ids.shape[0] // tokens.shape[0]
    order = jnp.argsort(ids, stable=True)  # dropped ids (none in dropless mode) would sort last
    sorted_ids = ids[order]
    rows = _packed(tokens[order // k], weights[order])
    counts = jnp.sum(jax.nn.one_hot(ids, num_experts, dtype=jnp.int32), axis=0)
    none = jnp.zeros((), jnp.float32)
    if ep == 1:
        stages = Stages(lambda: rows, lambda r: _swiglu_grouped(r, w, counts, run), lambda c: (c, none))
    elif run.exchange == "ragged":
        stages = _exchange_ragged(rows, counts, w, expert_axes, ep, num_experts // ep, run,
                                  receive_rows, node)
    else:
        stages = _exchange_sorted(rows, sorted_ids, counts, w, expert_axes, ep, num_experts // ep,
                                  run)

    def finish(computed):
        out_sorted, dropped = stages.finish(computed)
        return out_sorted[jnp.argsort(order)], dropped
    return Stages(stages.send, stages.compute, finish)


class NodeRows(NamedTuple):
    """The rows a device sends between nodes: one for each token and node that holds one of its experts."""
    token: jax.Array  # [nodes * n] each row's token, the rows node by node, those no node needs last
    node: jax.Array  # [nodes * n] the node each row goes to
    counts: jax.Array  # [nodes] the rows for each node
    carries: jax.Array  # [nodes * n, k] which of its token's assignments a row carries: those of its node


def node_rows(ids: jax.Array, num_experts: int, nodes: int) -> NodeRows:
    """``ids`` [n, k] (``num_experts``: none) of experts laid ``num_experts // nodes`` a node, in order."""
    n = ids.shape[0]
    node = jnp.where(ids < num_experts, ids // (num_experts // nodes), nodes)  # [n, k]
    needed = jnp.any(node[:, None, :] == jnp.arange(nodes)[None, :, None], axis=-1)  # [n, nodes]
    order = jnp.argsort(jnp.where(needed.T, jnp.arange(nodes)[:, None], nodes).reshape(-1), stable=True)
    token, to = order % n, order // n
    return NodeRows(token, to, jnp.sum(needed, axis=0), node[token] == to[:, None])


def _exchange_nodes(tokens, ids, weights, w, num_experts: int, expert_axes: tuple[str, ...], ep: int,
                    run: ExpertRun) -> Stages:
    """Dropless rows sent once per node, ``run.node_shards`` expert shards a node (consecutive along the expert axes,
    as ``parallel/mesh.py`` lays nodes out). Each token [n, d] goes to the device at this device's place in every
    node that holds one of its experts (ids, weights [n, k]), with the ids and weights of that node's experts; there
    ``_dropless``'s exchange hands it on to those experts (its peers then that node's devices alone), and each
    row's weighted sum of their outputs comes back as one row. The stages' outputs [n, d]: each token's weighted
    sum. Rows between nodes: one per token and node it needs, not one per assignment."""
    n, k = ids.shape
    per_node = run.node_shards
    nodes = ep // per_node
    me = jax.lax.axis_index(expert_axes)
    by_node = node_rows(ids, num_experts, nodes)
    peers = jnp.arange(ep)
    # to its place in each node
    counts = jnp.where(peers % per_node == me % per_node, by_node.counts[peers // per_node], 0)
    plan = exchange.layout(jax.lax.all_gather(counts, expert_axes), me)
    token = by_node.token
    # a row's ids and weights travel beside it in one float32 array (ids below 2**24 are exact)
    carried = (tokens[token], jnp.concatenate([jnp.where(by_node.carries, ids[token], num_experts).astype(jnp.float32),
                                               jnp.where(by_node.carries, weights[token], 0)], axis=1))
    m = nodes * n  # the most rows a device receives: one per token from the device at its place in each node

    def send():
        rows, got = (exchange.dispatch(c, m, plan, expert_axes) for c in carried)
        got_ids, got_weights = got[:, :k].astype(jnp.int32), got[:, k:]
        got_ids = jnp.where(jnp.arange(m)[:, None] < jnp.sum(plan.recv_sizes), got_ids, num_experts)  # past: none
        inner = summed(_dropless(rows, got_ids.reshape(-1), got_weights.reshape(-1), w, num_experts,
                                 expert_axes, ep, run, _receive_rows(run, per_node, n * k, m * k), per_node), k)
        return inner, inner.send()

    def compute(sent):
        inner, received = sent
        return inner, inner.compute(received)

    def finish(computed):
        inner, out = computed
        summed, lost = inner.finish(out)  # [m, d]: each received row's weighted sum over its node's experts
        back = exchange.combine(summed, m, plan, expert_axes)  # [m, d] in the order sent
        return jnp.zeros(tokens.shape, back.dtype).at[token].add(back), lost
    return Stages(send, compute, finish)


def _exchange_sorted(rows, sorted_ids, counts, w, expert_axes: tuple[str, ...], ep: int,
                     local_experts: int, run: ExpertRun) -> Stages:
    """Sends sorted ``_packed`` rows to the expert shards that own their experts (a fixed buffer of all the rows per
    shard), runs the local experts on what arrives, and returns each row's weighted output in the sorted order."""
    m, d = rows.shape[0], w.gate.shape[1]
    per_shard = counts.reshape(ep, local_experts)
    sent = jnp.sum(per_shard, axis=1)  # rows for each destination shard
    starts = jnp.cumsum(sent) - sent
    slot = jnp.arange(m)
    valid = slot[None, :] < sent[:, None]  # [ep, m]
    send = jnp.where(valid[..., None], rows[jnp.where(valid, starts[:, None] + slot[None, :], 0)], 0)
    recv_counts = jax.lax.all_to_all(per_shard, expert_axes, 0, 0, tiled=True)  # [ep sources, local experts]
    # each source's rows arrive sorted by expert; sort all of them by local expert for the grouped GEMM
    bounds = jnp.cumsum(recv_counts, axis=1)  # [ep, local_experts]
    local_id = jax.vmap(lambda bound: jnp.searchsorted(bound, slot, side="right"))(bounds)  # [ep, m]
    by_local_expert = jnp.argsort(local_id.reshape(ep * m), stable=True)  # unused slots (id local_experts) last

    def compute(recv):  # recv[j]: rows from shard j
        ordered = recv.reshape(ep * m, -1)[by_local_expert]
        computed = _swiglu_grouped(ordered, w, jnp.sum(recv_counts, 0), run)
        return computed[jnp.argsort(by_local_expert)].reshape(ep, m, d)

    def finish(back):
        back = jax.lax.all_to_all(back, expert_axes, 0, 0, tiled=True)  # back[j, s]: output of send[j, s]
        shard = jnp.minimum(sorted_ids // local_experts, ep - 1)
        index = jnp.clip(jnp.arange(m) - starts[shard], 0, m - 1)
        out = jnp.where((sorted_ids < local_experts * ep)[:, None], back[shard, index], 0)
        return out, jnp.zeros((), jnp.float32)
    return Stages(lambda: jax.lax.all_to_all(send, expert_axes, 0, 0, tiled=True), compute, finish)


def _exchange_ragged(rows, counts, w, expert_axes: tuple[str, ...], ep: int, local_experts: int,
                     run: ExpertRun, receive_rows: int, node: int = 0) -> Stages:
    """``_exchange_sorted`` moving only the routed rows (``ops/exchange.py``): each expert shard gets the rows of
    its experts (``_packed`` with their router weights), packed peer by peer into a buffer of ``receive_rows`` (the
    worst case: every row of every peer), runs its local experts on them and sends each output home to its place in
    the sorted order. Rows that do not fit the receiver's buffer stay home with a zero output; ``finish`` counts
    this device's. ``node`` > 0: every row's expert lies in this device's node of ``node`` consecutive shards, and
    the exchange runs among them alone (groups of the expert axes: NVLink, and priced so)."""
    m = rows.shape[0]
    per_shard = counts.reshape(ep, local_experts)  # rows for each (destination shard, its local expert)
    matrix = jax.lax.all_gather(jnp.sum(per_shard, axis=1), expert_axes)  # [source, destination] row counts
    me = jax.lax.axis_index(expert_axes)
    peers, groups = ep, None
    if node:  # the node's block of the counts, and this device's place in it
        first = me // node * node
        peers, groups = node, tuple(tuple(range(j, j + node)) for j in range(0, ep, node))
        per_shard = jax.lax.dynamic_slice_in_dim(per_shard, first, node)
        matrix, me = jax.lax.dynamic_slice(matrix, (first, first), (node, node)), me - first
    sent = exchange.fit(matrix, receive_rows) if receive_rows < peers * m else matrix
    plan = exchange.layout(matrix, me, sent)
    recv_counts = jax.lax.all_to_all(per_shard, expert_axes, 0, 0, tiled=True, axis_index_groups=groups)
    # what arrived of each peer's chunk is its first rows: their counts per local expert
    arrived = jnp.minimum(jnp.cumsum(recv_counts, axis=1), plan.recv_sizes[:, None])
    recv_counts = arrived - jnp.pad(arrived, ((0, 0), (1, 0)))[:, :-1]
    # each peer's rows arrive sorted by expert; sort all of them by local expert for the grouped GEMM
    segment = jnp.searchsorted(jnp.cumsum(recv_counts.reshape(-1)), jnp.arange(receive_rows), side="right")
    local_id = jnp.where(segment < peers * local_experts, segment % local_experts, local_experts)  # unused: last
    by_local_expert = jnp.argsort(local_id, stable=True)

    def compute(received):  # peer by peer, then zeros
        computed = _swiglu_grouped(received[by_local_expert], w, jnp.sum(recv_counts, 0), run)
        return computed[jnp.argsort(by_local_expert)]

    def finish(computed):
        out = exchange.combine(computed, m, plan, expert_axes, groups)
        return out, jnp.sum(matrix[me] - sent[me]).astype(jnp.float32)
    return Stages(lambda: exchange.dispatch(rows, receive_rows, plan, expert_axes, groups), compute, finish)


def _with_capacity(x, ids, weights, w, num_experts: int, slots: int, expert_axes: tuple[str, ...],
                   ep: int, run: ExpertRun) -> Stages:
    """Capacity mode: every expert has ``slots`` fixed places per local row; kept assignments and their router
    weights (``weights`` [b, t, k]) are scattered into them, the slots of each expert shard are exchanged as one
    block, and each expert runs one dense batched GEMM over its slots. The stages' outputs [b * t * k, d] in
    assignment order, weighted (zeros for dropped ones)."""
    b, t, d = x.shape
    k = ids.shape[-1]
    kept = ids < num_experts
    # rank within this device's part of the row: at most min(capacity, t) since the router kept at most
    # capacity per row and a token visits an expert once
    rank = rank_in_row(jax.nn.one_hot(ids, num_experts, dtype=jnp.int32))
    place = ids * (b * slots) + jnp.arange(b)[:, None, None] * slots + rank  # [b, t, k] in [E * b * slots]
    place = jnp.where(kept, place, num_experts * b * slots).reshape(-1)  # dropped: outside the buffer
    rows = _packed(jnp.broadcast_to(x[:, :, None, :], (b, t, k, d)), weights).reshape(b * t * k, -1)
    buffer = jnp.zeros((num_experts * b * slots, rows.shape[-1]), x.dtype).at[place].set(rows, mode="drop")
    local_experts = num_experts // ep
    buffer = buffer.reshape(ep, local_experts, b * slots, -1)

    def exchanged(blocks):  # [shard, local expert, ...] <-> [source shard, local expert, ...]
        return jax.lax.all_to_all(blocks, expert_axes, 0, 0, tiled=True) if ep > 1 else blocks

    def compute(received):
        by_expert = jnp.swapaxes(received, 0, 1).reshape(local_experts, ep * b * slots, -1)
        out = _swiglu_batched(by_expert, w, run).reshape(local_experts, ep, b * slots, d)
        return jnp.swapaxes(out, 0, 1)

    def finish(out):  # back to the shard the rows came from
        out = exchanged(out).reshape(num_experts * b * slots, d)
        return out.at[place].get(mode="fill", fill_value=0), jnp.zeros((), jnp.float32)
    return Stages(lambda: exchanged(buffer), compute, finish)
