"""Grouped-query self-attention with rotary positions."""

from __future__ import annotations

import math

import jax
from flax import nnx

from jaxtron.config.schema import ExecutionConfig, ModelConfig
from jaxtron.models.layers import Norm, apply_rope, compute_dtype, param, rope_frequencies
from jaxtron.ops import attention as attention_ops
from jaxtron.ops import fp8 as fp8_ops


class Attention(nnx.Module):
    def __init__(self, cfg: ModelConfig, run: ExecutionConfig, rngs: nnx.Rngs, implementation: str):
        d, n, g, h = cfg.embed_dim, cfg.num_heads, cfg.num_kv_heads, cfg.resolved_head_dim
        out_std = cfg.init_std / math.sqrt(2 * cfg.num_layers)
        self.wq = param(rngs, (d, n, h), ("embed", "heads", "head_dim"), cfg.init_std)
        self.wk = param(rngs, (d, g, h), ("embed", "kv_heads", "head_dim"), cfg.init_std)
        self.wv = param(rngs, (d, g, h), ("embed", "kv_heads", "head_dim"), cfg.init_std)
        self.wo = param(rngs, (n, h, d), ("heads", "head_dim", "embed"), out_std)
        # Qwen3: each head's queries and keys RMS-normalised (one scale of head_dim, shared by the heads)
        self.q_norm = Norm(cfg, run, size=h, kind="rmsnorm") if cfg.qk_norm else None
        self.k_norm = Norm(cfg, run, size=h, kind="rmsnorm") if cfg.qk_norm else None
        self.cfg = cfg
        self.dtype = compute_dtype(run)
        self.max_segments = run.attention_max_segments
        self.implementation = implementation

    def __call__(self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array | None,
                 fp8: bool = False) -> jax.Array:
        dt, einsum = self.dtype, fp8_ops.projection(fp8)
        q = einsum("btd,dnh->btnh", x, self.wq[...].astype(dt))
        k = einsum("btd,dnh->btnh", x, self.wk[...].astype(dt))
        v = einsum("btd,dnh->btnh", x, self.wv[...].astype(dt))
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.cfg.position_embedding == "rope":
            inv_freq = rope_frequencies(self.cfg)
            q = apply_rope(q, positions, inv_freq)
            k = apply_rope(k, positions, inv_freq)
        out = attention_ops.dot_product_attention(q, k, v, implementation=self.implementation,
                                                  segment_ids=segment_ids, positions=positions,
                                                  max_segments=self.max_segments)
        return einsum("btnh,nhd->btd", out, self.wo[...].astype(dt))
