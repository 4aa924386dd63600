"""Self-attention with rotary positions: grouped-query (Llama, Qwen3) or multi-head latent (DeepSeek-V3)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from jaxtron.config.schema import ExecutionConfig, ModelConfig
from jaxtron.models.layers import Norm, apply_rope, compute_dtype, rope_attention_factor, rope_frequencies, yarn_mscale
from jaxtron.models.projection import Projection
from jaxtron.ops import attention as attention_ops


class _SelfAttention(nnx.Module):
    """What both attentions share: how they run (compute dtype, kernel, packed-document limit) and the kernel
    call."""

    def _runs(self, cfg: ModelConfig, execution: ExecutionConfig, implementation: str) -> None:
        self.cfg = cfg
        self.dtype = compute_dtype(execution)
        self.max_segments = execution.attention_max_segments
        self.implementation = implementation

    def _attend(self, q: jax.Array, k: jax.Array, v: jax.Array, positions: jax.Array,
                segment_ids: jax.Array | None) -> jax.Array:
        return attention_ops.dot_product_attention(q, k, v, implementation=self.implementation,
                                                   segment_ids=segment_ids, positions=positions,
                                                   max_segments=self.max_segments)


def write_cache(cache: jax.Array, new: jax.Array, positions: jax.Array) -> jax.Array:
    """``cache`` [b, S, ...] with ``new`` [b, t, ...] written at each row's ``positions`` [b, t] (the cache's slot
    of a token is its position; positions past the cache are dropped)."""
    rows = jnp.arange(cache.shape[0])[:, None]
    return cache.at[rows, positions].set(new.astype(cache.dtype), mode="drop")


def cached_attention(q: jax.Array, k: jax.Array, v: jax.Array, positions: jax.Array) -> jax.Array:
    """Causal attention of queries q [b, t, n, h] at ``positions`` [b, t] over the cache's keys k and values v
    [b, S, g, h] (slot s holds position s): each query sees the slots up to its own position. float32 scores and
    softmax, the output in q's dtype; n a multiple of g (grouped queries)."""
    b, t, n, h = q.shape
    g = k.shape[2]
    qg = q.reshape(b, t, g, n // g, h).astype(jnp.float32)
    scores = jnp.einsum("btgqh,bsgh->bgqts", qg, k.astype(jnp.float32)) / jnp.sqrt(jnp.float32(h))
    seen = jnp.arange(k.shape[1])[None, None, :] <= positions[:, :, None]  # [b, t, S]
    scores = jnp.where(seen[:, None, None], scores, -jnp.inf)
    weights = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("bgqts,bsgh->btgqh", weights, v.astype(jnp.float32))
    return out.reshape(b, t, n, v.shape[-1]).astype(q.dtype)


class Attention(_SelfAttention):
    def __init__(self, cfg: ModelConfig, execution: ExecutionConfig, rngs: nnx.Rngs, implementation: str):
        d, n, g, h = cfg.embed_dim, cfg.attention.num_heads, cfg.attention.num_kv_heads, cfg.resolved_head_dim
        out_std, dt = cfg.init_std / math.sqrt(2 * cfg.num_layers), execution.dtype
        self.wq = Projection(rngs, (d,), (n, h), ("embed", "heads", "head_dim"), cfg.init_std, dt)
        self.wk = Projection(rngs, (d,), (g, h), ("embed", "kv_heads", "head_dim"), cfg.init_std, dt)
        self.wv = Projection(rngs, (d,), (g, h), ("embed", "kv_heads", "head_dim"), cfg.init_std, dt)
        self.wo = Projection(rngs, (n, h), (d,), ("heads", "head_dim", "embed"), out_std, dt)
        # Qwen3: each head's queries and keys RMS-normalised (one scale of head_dim, shared by the heads)
        self.q_norm = Norm(cfg, execution, size=h, kind="rmsnorm") if cfg.attention.qk_norm else None
        self.k_norm = Norm(cfg, execution, size=h, kind="rmsnorm") if cfg.attention.qk_norm else None
        self._runs(cfg, execution, implementation)

    def __call__(self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array | None) -> jax.Array:
        q, k, v = self._project(x, positions)
        return self.wo(self._attend(q, k, v, positions, segment_ids))

    def _project(self, x: jax.Array, positions: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Queries, keys and values [b, t, heads, head_dim], rotated."""
        q, k, v = self.wq(x), self.wk(x), self.wv(x)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.cfg.position_embedding == "rope":
            inv_freq, scale = rope_frequencies(self.cfg), rope_attention_factor(self.cfg)
            q = apply_rope(q, positions, inv_freq, scale)
            k = apply_rope(k, positions, inv_freq, scale)
        return q, k, v

    def decode(self, x: jax.Array, positions: jax.Array,
               cache: dict[str, jax.Array]) -> tuple[jax.Array, dict[str, jax.Array]]:
        """The tokens ``x`` [b, t, d] at ``positions`` with the earlier ones' keys and values from ``cache`` ("k",
        "v": [b, S, kv_heads, head_dim]): -> (the output, the cache with these tokens' written in)."""
        q, k, v = self._project(x, positions)
        cache = {"k": write_cache(cache["k"], k, positions), "v": write_cache(cache["v"], v, positions)}
        return self.wo(cached_attention(q, cache["k"], cache["v"], positions)), cache

    def empty_cache(self, batch: int, length: int, dtype) -> dict[str, jax.Array]:
        shape = (batch, length, self.cfg.attention.num_kv_heads, self.cfg.resolved_head_dim)
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

    def __call__(self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array | None) -> jax.Array:
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

    def decode(self, x: jax.Array, positions: jax.Array,
               cache: dict[str, jax.Array]) -> tuple[jax.Array, dict[str, jax.Array]]:
        """As ``Attention.decode``, the cache compressed: each token's normed latent ("latent" [b, S, rank]) and
        rotated key part ("rope" [b, S, rope]); the keys and values of the cached tokens are expanded from them."""
        latent, k_rope = self._compressed(x, positions)
        cache = {"latent": write_cache(cache["latent"], latent, positions),
                 "rope": write_cache(cache["rope"], k_rope, positions)}
        k, v = self._keys_values(cache["latent"].astype(self.dtype), cache["rope"].astype(self.dtype))
        return self._output(cached_attention(self._queries(x, positions), k, v, positions)), cache

    def empty_cache(self, batch: int, length: int, dtype) -> dict[str, jax.Array]:
        a = self.cfg.attention
        return {"latent": jnp.zeros((batch, length, a.kv_lora_rank), dtype),
                "rope": jnp.zeros((batch, length, a.qk_rope_head_dim), dtype)}


def mla_softmax_factor(cfg: ModelConfig) -> float:
    """Latent attention's softmax scale over 1/sqrt(query size): YaRN's correction for ``rope_mscale_all_dim``,
    squared (DeepSeek-V3), else 1."""
    if cfg.rope.scaling != "yarn" or cfg.rope.factor == 1.0 or not cfg.rope.mscale_all_dim:
        return 1.0
    return yarn_mscale(cfg.rope.factor, cfg.rope.mscale_all_dim) ** 2
