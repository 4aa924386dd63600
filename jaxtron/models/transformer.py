"""Decoder-only transformer: embeddings, a scanned stack of blocks, final norm, logits."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxtron.config import ModelConfig
from jaxtron.models.attention import Attention
from jaxtron.models.layers import Norm, compute_dtype, embed_lookup, param
from jaxtron.models.mlp import MLP
from jaxtron.ops import attention as attention_ops
from jaxtron.sharding import constrain

EMBED_AXES = ("activation_batch", "activation_length", "activation_embed")
LOGIT_AXES = ("activation_batch", "activation_length", "activation_vocab")


def _attention_saveable(prim, *_, **__) -> bool:
    """The outputs of the attention kernel: the output and, for cuDNN's flash kernel, its softmax statistics
    (both needed by the backward kernel; saving only the output would rerun the forward kernel)."""
    return prim.name.startswith("dot_product_attention_fwd")


_save_attention = jax.checkpoint_policies.save_from_both_policies(
    jax.checkpoint_policies.save_only_these_names(attention_ops.OUTPUT_NAME), _attention_saveable)

REMAT_POLICIES = {
    "full": jax.checkpoint_policies.nothing_saveable,
    # keep every weight matmul's output; recompute only elementwise ops and attention scores
    "save_dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    # keep the attention output, so a flash-attention kernel runs once forward and once backward
    "save_attention": _save_attention,
    "save_dots_attention": jax.checkpoint_policies.save_from_both_policies(
        jax.checkpoint_policies.dots_with_no_batch_dims_saveable, _save_attention),
}


def layer_groups(cfg: ModelConfig) -> list[tuple[int, int, bool]]:
    """(first, end, fp8) of each run of blocks scanned together: with model.fp8_skip_layers, the first and
    last blocks keep 16-bit matmuls and the ones between use FP8."""
    n, skip = cfg.num_layers, cfg.fp8_skip_layers if cfg.fp8 else 0
    if not skip:
        return [(0, n, cfg.fp8)]
    return [(0, skip, False), (skip, n - skip, True), (n - skip, n, False)]


class Block(nnx.Module):
    """Pre-norm residual block: attention then MLP."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, attention_impl: str):
        self.attn_norm = Norm(cfg)
        self.attn = Attention(cfg, rngs, attention_impl)
        self.mlp_norm = Norm(cfg)
        self.mlp = MLP(cfg, rngs)

    def __call__(self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array | None,
                 fp8: bool = False) -> jax.Array:
        x = x + self.attn(self.attn_norm(x), positions, segment_ids, fp8)
        x = x + self.mlp(self.mlp_norm(x), fp8)
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
        return logits_of(self.hidden(tokens, positions, segment_ids), self.output_head())

    def hidden(self, tokens: jax.Array, positions: jax.Array | None = None,
               segment_ids: jax.Array | None = None) -> jax.Array:
        """tokens: int [batch, length] -> the final normed hidden states [batch, length, embed]."""
        dt = compute_dtype(self.cfg)
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
        x = embed_lookup(self.embedding[...], tokens, dt)
        if self.positions is not None:
            x = x + embed_lookup(self.positions[...], positions, dt, "position")
        x = constrain(x, EMBED_AXES)

        graphdef, stacked = nnx.split(self.layers)
        for start, stop, fp8 in layer_groups(self.cfg):
            def body(h, layer_state, fp8=fp8):
                layer = nnx.merge(graphdef, layer_state)
                return layer(h, positions, segment_ids, fp8), None

            if self.cfg.remat != "none":
                body = jax.checkpoint(body, policy=REMAT_POLICIES[self.cfg.remat], prevent_cse=False)
            group = stacked if (start, stop) == (0, self.cfg.num_layers) else \
                jax.tree.map(lambda a, start=start, stop=stop: a[start:stop], stacked)
            x, _ = jax.lax.scan(body, x, group)
        return self.final_norm(x)

    def output_head(self) -> jax.Array:
        """The [embed, vocab] output matrix in the compute dtype (the embedding's transpose when tied)."""
        head = self.embedding[...].T if self.head is None else self.head[...]
        return head.astype(compute_dtype(self.cfg))


def logits_of(x: jax.Array, head: jax.Array) -> jax.Array:
    """[batch, length, embed] x [embed, vocab] -> float32 logits, straight out of the matmul (the loss needs
    float32 and no 16-bit copy is kept besides)."""
    logits = jnp.einsum("btd,dv->btv", x, head, preferred_element_type=jnp.float32)
    return constrain(logits, LOGIT_AXES)
