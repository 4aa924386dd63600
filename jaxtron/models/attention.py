"""Self-attention with rotary positions: grouped-query (Llama, Qwen3, Gemma 3, gpt-oss, Llama 4) or multi-head latent
(DeepSeek-V3). Grouped-query attention may have local layers (a sliding window, or chunks), global layers without
RoPE, sinks, biases and its own query scale; which kind a block is comes from the layer stack (``local``)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from jaxtron.config.schema import ExecutionConfig, ModelConfig
from jaxtron.models import window_cache
from jaxtron.models.layers import Norm, apply_rope, compute_dtype, rope_attention_factor, rope_frequencies, yarn_mscale
from jaxtron.models.projection import Projection
from jaxtron.ops import attention as attention_ops
from jaxtron.ops import dense


class _SelfAttention(nnx.Module):
    """What both attentions share: how they run (compute dtype, kernel, packed-document limit) and the kernel
    call."""

    def _runs(self, cfg: ModelConfig, execution: ExecutionConfig, implementation: str) -> None:
        self.cfg = cfg
        self.dtype = compute_dtype(execution)
        self.max_segments = execution.attention_max_segments
        self.implementation = implementation

    def _attend(self, q: jax.Array, k: jax.Array, v: jax.Array, positions: jax.Array,
                segment_ids: jax.Array | None, window: int = 0, sinks: jax.Array | None = None,
                chunk: int = 0) -> jax.Array:
        """``chunk`` > 0: each token sees only its own chunk (``chunk_segments``), as more segments."""
        segments = self.max_segments
        if chunk and chunk < q.shape[1]:
            segment_ids = chunk_segments(positions, segment_ids, chunk, q.shape[1])
            segments += -(-q.shape[1] // chunk)
        return attention_ops.dot_product_attention(q, k, v, implementation=self.implementation,
                                                   segment_ids=segment_ids, positions=positions,
                                                   max_segments=segments, window=window, sinks=sinks)


def chunk_segments(positions: jax.Array, segment_ids: jax.Array | None, chunk: int, length: int) -> jax.Array:
    """Segment ids [b, t] that split each document into aligned chunks of ``chunk`` positions: a token's document
    times the chunks a row can hold, plus its chunk. Tokens of one segment stay in one run of columns, so
    cuDNN's packed layout takes them as documents; the ids need no column order (a sharded sequence's layout)."""
    chunks = positions // chunk
    if segment_ids is None:
        return chunks.astype(jnp.int32)
    return (segment_ids * (length // chunk + 1) + chunks).astype(jnp.int32)


def temperature(cfg: ModelConfig, positions: jax.Array) -> jax.Array:
    """The NoPE layers' query scale [b, t, 1, 1] by position (Llama 4's attention temperature tuning): it grows
    with the log of the position, by ``temperature_scale`` per e-fold of ``temperature_floor`` positions."""
    a = cfg.attention
    steps = jnp.floor((positions.astype(jnp.float32) + 1.0) / a.temperature_floor)
    return (1.0 + a.temperature_scale * jnp.log1p(steps))[:, :, None, None]


def unit_rms(x: jax.Array, eps: float) -> jax.Array:
    """Each head's vector over its root mean square, in float32, without a weight (Llama 4's qk norm)."""
    x32 = x.astype(jnp.float32)
    return (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)).astype(x.dtype)


def write_cache(cache: jax.Array, new: jax.Array, positions: jax.Array) -> jax.Array:
    """``cache`` [b, S, ...] with ``new`` [b, t, ...] written at each row's ``positions`` [b, t] (the cache's slot
    of a token is its position; positions past the cache, and -1 for a prompt's padding, are dropped)."""
    rows = jnp.arange(cache.shape[0])[:, None]
    positions = jnp.where(positions < 0, cache.shape[1], positions)
    return cache.at[rows, positions].set(new.astype(cache.dtype), mode="drop")


def cached_attention(q: jax.Array, k: jax.Array, v: jax.Array, positions: jax.Array, window: int = 0,
                     sinks: jax.Array | None = None, chunk: int = 0) -> jax.Array:
    """Causal attention of queries q [b, t, n, h] at ``positions`` [b, t] over the cache's keys k and values v
    [b, S, g, h] (slot s holds position s): each query sees the slots up to its own position (the ``window``
    latest, with one; those of its own ``chunk``, with one), with ``sinks``. float32 scores and softmax, the output
    in q's dtype; n a multiple of g."""
    slots = jnp.broadcast_to(jnp.arange(k.shape[1]), (k.shape[0], k.shape[1]))
    q_chunks, k_chunks = (positions // chunk, slots // chunk) if chunk else (None, None)
    return dense.attention(q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32),
                           dense.visible(positions, slots, q_chunks, k_chunks, window), sinks).astype(q.dtype)


def apply_partial_rope(cfg: ModelConfig, x: jax.Array, positions: jax.Array, local: bool = False) -> jax.Array:
    """Queries or keys [b, t, heads, head_dim] rotated by position: the first ``rope.fraction`` of each head's
    dimensions (Qwen3.5 rotates a quarter), the rest as they are."""
    rotated = int(x.shape[-1] * cfg.rope.fraction)
    inv_freq, scale = rope_frequencies(cfg, rotated, local=local), rope_attention_factor(cfg, local)
    if rotated == x.shape[-1]:
        return apply_rope(x, positions, inv_freq, scale)
    return jnp.concatenate([apply_rope(x[..., :rotated], positions, inv_freq, scale), x[..., rotated:]], axis=-1)


class Attention(_SelfAttention):
    def __init__(self, cfg: ModelConfig, execution: ExecutionConfig, rngs: nnx.Rngs, implementation: str):
        d, n, g, h = cfg.embed_dim, cfg.attention.num_heads, cfg.attention.num_kv_heads, cfg.resolved_head_dim
        out_std, dt, bias = cfg.init_std / math.sqrt(2 * cfg.num_layers), execution.dtype, cfg.attention.bias
        self.wq = Projection(rngs, (d,), (n, h), ("embed", "heads", "head_dim"), cfg.init_std, dt, bias)
        self.wk = Projection(rngs, (d,), (g, h), ("embed", "kv_heads", "head_dim"), cfg.init_std, dt, bias)
        self.wv = Projection(rngs, (d,), (g, h), ("embed", "kv_heads", "head_dim"), cfg.init_std, dt, bias)
        self.wo = Projection(rngs, (n, h), (d,), ("heads", "head_dim", "embed"), out_std, dt, bias)
        # Qwen3, Gemma 3: each head's queries and keys RMS-normalised (one scale of head_dim, shared by the heads)
        self.q_norm = Norm(cfg, execution, size=h, kind="rmsnorm") if cfg.attention.qk_norm else None
        self.k_norm = Norm(cfg, execution, size=h, kind="rmsnorm") if cfg.attention.qk_norm else None
        # gpt-oss: a logit per head beside the keys, whose value is zero (ops/sinks.py)
        self.sinks = nnx.Param(jnp.zeros((n,), jnp.float32), out_sharding=("bias",)) if cfg.attention.sinks \
            else None
        # Qwen3.5: the output scaled by sigmoid of its own projection of the input, per head and dimension
        self.wg = Projection(rngs, (d,), (n, h), ("embed", "heads", "head_dim"), cfg.init_std, dt, bias) \
            if cfg.attention.output_gate else None
        self._runs(cfg, execution, implementation)

    def __call__(self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array | None,
                 local: bool = False) -> jax.Array:
        """``local``: a local layer, which sees the ``attention.window`` latest positions, or its own
        ``attention.chunk``."""
        q, k, v = self.project(x, positions, local)
        return self.output(x, self.attend(q, k, v, positions, segment_ids, local))

    def attend(self, q: jax.Array, k: jax.Array, v: jax.Array, positions: jax.Array, segment_ids: jax.Array | None,
               local: bool = False) -> jax.Array:
        """The heads' output [b, t, heads, head_dim] of ``project``'s queries, keys and values."""
        window, chunk = (self.cfg.attention.window, self.cfg.attention.chunk) if local else (0, 0)
        return self._attend(q, k, v, positions, segment_ids, window, self._sinks(), chunk)

    def _sinks(self) -> jax.Array | None:
        return None if self.sinks is None else self.sinks[...]

    def output(self, x: jax.Array, out: jax.Array) -> jax.Array:
        """The heads' output [b, t, heads, head_dim], gated (``attention.output_gate``) and projected."""
        if self.wg is not None:
            out = out * jax.nn.sigmoid(self.wg(x))
        return self.wo(out)

    def project(self, x: jax.Array, positions: jax.Array,
                 local: bool = False) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Queries, keys and values [b, t, heads, head_dim], rotated (but in NoPE layers); the queries carry the
        softmax scale's departure from 1/sqrt(head_dim) (Gemma's query_pre_attn_scalar), since the kernels scale by
        that, and the NoPE layers' temperature (Llama 4)."""
        q, k, v = self.wq(x), self.wk(x), self.wv(x)
        a = self.cfg.attention
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        rotates = self.cfg.position_embedding == "rope" and a.rotates(local)
        if rotates:
            q, k = (apply_partial_rope(self.cfg, t, positions, local) for t in (q, k))
        if rotates and a.qk_l2_norm:
            q, k = unit_rms(q, self.cfg.norm_eps), unit_rms(k, self.cfg.norm_eps)
        if not a.rotates(local) and a.temperature_floor:
            q = (q * temperature(self.cfg, positions)).astype(q.dtype)
        scalar = a.query_pre_attn_scalar
        if scalar and scalar != q.shape[-1]:
            q = q * jnp.asarray(math.sqrt(q.shape[-1] / scalar), q.dtype)
        return q, k, v

    def decode(self, x: jax.Array, positions: jax.Array, cache: dict[str, jax.Array],
               local: bool = False) -> tuple[jax.Array, dict[str, jax.Array]]:
        """The tokens ``x`` [b, t, d] at ``positions`` with the earlier ones' keys and values from ``cache``
        (``empty_cache``): -> (the output, the cache with these tokens' written in). A local layer's cache is a
        ring of ``attention.window`` slots (``models/window_cache.py``)."""
        q, k, v = self.project(x, positions, local)
        if local and "slot_positions" in cache:
            out, cache = window_cache.attend(cache, q, k, v, positions, self.cfg.attention.window, self._sinks())
            return self.output(x, out), cache
        cache = {"k": write_cache(cache["k"], k, positions), "v": write_cache(cache["v"], v, positions)}
        window, chunk = (self.cfg.attention.window, self.cfg.attention.chunk) if local else (0, 0)
        out = cached_attention(q, cache["k"], cache["v"], positions, window, self._sinks(), chunk)
        return self.output(x, out), cache

    def empty_cache(self, batch: int, length: int, dtype, local: bool = False) -> dict[str, jax.Array]:
        """Zero keys and values for ``length`` positions; a local layer's for no more than its window."""
        shape = (batch, length, self.cfg.attention.num_kv_heads, self.cfg.resolved_head_dim)
        window = self.cfg.attention.window
        if local and window and window < length:
            return window_cache.empty(shape, window, dtype)
        return {"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype)}


class LatentAttention(_SelfAttention):
    """Multi-head latent attention (DeepSeek-V2/V3): queries from a low-rank projection (``q_lora_rank``, or one
    full-rank matrix), keys and values from one normed latent of ``kv_lora_rank`` per token. Each head's query and
    key are ``head_dim`` wide without rotation plus ``qk_rope_head_dim`` rotated; the key's rotated part comes
    straight from the input and is shared by all heads. Values are ``v_head_dim`` wide.

    The attention kernels take one head size, so values narrower than the keys are padded with zeros and the
    padding is cut from the output; the softmax scale 1/sqrt(query size) times YaRN's correction squared (the
    kernels scale by 1/sqrt(query size)) is folded into the queries."""

    def __init__(self, cfg: ModelConfig, execution: ExecutionConfig, rngs: nnx.Rngs, implementation: str):
        d, n, rope = cfg.embed_dim, cfg.attention.num_heads, cfg.attention.qk_rope_head_dim
        qk, v, q_rank, kv_rank = cfg.qk_head_dim, cfg.resolved_v_head_dim, cfg.attention.q_lora_rank, \
            cfg.attention.kv_lora_rank
        out_std, std, dt = cfg.init_std / math.sqrt(2 * cfg.num_layers), cfg.init_std, execution.dtype
        if q_rank:
            self.wq_a = Projection(rngs, (d,), (q_rank,), ("embed", "latent"), std, dt)
            self.q_norm = Norm(cfg, execution, size=q_rank, kind="rmsnorm")
            self.wq_b = Projection(rngs, (q_rank,), (n, qk), ("latent", "heads", "head_dim"), std, dt)
        else:
            self.wq = Projection(rngs, (d,), (n, qk), ("embed", "heads", "head_dim"), std, dt)
        # the latent and the shared rotated key, from one matrix
        self.wkv_a = Projection(rngs, (d,), (kv_rank + rope,), ("embed", "latent"), std, dt)
        self.kv_norm = Norm(cfg, execution, size=kv_rank, kind="rmsnorm")
        self.wkv_b = Projection(rngs, (kv_rank,), (n, cfg.resolved_head_dim + v), ("latent", "heads", "head_dim"),
                                std, dt)
        self.wo = Projection(rngs, (n, v), (d,), ("heads", "head_dim", "embed"), out_std, dt)
        self._runs(cfg, execution, implementation)

    def __call__(self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array | None,
                 local: bool = False) -> jax.Array:
        """``local`` is always False: latent attention has no local layers (the config refuses a window)."""
        q = self._queries(x, positions)
        k, v = self._keys_values(*self._compressed(x, positions))
        return self._output(self._attend(q, k, v, positions, segment_ids))

    def _queries(self, x: jax.Array, positions: jax.Array) -> jax.Array:
        """Each head's query [b, t, n, qk]: unrotated part then rotated part, with the softmax factor folded in."""
        cfg, nope = self.cfg, self.cfg.resolved_head_dim
        q = self.wq_b(self.q_norm(self.wq_a(x))) if cfg.attention.q_lora_rank else self.wq(x)
        inv_freq, scale = rope_frequencies(cfg, cfg.attention.qk_rope_head_dim), rope_attention_factor(cfg)
        q = jnp.concatenate([q[..., :nope], apply_rope(q[..., nope:], positions, inv_freq, scale)], axis=-1)
        softmax = mla_softmax_factor(cfg)
        return q * jnp.asarray(softmax, q.dtype) if softmax != 1.0 else q

    def _compressed(self, x: jax.Array, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
        """What a token keeps for later ones: its normed latent [b, t, kv_lora_rank] and its rotated key part
        [b, t, qk_rope_head_dim], shared by the heads (the compressed cache)."""
        cfg, rank = self.cfg, self.cfg.attention.kv_lora_rank
        latent = self.wkv_a(x)
        inv_freq, scale = rope_frequencies(cfg, cfg.attention.qk_rope_head_dim), rope_attention_factor(cfg)
        return self.kv_norm(latent[..., :rank]), apply_rope(latent[:, :, None, rank:], positions, inv_freq,
                                                            scale)[:, :, 0]

    def _keys_values(self, latent: jax.Array, k_rope: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Keys [b, s, n, qk] and values (padded to qk) from the compressed latent and rotated key part."""
        cfg, nope, v_dim = self.cfg, self.cfg.resolved_head_dim, self.cfg.resolved_v_head_dim
        kv = self.wkv_b(latent)
        k_rope = jnp.broadcast_to(k_rope[:, :, None], (*kv.shape[:3], cfg.attention.qk_rope_head_dim))
        k = jnp.concatenate([kv[..., :nope], k_rope.astype(kv.dtype)], axis=-1)
        v = kv[..., nope:]
        if v_dim < cfg.qk_head_dim:
            v = jnp.pad(v, ((0, 0), (0, 0), (0, 0), (0, cfg.qk_head_dim - v_dim)))
        return k, v

    def _output(self, out: jax.Array) -> jax.Array:
        return self.wo(out[..., :self.cfg.resolved_v_head_dim])

    def decode(self, x: jax.Array, positions: jax.Array, cache: dict[str, jax.Array],
               local: bool = False) -> tuple[jax.Array, dict[str, jax.Array]]:
        """As ``Attention.decode``, the cache compressed: each token's normed latent ("latent" [b, S, rank]) and
        rotated key part ("rope" [b, S, rope]); the keys and values of the cached tokens are expanded from them."""
        latent, k_rope = self._compressed(x, positions)
        cache = {"latent": write_cache(cache["latent"], latent, positions),
                 "rope": write_cache(cache["rope"], k_rope, positions)}
        k, v = self._keys_values(cache["latent"].astype(self.dtype), cache["rope"].astype(self.dtype))
        return self._output(cached_attention(self._queries(x, positions), k, v, positions)), cache

    def empty_cache(self, batch: int, length: int, dtype, local: bool = False) -> dict[str, jax.Array]:
        a = self.cfg.attention
        return {"latent": jnp.zeros((batch, length, a.kv_lora_rank), dtype),
                "rope": jnp.zeros((batch, length, a.qk_rope_head_dim), dtype)}


def mla_softmax_factor(cfg: ModelConfig) -> float:
    """Latent attention's softmax scale over 1/sqrt(query size): YaRN's correction for ``rope_mscale_all_dim``,
    squared (DeepSeek-V3), else 1."""
    if cfg.rope.scaling != "yarn" or cfg.rope.factor == 1.0 or not cfg.rope.mscale_all_dim:
        return 1.0
    return yarn_mscale(cfg.rope.factor, cfg.rope.mscale_all_dim) ** 2
