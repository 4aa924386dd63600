"""Decoder-only transformer: embeddings, a scanned stack of blocks, final norm, logits."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxtron.config import ModelConfig
from jaxtron.models.attention import Attention
from jaxtron.models.layers import Norm, compute_dtype, embed_lookup, param
from jaxtron.models.mlp import MLP
from jaxtron.sharding import constrain

EMBED_AXES = ("activation_batch", "activation_length", "activation_embed")
LOGIT_AXES = ("activation_batch", "activation_length", "activation_vocab")

REMAT_POLICIES = {
    "full": jax.checkpoint_policies.nothing_saveable,
    # keep every weight matmul's output; recompute only elementwise ops and attention scores
    "save_dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


class Block(nnx.Module):
    """Pre-norm residual block: attention then MLP."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, attention_impl: str):
        self.attn_norm = Norm(cfg)
        self.attn = Attention(cfg, rngs, attention_impl)
        self.mlp_norm = Norm(cfg)
        self.mlp = MLP(cfg, rngs)

    def __call__(self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array | None) -> jax.Array:
        x = x + self.attn(self.attn_norm(x), positions, segment_ids)
        x = x + self.mlp(self.mlp_norm(x))
        return constrain(x, EMBED_AXES)


class Transformer(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, attention_impl: str = "xla"):
        self.cfg = cfg
        d, v = cfg.embed_dim, cfg.vocab_size
        self.embedding = param(rngs, (v, d), ("vocab", "embed"), cfg.init_std)
        self.positions = param(rngs, (cfg.max_seq_len, d), ("position", "embed"), cfg.init_std) \
            if cfg.position_embedding == "learned" else None

        @nnx.split_rngs(splits=cfg.num_layers)
        @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
        def make_layers(rngs: nnx.Rngs) -> Block:
            return Block(cfg, rngs, attention_impl)

        self.layers = make_layers(rngs)
        self.final_norm = Norm(cfg)
        self.head = None if cfg.tie_embeddings else param(rngs, (d, v), ("embed", "vocab"), cfg.init_std)

    def __call__(self, tokens: jax.Array, positions: jax.Array | None = None,
                 segment_ids: jax.Array | None = None) -> jax.Array:
        """tokens: int [batch, length] -> float32 logits [batch, length, vocab]."""
        dt = compute_dtype(self.cfg)
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
        x = embed_lookup(self.embedding[...], tokens, dt)
        if self.positions is not None:
            x = x + embed_lookup(self.positions[...], positions, dt, "position")
        x = constrain(x, EMBED_AXES)

        graphdef, stacked = nnx.split(self.layers)

        def body(h, layer_state):
            layer = nnx.merge(graphdef, layer_state)
            return layer(h, positions, segment_ids), None

        if self.cfg.remat != "none":
            body = jax.checkpoint(body, policy=REMAT_POLICIES[self.cfg.remat], prevent_cse=False)
        x, _ = jax.lax.scan(body, x, stacked)

        x = self.final_norm(x)
        head = self.embedding[...].T if self.head is None else self.head[...]
        # float32 straight out of the matmul: the loss needs it and no 16-bit copy is kept besides
        logits = jnp.einsum("btd,dv->btv", x, head.astype(dt), preferred_element_type=jnp.float32)
        return constrain(logits, LOGIT_AXES)
