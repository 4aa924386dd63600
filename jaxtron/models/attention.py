"""Self-attention with rotary positions: grouped-query (Llama, Qwen3) or multi-head latent (DeepSeek-V3)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from jaxtron.config.schema import ExecutionConfig, ModelConfig
from jaxtron.models.layers import (
    Norm,
    apply_rope,
    compute_dtype,
    param,
    rope_attention_factor,
    rope_frequencies,
    yarn_mscale,
)
from jaxtron.ops import attention as attention_ops
from jaxtron.ops import fp8 as fp8_ops


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


class Attention(_SelfAttention):
    def __init__(self, cfg: ModelConfig, execution: ExecutionConfig, rngs: nnx.Rngs, implementation: str):
        d, n, g, h = cfg.embed_dim, cfg.attention.num_heads, cfg.attention.num_kv_heads, cfg.resolved_head_dim
        out_std = cfg.init_std / math.sqrt(2 * cfg.num_layers)
        self.wq = param(rngs, (d, n, h), ("embed", "heads", "head_dim"), cfg.init_std)
        self.wk = param(rngs, (d, g, h), ("embed", "kv_heads", "head_dim"), cfg.init_std)
        self.wv = param(rngs, (d, g, h), ("embed", "kv_heads", "head_dim"), cfg.init_std)
        self.wo = param(rngs, (n, h, d), ("heads", "head_dim", "embed"), out_std)
        # Qwen3: each head's queries and keys RMS-normalised (one scale of head_dim, shared by the heads)
        self.q_norm = Norm(cfg, execution, size=h, kind="rmsnorm") if cfg.attention.qk_norm else None
        self.k_norm = Norm(cfg, execution, size=h, kind="rmsnorm") if cfg.attention.qk_norm else None
        self._runs(cfg, execution, implementation)

    def __call__(self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array | None,
                 fp8: bool = False) -> jax.Array:
        dt, einsum = self.dtype, fp8_ops.projection(fp8)
        q = einsum("btd,dnh->btnh", x, self.wq[...].astype(dt))
        k = einsum("btd,dnh->btnh", x, self.wk[...].astype(dt))
        v = einsum("btd,dnh->btnh", x, self.wv[...].astype(dt))
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.cfg.position_embedding == "rope":
            inv_freq, scale = rope_frequencies(self.cfg), rope_attention_factor(self.cfg)
            q = apply_rope(q, positions, inv_freq, scale)
            k = apply_rope(k, positions, inv_freq, scale)
        return einsum("btnh,nhd->btd", self._attend(q, k, v, positions, segment_ids), self.wo[...].astype(dt))


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
        qk, v = cfg.qk_head_dim, cfg.resolved_v_head_dim
        out_std = cfg.init_std / math.sqrt(2 * cfg.num_layers)
        if cfg.attention.q_lora_rank:
            self.wq_a = param(rngs, (d, cfg.attention.q_lora_rank), ("embed", "latent"), cfg.init_std)
            self.q_norm = Norm(cfg, execution, size=cfg.attention.q_lora_rank, kind="rmsnorm")
            self.wq_b = param(rngs, (cfg.attention.q_lora_rank, n, qk), ("latent", "heads", "head_dim"), cfg.init_std)
        else:
            self.wq = param(rngs, (d, n, qk), ("embed", "heads", "head_dim"), cfg.init_std)
        # the latent and the shared rotated key, from one matrix
        self.wkv_a = param(rngs, (d, cfg.attention.kv_lora_rank + rope), ("embed", "latent"), cfg.init_std)
        self.kv_norm = Norm(cfg, execution, size=cfg.attention.kv_lora_rank, kind="rmsnorm")
        self.wkv_b = param(rngs, (cfg.attention.kv_lora_rank, n, cfg.resolved_head_dim + v),
                           ("latent", "heads", "head_dim"), cfg.init_std)
        self.wo = param(rngs, (n, v, d), ("heads", "head_dim", "embed"), out_std)
        self._runs(cfg, execution, implementation)

    def __call__(self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array | None,
                 fp8: bool = False) -> jax.Array:
        cfg, dt, einsum = self.cfg, self.dtype, fp8_ops.projection(fp8)
        nope, v_dim, rank = cfg.resolved_head_dim, cfg.resolved_v_head_dim, cfg.attention.kv_lora_rank
        if cfg.attention.q_lora_rank:
            q = self.q_norm(einsum("btd,dr->btr", x, self.wq_a[...].astype(dt)))
            q = einsum("btr,rnh->btnh", q, self.wq_b[...].astype(dt))
        else:
            q = einsum("btd,dnh->btnh", x, self.wq[...].astype(dt))
        latent = einsum("btd,dr->btr", x, self.wkv_a[...].astype(dt))
        kv = einsum("btr,rnh->btnh", self.kv_norm(latent[..., :rank]), self.wkv_b[...].astype(dt))
        inv_freq, scale = rope_frequencies(cfg, cfg.attention.qk_rope_head_dim), rope_attention_factor(cfg)
        q_rope = apply_rope(q[..., nope:], positions, inv_freq, scale)
        k_rope = apply_rope(latent[:, :, None, rank:], positions, inv_freq, scale)
        k_rope = jnp.broadcast_to(k_rope, (*kv.shape[:3], cfg.attention.qk_rope_head_dim))
        softmax = mla_softmax_factor(cfg)
        q = jnp.concatenate([q[..., :nope], q_rope], axis=-1)
        if softmax != 1.0:
            q = q * jnp.asarray(softmax, q.dtype)
        k = jnp.concatenate([kv[..., :nope], k_rope], axis=-1)
        v = kv[..., nope:]
        if v_dim < cfg.qk_head_dim:
            v = jnp.pad(v, ((0, 0), (0, 0), (0, 0), (0, cfg.qk_head_dim - v_dim)))
        out = self._attend(q, k, v, positions, segment_ids)
        return einsum("btnh,nhd->btd", out[..., :v_dim], self.wo[...].astype(dt))


def mla_softmax_factor(cfg: ModelConfig) -> float:
    """Latent attention's softmax scale over 1/sqrt(query size): YaRN's correction for ``rope_mscale_all_dim``,
    squared (DeepSeek-V3), else 1."""
    if cfg.rope.scaling != "yarn" or cfg.rope.factor == 1.0 or not cfg.rope.mscale_all_dim:
        return 1.0
    return yarn_mscale(cfg.rope.factor, cfg.rope.mscale_all_dim) ** 2
