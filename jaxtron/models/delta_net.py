"""Gated DeltaNet (Qwen3-Next, Qwen3.5): linear attention whose per-head state follows the gated delta rule.

For each token, from the block's normed input x:
- queries and keys (``linear.key_heads``) and values (``linear.value_heads``) are projected, each passed through a
  short causal depthwise convolution (``linear.conv_kernel`` taps, within the token's document) and SiLU;
- queries and keys are L2-normalised, the queries scaled by key_head_dim^-1/2, and each key head serves
  value_heads / key_heads consecutive value heads;
- the write strength is beta = sigmoid(x W_b) and the log-decay g = -exp(A_log) * softplus(x W_a + dt_bias);
- the rule (``ops/delta_rule.py``) gives each value head's output, RMS-normed over its dimensions and gated by
  SiLU(x W_z), then projected back to the width.

Training runs the chunked form. Generation keeps, per block, the state and the convolution's last inputs as its
cache: the state of the rule [b, value_heads, key_head_dim, value_head_dim] in float32, and the conv_kernel - 1
latest projected queries, keys and values.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from jaxtron.config.schema import ExecutionConfig, ModelConfig
from jaxtron.models.layers import Norm, compute_dtype
from jaxtron.models.projection import Projection
from jaxtron.ops import attention as attention_ops
from jaxtron.ops import delta_rule
from jaxtron.parallel.sharding import sequence_order, shard_count

L2_EPS = 1e-6  # inside the square root of the queries' and keys' L2 norms, as the published kernels use


def l2_normalize(x: jax.Array) -> jax.Array:
    """x / sqrt(sum(x^2) + eps) over the last axis, in float32."""
    x = x.astype(jnp.float32)
    return x * jax.lax.rsqrt(jnp.sum(jnp.square(x), axis=-1, keepdims=True) + L2_EPS)


def causal_conv(x: jax.Array, weight: jax.Array, segment_ids: jax.Array | None) -> jax.Array:
    """Depthwise causal convolution over the sequence: x [b, t, ...], weight [taps, ...]; output t sums
    weight[taps - 1 - m] * x[t - m] over the m earlier tokens of its own document (its own included)."""
    taps, t = weight.shape[0], x.shape[1]
    out = jnp.zeros_like(x)
    for m in range(taps):
        shifted = jnp.pad(x, [(0, 0), (m, 0)] + [(0, 0)] * (x.ndim - 2))[:, :t]
        if segment_ids is not None and m:
            same = jnp.pad(segment_ids, [(0, 0), (m, 0)], constant_values=-1)[:, :t] == segment_ids
            shifted = jnp.where(same.reshape(*same.shape, *(1,) * (x.ndim - 2)), shifted, 0)
        out = out + shifted * weight[taps - 1 - m]
    return out


class GatedDeltaNet(nnx.Module):
    def __init__(self, cfg: ModelConfig, execution: ExecutionConfig, rngs: nnx.Rngs):
        lin, d, dt = cfg.linear, cfg.embed_dim, execution.dtype
        hk, hv, dk, dv = lin.key_heads, lin.value_heads, lin.key_head_dim, lin.value_head_dim
        std, out_std = cfg.init_std, cfg.init_std / math.sqrt(2 * cfg.num_layers)
        self.wq = Projection(rngs, (d,), (hk, dk), ("embed", "kv_heads", "head_dim"), std, dt)
        self.wk = Projection(rngs, (d,), (hk, dk), ("embed", "kv_heads", "head_dim"), std, dt)
        self.wv = Projection(rngs, (d,), (hv, dv), ("embed", "heads", "head_dim"), std, dt)
        self.wz = Projection(rngs, (d,), (hv, dv), ("embed", "heads", "head_dim"), std, dt)  # the output's gate
        self.wb = Projection(rngs, (d,), (hv,), ("embed", "heads"), std, dt)  # the write strength beta
        self.wa = Projection(rngs, (d,), (hv,), ("embed", "heads"), std, dt)  # the decay's step
        self.wo = Projection(rngs, (hv, dv), (d,), ("heads", "head_dim", "embed"), out_std, dt)
        bound = 1.0 / math.sqrt(lin.conv_kernel)  # the convolution's fan-in is its taps (one channel each)

        def conv(shape, names):
            value = jax.random.uniform(rngs.params(), (lin.conv_kernel, *shape), jnp.float32, -bound, bound)
            return nnx.Param(value, out_sharding=(None, *names))

        self.conv_q = conv((hk, dk), ("kv_heads", "head_dim"))
        self.conv_k = conv((hk, dk), ("kv_heads", "head_dim"))
        self.conv_v = conv((hv, dv), ("heads", "head_dim"))
        # the decay rate exp(A_log) starts uniform in [1, 16] and the step's bias at 1, as the published models do
        a = jax.random.uniform(rngs.params(), (hv,), jnp.float32, 1.0, 16.0)
        self.a_log = nnx.Param(jnp.log(a), out_sharding=("bias",))
        self.dt_bias = nnx.Param(jnp.ones((hv,), jnp.float32), out_sharding=("bias",))
        self.norm = Norm(cfg, execution, size=dv, kind="rmsnorm", unit_offset=False)
        self.cfg, self.dtype = cfg, compute_dtype(execution)

    def _mix(self, x: jax.Array, q: jax.Array, k: jax.Array, v: jax.Array) -> tuple[jax.Array, ...]:
        """From the convolved projections: the rule's inputs (q and k normalised and spread over the value heads,
        v, g and beta in float32)."""
        groups = self.cfg.linear.value_heads // self.cfg.linear.key_heads
        q = l2_normalize(jax.nn.silu(q)) * self.cfg.linear.key_head_dim ** -0.5
        k = l2_normalize(jax.nn.silu(k))
        if groups > 1:
            q, k = jnp.repeat(q, groups, axis=2), jnp.repeat(k, groups, axis=2)
        beta = jax.nn.sigmoid(self.wb(x).astype(jnp.float32))
        step = jax.nn.softplus(self.wa(x).astype(jnp.float32) + self.dt_bias[...])
        g = -jnp.exp(self.a_log[...]) * step
        return q, k, jax.nn.silu(v).astype(jnp.float32), g, beta

    def _output(self, x: jax.Array, out: jax.Array) -> jax.Array:
        """The rule's output [b, t, value_heads, dv], normed, gated by SiLU(x W_z) and projected to the width."""
        normed = self.norm(out).astype(jnp.float32)
        gated = normed * jax.nn.silu(self.wz(x).astype(jnp.float32))
        return self.wo(gated.astype(self.dtype))

    def __call__(self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array | None,
                 local: bool = False) -> jax.Array:
        """x [b, t, d] -> [b, t, d]; each document (``segment_ids``) starts from a zero state. On a sequence split
        over devices, the columns hold the tokens in the load-balanced order (``sharding.sequence_order``): the
        block runs in token order and hands its output back in the columns' order."""
        order = _column_tokens(x.shape[1])
        if order is not None:
            columns = np.argsort(order)  # the column that holds each token
            x = jnp.take(x, columns, axis=1)
            segment_ids = None if segment_ids is None else jnp.take(segment_ids, columns, axis=1)
        q, k, v = (causal_conv(w(x), c[...].astype(self.dtype), segment_ids) for w, c in
                   ((self.wq, self.conv_q), (self.wk, self.conv_k), (self.wv, self.conv_v)))
        out, _ = delta_rule.chunked(*self._mix(x, q, k, v), segments=segment_ids)
        # named as attention's output: a remat policy that keeps it (save_attention) does not run the rule again
        y = self._output(x, checkpoint_name(out, attention_ops.OUTPUT_NAME))
        return y if order is None else jnp.take(y, order, axis=1)

    def decode(self, x: jax.Array, positions: jax.Array, cache: dict[str, jax.Array],
               local: bool = False) -> tuple[jax.Array, dict[str, jax.Array]]:
        """Tokens x [b, t, d] after those the cache holds. Rows are right-padded: a position of -1 is padding,
        which changes neither the state nor the convolution's window."""
        valid = positions >= 0
        convolved, windows = [], {}
        for name, w, c in (("q", self.wq, self.conv_q), ("k", self.wk, self.conv_k), ("v", self.wv, self.conv_v)):
            new = jnp.where(valid[..., None, None], w(x), 0)
            joined = jnp.concatenate([cache[f"conv_{name}"].astype(new.dtype), new], axis=1)
            convolved.append(causal_conv(joined, c[...].astype(self.dtype), None)[:, -x.shape[1]:])
            windows[f"conv_{name}"] = _window_after(joined, jnp.sum(valid, axis=1), c.shape[0] - 1)
        q, k, v, g, beta = self._mix(x, *convolved)
        g, beta = jnp.where(valid[..., None], g, 0.0), jnp.where(valid[..., None], beta, 0.0)
        rule = delta_rule.recurrent if x.shape[1] == 1 else delta_rule.chunked
        out, state = rule(q, k, v, g, beta, cache["state"])
        return self._output(x, out), {**windows, "state": state}

    def empty_cache(self, batch: int, length: int, dtype, local: bool = False) -> dict[str, jax.Array]:
        """Zero state and window; their sizes do not grow with ``length``."""
        lin = self.cfg.linear
        taps = lin.conv_kernel - 1
        return {"conv_q": jnp.zeros((batch, taps, lin.key_heads, lin.key_head_dim), dtype),
                "conv_k": jnp.zeros((batch, taps, lin.key_heads, lin.key_head_dim), dtype),
                "conv_v": jnp.zeros((batch, taps, lin.value_heads, lin.value_head_dim), dtype),
                "state": jnp.zeros((batch, lin.value_heads, lin.key_head_dim, lin.value_head_dim), jnp.float32)}


def _column_tokens(length: int) -> np.ndarray | None:
    """Which token each column of a row holds on the current mesh (None: each its own, in order)."""
    mesh = jax.sharding.get_abstract_mesh()
    shards = 1 if mesh.empty else shard_count(dict(mesh.shape), "activation_length")
    order = sequence_order(length, shards)
    return None if np.array_equal(order, np.arange(length)) else order


def _window_after(joined: jax.Array, valid: jax.Array, taps: int) -> jax.Array:
    """The ``taps`` inputs before each row's first padding: rows of ``joined`` [b, taps + t, ...] (the old window,
    then the new tokens) end after ``valid`` [b] new tokens."""
    index = valid[:, None] + jnp.arange(taps)[None]  # the window's slots in `joined`
    return jnp.take_along_axis(joined, index.reshape(*index.shape, *(1,) * (joined.ndim - 2)), axis=1)
