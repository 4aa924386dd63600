"""Mixture-of-experts feed-forward block (Mixtral family) with expert parallelism.

Routing runs in plain sharded jit: softmax over the router logits (float32), top-k, optional
renormalisation of the k weights, the load-balancing and z losses, and in capacity mode which assignments
fit. Those are means over the global batch, so they do not depend on the mesh.

The experts run inside ``shard_map`` over every mesh axis. Each device holds the tokens of its batch and
sequence shard and the experts of its ``expert`` shard (gathered over ``fsdp``, split over ``tensor`` like
a dense MLP). It sorts its token-expert assignments by expert. With ``mesh.expert`` > 1 it sends each
expert shard its rows by ``all_to_all`` over the expert axis, in a buffer of fixed size per destination.
It runs the grouped GEMMs of its local experts with ``jax.lax.ragged_dot`` and sends the outputs back the
same way. Then it weights and sums each token's k outputs and sums the ``tensor`` partial products.

Buffer size per destination shard: dropless mode has to allow for every local assignment going to one
shard (tokens * k rows). Capacity mode needs at most rows * capacity * local experts. The grouped GEMM
multiplies only the rows that were routed (rows past the group sizes are skipped), so the padding costs
memory and exchange bandwidth but no FLOPs.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from jaxtron.config import ModelConfig
from jaxtron.models.layers import compute_dtype, param
from jaxtron.sharding import constrain, logical_to_spec

TOKEN_AXES = ("activation_batch", "activation_length", "activation_embed")
ROUTE_AXES = ("activation_batch", "activation_length", None)
GATE_UP_AXES = ("experts", "embed", "mlp")
DOWN_AXES = ("experts", "mlp", "embed")


def capacity(cfg: ModelConfig, length: int) -> int:
    """Slots per expert in each batch row (capacity mode)."""
    return max(1, math.ceil(cfg.capacity_factor * length * cfg.experts_per_token / cfg.num_experts))


def route(cfg: ModelConfig, logits: jax.Array) -> tuple[jax.Array, jax.Array, dict[str, jax.Array]]:
    """Router logits [batch, length, experts] (float32) -> (expert ids [b, t, k], weights [b, t, k], stats).

    Dropped assignments (capacity mode) get the id ``num_experts`` and weight 0. Stats: ``aux_loss``
    (experts * sum_e load_e * mean_prob_e: 1 when balanced), ``z_loss`` (mean squared log-partition),
    ``load`` (fraction of the assignments each expert received, before capacity) and ``dropped`` (fraction
    of assignments over capacity).
    """
    num_experts, k = cfg.num_experts, cfg.experts_per_token
    probs = jax.nn.softmax(logits, axis=-1)
    weights, ids = jax.lax.top_k(probs, k)
    if cfg.router_renormalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    chosen = jax.nn.one_hot(ids, num_experts, dtype=jnp.float32)  # [b, t, k, E]
    load = jnp.mean(jnp.sum(chosen, axis=2), axis=(0, 1)) / k
    stats = {
        "aux_loss": num_experts * jnp.sum(load * jnp.mean(probs, axis=(0, 1))),
        "z_loss": jnp.mean(jnp.square(jax.nn.logsumexp(logits, axis=-1))),
        "load": load,
        "dropped": jnp.zeros((), jnp.float32),
    }
    if cfg.moe_mode == "capacity":
        keep = _within_capacity(chosen, capacity(cfg, logits.shape[1]))
        ids = jnp.where(keep, ids, num_experts)
        weights = jnp.where(keep, weights, 0.0)
        stats["dropped"] = 1.0 - jnp.mean(keep.astype(jnp.float32))
    return ids, weights, stats


def _within_capacity(chosen: jax.Array, slots: int) -> jax.Array:
    """Which assignments [b, t, k] fit their expert's ``slots`` in their row. First choices of the whole row
    come before second choices, each in token order (so a token loses its second expert before another
    token loses its first)."""
    b, t, k, e = chosen.shape
    ordered = jnp.swapaxes(chosen, 1, 2).reshape(b, k * t, e)  # [b, (choice, token), E]
    position = jnp.sum((jnp.cumsum(ordered, axis=1) - 1.0) * ordered, axis=-1)  # index among the same expert
    return jnp.swapaxes((position < slots).reshape(b, k, t), 1, 2)


def _swiglu_grouped(rows: jax.Array, gate: jax.Array, up: jax.Array, down: jax.Array,
                    group_sizes: jax.Array) -> jax.Array:
    """Rows sorted by expert [m, d] -> expert outputs [m, d]; rows past sum(group_sizes) give zeros."""
    h = jax.nn.silu(jax.lax.ragged_dot(rows, gate, group_sizes)) * jax.lax.ragged_dot(rows, up, group_sizes)
    return jax.lax.ragged_dot(h, down, group_sizes)


def experts_local(x: jax.Array, ids: jax.Array, weights: jax.Array, gate: jax.Array, up: jax.Array,
                  down: jax.Array, num_experts: int, max_rows: int | None, mesh_axes: bool) -> jax.Array:
    """One device's part of the expert computation (called inside shard_map, or alone without a mesh).

    x [b, t, d], ids/weights [b, t, k] (id ``num_experts`` = dropped); gate/up [E_local, d_shard, f_shard],
    down [E_local, f_shard, d_shard]. ``max_rows`` bounds what one expert shard can receive from this device
    (None: every assignment of this device).
    """
    b, t, d = x.shape
    k = ids.shape[-1]
    if mesh_axes:  # weights: gathered over fsdp (their gradients are reduce-scattered back)
        gate, up = (jax.lax.all_gather(w, "fsdp", axis=1, tiled=True) for w in (gate, up))
        down = jax.lax.all_gather(down, "fsdp", axis=2, tiled=True)
    ep = jax.lax.axis_size("expert") if mesh_axes else 1
    local_experts = num_experts // ep
    ids, weights = ids.reshape(b * t * k), weights.reshape(b * t * k)
    order = jnp.argsort(ids, stable=True)  # assignments sorted by expert; dropped ones last
    sorted_ids = ids[order]
    rows = x.reshape(b * t, d)[order // k]
    counts = jnp.sum(jax.nn.one_hot(ids, num_experts, dtype=jnp.int32), axis=0)  # dropped ids count nowhere
    if ep == 1:
        out_sorted = _swiglu_grouped(rows, gate, up, down, counts)
    else:
        out_sorted = _exchange_and_compute(rows, sorted_ids, counts, gate, up, down, ep, local_experts,
                                           min(max_rows or b * t * k, b * t * k))
    out = out_sorted[jnp.argsort(order)].reshape(b * t, k, d)  # back to (token, choice) order
    y = jnp.einsum("nkd,nk->nd", out, weights.reshape(b * t, k).astype(out.dtype))
    if mesh_axes:
        y = jax.lax.psum(y, "tensor")  # each tensor shard summed over its slice of the hidden width
    return y.reshape(b, t, d)


def _exchange_and_compute(rows, sorted_ids, counts, gate, up, down, ep: int, local_experts: int, slots: int):
    """Sends sorted rows to the expert shards that own their experts (``slots`` rows per shard, fixed size),
    runs the local experts on what arrives, and returns each row's output in the sorted order."""
    m, d = rows.shape
    per_shard = counts.reshape(ep, local_experts)
    sent = jnp.sum(per_shard, axis=1)  # rows for each destination shard
    starts = jnp.cumsum(sent) - sent
    slot = jnp.arange(slots)
    valid = slot[None, :] < sent[:, None]  # [ep, slots]
    source_row = jnp.where(valid, starts[:, None] + slot[None, :], 0)
    send = jnp.where(valid[..., None], rows[source_row], 0)  # [ep, slots, d]
    recv = jax.lax.all_to_all(send, "expert", 0, 0, tiled=True)  # recv[j]: rows from shard j
    recv_counts = jax.lax.all_to_all(per_shard, "expert", 0, 0, tiled=True)  # [ep sources, local experts]
    # each source's rows arrive sorted by expert; regroup all of them by local expert for the grouped GEMM
    bounds = jnp.cumsum(recv_counts, axis=1)  # [ep, local_experts]
    local_id = jax.vmap(lambda bound: jnp.searchsorted(bound, slot, side="right"))(bounds)  # [ep, slots]
    regroup = jnp.argsort(local_id.reshape(ep * slots), stable=True)  # unused slots (id local_experts) last
    computed = _swiglu_grouped(recv.reshape(ep * slots, d)[regroup], gate, up, down, jnp.sum(recv_counts, 0))
    back = computed[jnp.argsort(regroup)].reshape(ep, slots, d)
    back = jax.lax.all_to_all(back, "expert", 0, 0, tiled=True)  # back[j, s]: output of send[j, s]
    shard = jnp.minimum(sorted_ids // local_experts, ep - 1)
    index = jnp.arange(m) - starts[shard]
    kept = sorted_ids < local_experts * ep
    return jnp.where(kept[:, None], back[shard, jnp.clip(index, 0, slots - 1)], 0)


class MoE(nnx.Module):
    """Router plus ``num_experts`` SwiGLU experts stored stacked along the logical axis ``experts``."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        d, f, e = cfg.embed_dim, cfg.mlp_dim, cfg.num_experts
        self.cfg = cfg
        self.router = param(rngs, (d, e), ("embed", None), cfg.init_std)
        self.wi_gate = param(rngs, (e, d, f), GATE_UP_AXES, cfg.init_std)
        self.wi_up = param(rngs, (e, d, f), GATE_UP_AXES, cfg.init_std)
        self.wo = param(rngs, (e, f, d), DOWN_AXES, cfg.init_std / math.sqrt(2 * cfg.num_layers))

    def __call__(self, x: jax.Array) -> tuple[jax.Array, dict[str, jax.Array]]:
        """x [batch, length, embed] -> (output of the same shape, routing stats; see ``route``)."""
        cfg, dt = self.cfg, compute_dtype(self.cfg)
        logits = jnp.einsum("btd,de->bte", x.astype(jnp.float32), self.router[...])
        ids, weights, stats = route(cfg, logits)
        x = constrain(x, TOKEN_AXES)
        ids, weights = constrain(ids, ROUTE_AXES), constrain(weights, ROUTE_AXES)
        gate, up, down = (w[...].astype(dt) for w in (self.wi_gate, self.wi_up, self.wo))
        mesh = jax.sharding.get_abstract_mesh()
        if mesh.empty:
            return experts_local(x, ids, weights, gate, up, down, cfg.num_experts, None, False), stats
        max_rows = None
        if cfg.moe_mode == "capacity":  # a device's rows fill at most `capacity` slots of each expert of a shard
            rows_per_device = x.shape[0] // math.prod(mesh.shape[a] for a in ("data", "fsdp", "expert"))
            max_rows = rows_per_device * capacity(cfg, x.shape[1]) * cfg.num_experts // mesh.shape["expert"]
        token_spec, route_spec = logical_to_spec(TOKEN_AXES), logical_to_spec(ROUTE_AXES)

        def local(x, ids, weights, gate, up, down):
            return experts_local(x, ids, weights, gate, up, down, cfg.num_experts, max_rows, True)

        y = jax.shard_map(local, in_specs=(token_spec, route_spec, route_spec, logical_to_spec(GATE_UP_AXES),
                                           logical_to_spec(GATE_UP_AXES), logical_to_spec(DOWN_AXES)),
                          out_specs=token_spec)(x, ids, weights, gate, up, down)
        return constrain(y, TOKEN_AXES), stats
