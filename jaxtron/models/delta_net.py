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
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from jaxtron.config.schema import ExecutionConfig, ModelConfig
from jaxtron.models.layers import Norm, compute_dtype
from jaxtron.models.projection import Projection
from jaxtron.ops import attention as attention_ops
from jaxtron.ops import delta_context, delta_rule
from jaxtron.parallel.sharding import shard_count

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
        """From the convolved projections: the rule's inputs (q, k, v as ``_qkv``; g and beta as ``_gates``)."""
        return (*_qkv(self.cfg, q, k, v), *self._gates(x))

    def _gates(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        """The log-decay g and the write strength beta [b, t, value_heads], float32."""
        beta = jax.nn.sigmoid(self.wb(x).astype(jnp.float32))
        step = jax.nn.softplus(self.wa(x).astype(jnp.float32) + self.dt_bias[...])
        return -jnp.exp(self.a_log[...]) * step, beta

    def _convs(self) -> tuple[jax.Array, jax.Array, jax.Array]:
        return tuple(c[...].astype(self.dtype) for c in (self.conv_q, self.conv_k, self.conv_v))

    def _output(self, x: jax.Array, out: jax.Array) -> jax.Array:
        """The rule's output [b, t, value_heads, dv], normed, gated by SiLU(x W_z) and projected to the width."""
        normed = self.norm(out).astype(jnp.float32)
        gated = normed * jax.nn.silu(self.wz(x).astype(jnp.float32))
        return self.wo(gated.astype(self.dtype))

    def __call__(self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array | None,
                 local: bool = False) -> jax.Array:
        """x [b, t, d] -> [b, t, d]; each document (``segment_ids``) starts from a zero state. On a sequence split
        over devices each runs the rule on its own columns, handed the state of the pieces before
        (``ops/delta_context.py``)."""
        if delta_context_applies():
            def prepare(q, k, v, convs, segments):
                return _qkv(self.cfg, *(causal_conv(a, c, segments) for a, c in zip((q, k, v), convs, strict=True)))

            out = delta_context.over_sequence(prepare, self.wq(x), self.wk(x), self.wv(x), self._convs(),
                                              *self._gates(x), segment_ids)
            return self._output(x, checkpoint_name(out, attention_ops.OUTPUT_NAME))
        q, k, v = (causal_conv(w(x), c, segment_ids) for w, c in zip((self.wq, self.wk, self.wv), self._convs(),
                                                                      strict=True))
        out, _ = delta_rule.chunked(*self._mix(x, q, k, v), segments=segment_ids)
        # named as attention's output: a remat policy that keeps it (save_attention) does not run the rule again
        return self._output(x, checkpoint_name(out, attention_ops.OUTPUT_NAME))

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


def _qkv(cfg: ModelConfig, q: jax.Array, k: jax.Array, v: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """From the convolved projections, float32: q and k SiLU'd, L2-normalised and spread over the value heads (the
    queries scaled by key_head_dim^-1/2), v SiLU'd."""
    groups = cfg.linear.value_heads // cfg.linear.key_heads
    q = l2_normalize(jax.nn.silu(q)) * cfg.linear.key_head_dim ** -0.5
    k = l2_normalize(jax.nn.silu(k))
    if groups > 1:
        q, k = jnp.repeat(q, groups, axis=2), jnp.repeat(k, groups, axis=2)
    return q, k, jax.nn.silu(v).astype(jnp.float32)


def delta_context_applies() -> bool:
    """Whether the sequence is split over devices: each then runs the rule on its own columns
    (``ops/delta_context.py``)."""
    mesh = jax.sharding.get_abstract_mesh()
    return not mesh.empty and shard_count(dict(mesh.shape), "activation_length") > 1


def _window_after(joined: jax.Array, valid: jax.Array, taps: int) -> jax.Array:
    """The ``taps`` inputs before each row's first padding: rows of ``joined`` [b, taps + t, ...] (the old window,
    then the new tokens) end after ``valid`` [b] new tokens."""
    index = valid[:, None] + jnp.arange(taps)[None]  # the window's slots in `joined`
    return jnp.take_along_axis(joined, index.reshape(*index.shape, *(1,) * (joined.ndim - 2)), axis=1)
