"""Small building blocks: parameters with logical names, norms, gated activations, embeddings, rotary positions."""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from jaxtron.config.schema import ExecutionConfig, ModelConfig
from jaxtron.parallel.sharding import constrain


def param(rngs: nnx.Rngs, shape: Sequence[int], names: Sequence[str], std: float) -> nnx.Param:
    """A float32 parameter drawn from N(0, std^2), annotated with one logical name per dimension."""
    value = std * jax.random.normal(rngs.params(), tuple(shape), jnp.float32)
    return nnx.Param(value, out_sharding=tuple(names))


def compute_dtype(execution: ExecutionConfig) -> jnp.dtype:
    return jnp.dtype(execution.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def embed_lookup(table: jax.Array, ids: jax.Array, dtype: jnp.dtype, row_axis: str = "vocab") -> jax.Array:
    """Rows ``table[ids]`` in the compute dtype; the gradient is accumulated in float32.

    A plain gather in bf16 would sum the gradient rows of a frequent token in bf16 (the
    scatter-add runs in the gathered array's dtype) and lose most of it.
    """
    # gathered over fsdp like any weight, in the compute dtype, so the lookup partitions per vocab shard
    return jnp.take(constrain(table.astype(dtype), (row_axis, None)), ids, axis=0)


def _embed_fwd(table, ids, dtype, row_axis):
    return embed_lookup(table, ids, dtype, row_axis), (ids, jnp.zeros((0,) + table.shape, table.dtype))


def _embed_bwd(dtype, row_axis, residuals, g):
    ids, like = residuals
    # held as the table is: each device adds the rows of its vocabulary shard. Left free, XLA summed a whole float32
    # table on every device and reduce-scattered it over the tensor group (2.3 GiB a microbatch, GPT-3 175B on TP4).
    grad = constrain(jnp.zeros(like.shape[1:], jnp.float32), (row_axis, "embed")).at[ids].add(g.astype(jnp.float32))
    return grad.astype(like.dtype), None


embed_lookup.defvjp(_embed_fwd, _embed_bwd)


class Norm(nnx.Module):
    """RMSNorm (scale only) or LayerNorm (scale and bias) over the last axis of ``size`` (default: the embedding);
    statistics in float32. ``kind`` overrides ``model.norm`` (Qwen3's per-head query and key norms are RMSNorm).
    With ``model.norm_unit_offset`` the stored weight w scales by 1 + w and starts at 0 (Gemma); ``unit_offset``
    overrides it (Gated DeltaNet's output norm scales by its weight in Qwen3.5)."""

    def __init__(self, cfg: ModelConfig, execution: ExecutionConfig, size: int | None = None,
                 kind: str | None = None, unit_offset: bool | None = None):
        self.eps = cfg.norm_eps
        self.dtype = compute_dtype(execution)
        self.offset = 1.0 if (cfg.norm_unit_offset if unit_offset is None else unit_offset) else 0.0
        size = size or cfg.embed_dim
        self.scale = nnx.Param(jnp.full((size,), 1.0 - self.offset, jnp.float32), out_sharding=("norm",))
        self.bias = nnx.Param(jnp.zeros((size,), jnp.float32), out_sharding=("norm",)) \
            if (kind or cfg.norm) == "layernorm" else None

    @jax.named_scope("norm")
    def __call__(self, x: jax.Array) -> jax.Array:
        x = x.astype(jnp.float32)
        if self.bias is not None:
            x = x - jnp.mean(x, axis=-1, keepdims=True)
        x = x * jax.lax.rsqrt(jnp.mean(jnp.square(x), axis=-1, keepdims=True) + self.eps)
        x = x * (self.scale[...] + self.offset if self.offset else self.scale[...])
        if self.bias is not None:
            x = x + self.bias[...]
        return x.astype(self.dtype)


@dataclasses.dataclass(frozen=True)
class GatedActivation:
    """The hidden values of a gated MLP or expert from its gate and up projections (``model.activation``):
    'swiglu' silu(gate) * up; 'geglu' gelu(gate) * up with GELU's tanh form (Gemma); 'clamped_swiglu' (gpt-oss)
    the gate clamped above and the up projection both sides at ``limit``, then (up + 1) * gate *
    sigmoid(``alpha`` * gate)."""

    kind: str = "swiglu"
    limit: float = 7.0
    alpha: float = 1.702

    @classmethod
    def of(cls, cfg: ModelConfig) -> GatedActivation:
        return cls(cfg.activation, cfg.swiglu_limit, cfg.swiglu_alpha)

    def __call__(self, gate: jax.Array, up: jax.Array) -> jax.Array:
        return self.combine(self.gated(gate), up)

    def gated(self, gate: jax.Array) -> jax.Array:
        """The gate projection's part, before the up projection's joins it."""
        if self.kind == "geglu":
            return jax.nn.gelu(gate, approximate=True)
        if self.kind == "clamped_swiglu":
            gate = jnp.minimum(gate, self.limit)
            return gate * jax.nn.sigmoid(self.alpha * gate)
        return jax.nn.silu(gate)

    def combine(self, gated: jax.Array, up: jax.Array) -> jax.Array:
        """The hidden values from the gate's part (``gated``) and the up projection."""
        if self.kind == "clamped_swiglu":
            return (jnp.clip(up, -self.limit, self.limit) + 1) * gated
        return gated * up


def rope_frequencies(cfg: ModelConfig, dim: int | None = None, local: bool = False) -> jax.Array:
    """Inverse frequencies of rotary embeddings over ``dim`` (default: the head size) rotated dimensions, stretched
    when ``rope.factor`` > 1 as ``rope.scaling`` says (Llama-3.1's bands, YaRN's ramp or a linear stretch).
    ``local``: of a local layer, which with ``rope.local_theta`` rotates by its own base, unstretched."""
    dim = dim or cfg.resolved_head_dim
    theta = cfg.rope.local_theta if local and cfg.rope.local_theta else cfg.rope.theta
    inv_freq = 1.0 / (theta ** (jnp.arange(0, dim, 2, dtype=jnp.float32) / dim))
    factor = cfg.rope.factor
    if factor == 1.0 or (local and cfg.rope.local_theta):
        return inv_freq
    if cfg.rope.scaling == "yarn":
        return _yarn(cfg, inv_freq, dim)
    if cfg.rope.scaling == "linear":
        return inv_freq / factor
    wavelen = 2 * math.pi / inv_freq
    low_freq_wavelen = cfg.rope.original_max_len / cfg.rope.low_freq_factor
    high_freq_wavelen = cfg.rope.original_max_len / cfg.rope.high_freq_factor
    # Long wavelengths are divided by the factor, short ones kept, the band between interpolated (none where the two
    # factors are equal: Llama 4 Scout's).
    scaled = jnp.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    if cfg.rope.high_freq_factor == cfg.rope.low_freq_factor:
        return scaled
    smooth = (cfg.rope.original_max_len / wavelen - cfg.rope.low_freq_factor) / (
        cfg.rope.high_freq_factor - cfg.rope.low_freq_factor)
    interpolated = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    middle = (wavelen <= low_freq_wavelen) & (wavelen >= high_freq_wavelen)
    return jnp.where(middle, interpolated, scaled)


def _yarn(cfg: ModelConfig, inv_freq: jax.Array, dim: int) -> jax.Array:
    """YaRN: frequencies that turn fewer than ``rope.beta_slow`` times over the original context are divided by
    the factor, those turning more than ``rope.beta_fast`` times are kept, with a linear ramp over the dimensions
    between (its ends rounded outwards to whole dimensions unless ``rope.truncate`` is off)."""
    def dimension(rotations):  # the rotated dimension that turns `rotations` times over the original context
        return dim * math.log(cfg.rope.original_max_len / (rotations * 2 * math.pi)) / (2 * math.log(cfg.rope.theta))

    low, high = dimension(cfg.rope.beta_fast), dimension(cfg.rope.beta_slow)
    if cfg.rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    ramp = jnp.clip((jnp.arange(dim // 2, dtype=jnp.float32) - low) / ((high - low) or 0.001), 0.0, 1.0)
    return inv_freq / cfg.rope.factor * ramp + inv_freq * (1 - ramp)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction for a context stretched by ``factor``."""
    return 0.1 * mscale * math.log(factor) + 1.0 if factor > 1 else 1.0


def rope_attention_factor(cfg: ModelConfig, local: bool = False) -> float:
    """What YaRN multiplies the rotated queries and keys by (1 for no scaling, Llama-3.1's, a linear one, or a local
    layer with a base of its own)."""
    if cfg.rope.scaling != "yarn" or cfg.rope.factor == 1.0 or (local and cfg.rope.local_theta):
        return 1.0
    f = cfg.rope.factor
    if cfg.rope.mscale and cfg.rope.mscale_all_dim:
        return yarn_mscale(f, cfg.rope.mscale) / yarn_mscale(f, cfg.rope.mscale_all_dim)
    return yarn_mscale(f)


@jax.named_scope("rope")
def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: jax.Array, scale: float = 1.0) -> jax.Array:
    """Rotates [batch, length, heads, head_dim] by position (rotate-half layout, as in HF Llama), times ``scale``
    (YaRN's attention factor)."""
    angles = positions[:, :, None, None].astype(jnp.float32) * inv_freq  # [b, t, 1, d/2]
    sin, cos = jnp.sin(angles), jnp.cos(angles)
    if scale != 1.0:
        sin, cos = sin * scale, cos * scale
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return rotated.astype(x.dtype)
