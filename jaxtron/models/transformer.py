"""Decoder-only transformer: embeddings, the layer stack (``models/stack.py``), final norm, output head.

``Transformer.__call__`` is the one forward: tokens in, a ``ModelOutput`` out (final hidden states, the output
head, the MoE routing stats and, when asked, the multi-token-prediction hidden states). Logits are computed from
it, whole (``ModelOutput.logits``) or by slices in the loss (``jaxtron.training.loss``, with ``ops/cross_entropy.py``).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from jaxtron.config.model import STACKS
from jaxtron.config.schema import ExecutionConfig, ModelConfig
from jaxtron.models import tensor_chunks
from jaxtron.models.attention import Attention, LatentAttention
from jaxtron.models.delta_net import GatedDeltaNet
from jaxtron.models.layers import Norm, compute_dtype, embed_lookup, param
from jaxtron.models.mlp import MLP
from jaxtron.models.moe import MoE
from jaxtron.models.projection import Projection, fp8_enabled
from jaxtron.models.stack import Cache, StackRunner, Stats, decode_stack, run_stack, stacked
from jaxtron.ops.cross_entropy import logits_of
from jaxtron.parallel.sharding import constrain
from jaxtron.parallel.state_sharding import gathered_cotangent

# the residual stream: split along the sequence over the sequence and tensor axes (sequence parallelism)
EMBED_AXES = ("activation_batch", "activation_residual_length", "activation_embed")
# the normed input of attention and of the MLP: whole over the tensor group (gathered there, as Megatron does)
BLOCK_INPUT_AXES = ("activation_batch", "activation_length", "activation_embed")


def block_input(norm: nnx.Module, x: jax.Array) -> jax.Array:
    """The normed input of attention or the MLP: cast to the compute dtype while split like the residual stream,
    then gathered over the tensor group (sequence parallelism). Left to XLA, the backward pass's recomputation had
    gathered one of a block's two in float32 and cast it after: twice the bytes."""
    return constrain(constrain(norm(x), EMBED_AXES), BLOCK_INPUT_AXES)


class Block(nnx.Module):
    """Pre-norm residual block: attention (or Gated DeltaNet), then the feed-forward part (a dense MLP or a
    mixture of experts; both return their output and their routing stats, empty for the MLP). With
    ``model.post_norms`` each part's output is normed again before its residual sum (Gemma 2 and 3)."""

    def __init__(self, cfg: ModelConfig, execution: ExecutionConfig, rngs: nnx.Rngs, attention_impl: str,
                 moe: bool = False, linear: bool = False):
        self.attn_norm = Norm(cfg, execution)
        if linear:  # a Gated DeltaNet block (model.linear): the token mixer is linear attention
            self.attn = GatedDeltaNet(cfg, execution, rngs)
        else:
            self.attn = (LatentAttention if cfg.latent_attention else Attention)(cfg, execution, rngs, attention_impl)
        self.attn_post_norm = Norm(cfg, execution) if cfg.post_norms else None
        self.mlp_norm = Norm(cfg, execution)
        self.mlp = MoE(cfg, execution, rngs) if moe else MLP(cfg, execution, rngs)
        self.mlp_post_norm = Norm(cfg, execution) if cfg.post_norms else None
        self.tensor_chunks = execution.tensor_chunks

    def __call__(self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array | None,
                 local: bool = False) -> tuple[jax.Array, Stats]:
        """-> (output, routing stats of an MoE block, empty for a dense one). ``local``: the block's attention sees
        only its window (``model.attention.window``)."""
        # FP8's scales and LoRA's dropout masks are drawn over all of the rows: those blocks run them whole
        whole = fp8_enabled() or any(getattr(node, "lora_dropout", 0.0) for _, node in nnx.iter_graph(self))
        chunks = tensor_chunks.usable(self.tensor_chunks, x.shape[1], whole_rows=whole)
        if chunks > 1 and isinstance(self.attn, Attention):
            x = constrain(x + self._chunked_attention(x, positions, segment_ids, local, chunks), EMBED_AXES)
        else:
            a = self.attn(block_input(self.attn_norm, x), positions, segment_ids, local)
            x = constrain(x + gathered_cotangent(_post(self.attn_post_norm, a), BLOCK_INPUT_AXES), EMBED_AXES)
        if chunks > 1 and isinstance(self.mlp, MLP):
            return constrain(x + tensor_chunks.over_chunks(self._mlp_chunk, chunks, x), EMBED_AXES), {}
        y, stats = self.mlp(block_input(self.mlp_norm, x))
        return constrain(x + gathered_cotangent(_post(self.mlp_post_norm, y), BLOCK_INPUT_AXES), EMBED_AXES), stats

    def _mlp_chunk(self, x: jax.Array) -> jax.Array:
        """The feed-forward part of one chunk of rows held as the residual stream, its output split as that is."""
        return _scattered(self.mlp_post_norm, self.mlp(block_input(self.mlp_norm, x))[0])

    def _chunked_attention(self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array | None, local: bool,
                           chunks: int) -> jax.Array:
        """The attention part with its projections run in ``chunks`` of the rows (``models/tensor_chunks.py``):
        each chunk's gather and reduce-scatter beside another chunk's GEMMs; the attention itself whole."""
        normed = constrain(self.attn_norm(x), EMBED_AXES)  # cast while split, as block_input does
        q, k, v = tensor_chunks.over_chunks(
            lambda rows, where: self.attn.project(constrain(rows, BLOCK_INPUT_AXES), where, local), chunks,
            normed, positions)
        out = self.attn.attend(q, k, v, positions, segment_ids, local)
        return tensor_chunks.over_chunks(
            lambda rows, heads: _scattered(self.attn_post_norm, self.attn.output(constrain(rows, BLOCK_INPUT_AXES),
                                                                                  heads)), chunks, normed, out)

    def decode(self, x: jax.Array, positions: jax.Array, cache: dict[str, jax.Array],
               local: bool = False) -> tuple[jax.Array, dict[str, jax.Array]]:
        """The block on tokens ``x`` at ``positions``, its attention over the earlier tokens in ``cache``: -> (the
        output, the cache with these tokens in)."""
        a, cache = self.attn.decode(self.attn_norm(x), positions, cache, local)
        x = x + _post(self.attn_post_norm, a)
        y, _ = self.mlp(self.mlp_norm(x))
        return x + _post(self.mlp_post_norm, y), cache


def _post(norm: nnx.Module | None, y: jax.Array) -> jax.Array:
    """A part's output, normed again with ``model.post_norms``."""
    return y if norm is None else norm(y)


def _scattered(post_norm: nnx.Module | None, out: jax.Array) -> jax.Array:
    """A part's output (post-normed, with ``model.post_norms``) split as the residual stream: reduce-scattered
    over the tensor group, its cotangent gathered once for both transposed matmuls."""
    return constrain(gathered_cotangent(_post(post_norm, out), BLOCK_INPUT_AXES), EMBED_AXES)


class MTPModule(nnx.Module):
    """One depth of multi-token prediction (DeepSeek-V3): the previous depth's hidden states and the embedding of
    the token k ahead, each RMS-normed, concatenated (embedding first) and projected back to the width, then one
    block (MoE in an MoE model) and a final norm; the output head is the model's."""

    def __init__(self, cfg: ModelConfig, execution: ExecutionConfig, rngs: nnx.Rngs, attention_impl: str):
        d = cfg.embed_dim
        self.embed_norm = Norm(cfg, execution)
        self.hidden_norm = Norm(cfg, execution)
        self.proj = Projection(rngs, (2 * d,), (d,), (None, "embed"), cfg.init_std, execution.dtype)
        self.block = Block(cfg, execution, rngs, attention_impl, moe=cfg.moe.num_experts > 0)
        self.norm = Norm(cfg, execution)

    def __call__(self, h: jax.Array, embedded: jax.Array, positions: jax.Array,
                 segment_ids: jax.Array | None) -> tuple[jax.Array, jax.Array, Stats]:
        """-> (this depth's hidden states, the same normed for the head, routing stats)."""
        x = jnp.concatenate([self.embed_norm(embedded), self.hidden_norm(h)], axis=-1)
        x = constrain(self.proj(x), EMBED_AXES)
        x, stats = self.block(x, positions, segment_ids)
        return x, self.norm(x), stats


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ModelOutput:
    """What the forward gives: the final normed hidden states [batch, length, embed], the [embed, vocab] output
    head in the compute dtype, the MoE routing stats (each stacked over the MoE blocks, those of the prediction
    modules last; empty for a dense model) and, when asked for, the normed hidden states of each multi-token
    prediction depth k = 1.. (position i predicts token i + k + 1)."""

    hidden: jax.Array
    head: jax.Array
    stats: Stats
    mtp_hidden: tuple[jax.Array, ...] = ()

    def logits(self) -> jax.Array:
        """float32 logits [batch, length, vocab] of the whole sequence."""
        return logits_of(self.hidden, self.head)


class Transformer(nnx.Module):
    def __init__(self, cfg: ModelConfig, execution: ExecutionConfig, rngs: nnx.Rngs, attention_impl: str = "xla"):
        self.cfg, self.execution = cfg, execution
        d, v = cfg.embed_dim, cfg.vocab_size
        self.embedding = param(rngs, (v, d), ("vocab", "embed"), cfg.init_std)
        self.positions = param(rngs, (cfg.max_seq_len, d), ("position", "embed"), cfg.init_std) \
            if cfg.position_embedding == "learned" else None

        def block(moe: bool, linear: bool = False):
            return lambda rngs: Block(cfg, execution, rngs, attention_impl, moe, linear)

        # each kind of block in its stack (config.model.STACKS: dense, MoE, and both with Gated DeltaNet), in block
        # order; a dense prefix (which needs moe_every=1) is all of `layers`, run outside a pipeline schedule; a
        # dense model's blocks before its periods (ModelConfig.prefix_layers) are `lead_layers`, run outside it too
        lead = cfg.prefix_layers if cfg.lead_stack else 0
        self.lead_layers = stacked(block(False), rngs, lead, "unstaged_layers")
        self.layers = stacked(block(False), rngs, cfg.stack_blocks(0),
                              "unstaged_layers" if cfg.prefix_layers and not lead else "layers")
        self.moe_layers = stacked(block(True), rngs, cfg.stack_blocks(1), "layers")
        self.linear_layers = stacked(block(False, True), rngs, cfg.stack_blocks(2), "layers")
        self.linear_moe_layers = stacked(block(True, True), rngs, cfg.stack_blocks(3), "layers")
        self.final_norm = Norm(cfg, execution)
        self.mtp = stacked(lambda rngs: MTPModule(cfg, execution, rngs, attention_impl), rngs, cfg.mtp.depth,
                           "unstaged_layers")
        self.head = None if cfg.tie_embeddings else param(rngs, (d, v), ("embed", "vocab"), cfg.init_std)

    def __call__(self, tokens: jax.Array, positions: jax.Array | None = None, segment_ids: jax.Array | None = None,
                 *, stack_runner: StackRunner | None = None, mtp: bool = False) -> ModelOutput:
        """tokens: int [batch, length]; ``positions`` (default 0..length-1) and ``segment_ids`` (packed documents)
        [batch, length]. ``stack_runner`` runs the layer stack (a pipeline schedule; default: a scan). ``mtp``:
        also run the multi-token prediction modules (training only)."""
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
        x = self._embed(tokens, positions)
        extras = (positions, segment_ids) if segment_ids is not None else (positions,)
        residual, stats = run_stack(self.cfg, self.execution, self.stacks(), constrain(x, EMBED_AXES), extras,
                                    stack_runner, self.lead_layers)
        mtp_hidden = ()
        if mtp and self.mtp is not None:
            mtp_hidden, mtp_stats = self._predict_ahead(residual, tokens, positions, segment_ids)
            stats = {k: jnp.concatenate([stats[k], mtp_stats[k]]) for k in stats}
        return ModelOutput(self.final_norm(residual), self.output_head(), stats, mtp_hidden)

    def decode(self, tokens: jax.Array, positions: jax.Array, cache: Cache,
               last: jax.Array | None = None) -> tuple[jax.Array, Cache]:
        """Generation's forward: tokens [batch, t] at ``positions`` [batch, t] (each row's own), every block's
        attention over the earlier tokens of ``cache`` (``empty_cache``) -> (float32 logits [batch, t, vocab], the
        cache with these tokens in). A prompt's prefill and each decoding step are calls of this; the logits equal
        the full forward's at the same positions. With ``last`` [batch], a prefill's logits are each row's at
        column ``last`` alone, [batch, 1, vocab]: the head skips the rest of the prompt (for 16 prompts of 512
        tokens and Llama-3's vocabulary, 4.2 GB of float32 logits)."""
        x, cache = decode_stack(self.cfg, self.execution, self.stacks(), self._embed(tokens, positions), positions,
                                cache, self.lead_layers)
        if last is not None:
            x = jnp.take_along_axis(x, last[:, None, None], axis=1)
        return logits_of(self.final_norm(x), self.output_head()), cache

    def stacks(self) -> tuple[nnx.Module | None, ...]:
        """The stacked blocks of each kind, in ``STACKS``' order (None for a kind the model lacks)."""
        return tuple(getattr(self, name) for name in STACKS)

    def _embed(self, tokens: jax.Array, positions: jax.Array) -> jax.Array:
        """The tokens' embeddings in the compute dtype: scaled by sqrt(embed_dim) with ``model.embed_scale``
        (Gemma, which rounds the factor to the compute dtype first), plus learned positions."""
        dtype = compute_dtype(self.execution)
        x = embed_lookup(self.embedding[...], tokens, dtype)
        if self.cfg.embed_scale:
            x = x * jnp.asarray(self.cfg.embed_dim ** 0.5, dtype)
        if self.positions is not None:
            x = x + embed_lookup(self.positions[...], positions, dtype, "position")
        return x

    def empty_cache(self, batch: int, length: int, dtype=jnp.bfloat16) -> Cache:
        """Zero caches for ``batch`` rows of up to ``length`` positions, laid out as ``models.stack.Cache`` says
        (the shapes come from the config: any block's attention makes them)."""
        cfg = self.cfg
        # one block of each stack makes the caches of its kind (their shapes come from the config)
        mixers = [None if stack is None else stack.attn for stack in self.stacks()]
        if self.lead_layers is not None:
            mixers[0] = mixers[0] or self.lead_layers.attn

        def stacked_cache(count: int, kind):
            one = mixers[kind.stack].empty_cache(batch, length, dtype, kind.local)
            return jax.tree.map(lambda a: jnp.repeat(a[None], count, axis=0), one)

        cache = {"period": tuple(stacked_cache(cfg.stack_periods, kind) for kind in cfg.period_blocks())}
        if cfg.prefix_layers:
            cache["prefix"] = stacked_cache(cfg.prefix_layers, cfg.block_kind(0))
        return cache

    def _predict_ahead(self, residual: jax.Array, tokens: jax.Array, positions: jax.Array,
                       segment_ids: jax.Array | None) -> tuple[tuple[jax.Array, ...], Stats]:
        """Multi-token prediction from the stack's output ``residual`` (before the final norm): the normed hidden
        states of each depth k = 1..mtp_depth, whose position i predicts token i + k + 1 (the row rolled by k; the
        loss masks what wrapped around or crossed a document), and the routing stats of the modules' blocks
        stacked [depths, ...]."""
        graphdef, stack = nnx.split(self.mtp)
        outputs, stats, h = [], [], residual
        for k in range(1, self.cfg.mtp.depth + 1):
            module = nnx.merge(graphdef, jax.tree.map(lambda a, k=k: a[k - 1], stack))
            ahead = embed_lookup(self.embedding[...], jnp.roll(tokens, -k, axis=1), compute_dtype(self.execution))
            h, normed, block_stats = module(h, ahead, positions, segment_ids)
            outputs.append(normed)
            stats.append(block_stats)
        return tuple(outputs), ({key: jnp.stack([s[key] for s in stats]) for key in stats[0]} if stats[0] else {})

    def output_head(self) -> jax.Array:
        """The [embed, vocab] output matrix in the compute dtype (the embedding's transpose when tied)."""
        head = self.embedding[...].T if self.head is None else self.head[...]
        return head.astype(compute_dtype(self.execution))


def mtp_valid(weights: jax.Array, segments: jax.Array | None, k: int) -> jax.Array:
    """Which positions of [batch, length] rows the multi-token prediction depth ``k`` scores: the token k ahead
    must be in the row (not wrapped around), of the same document, and weighted like the position itself."""
    valid = weights * jnp.roll(weights, -k, axis=1) * (jnp.arange(weights.shape[1]) < weights.shape[1] - k)
    if segments is not None:
        valid = valid * (jnp.roll(segments, -k, axis=1) == segments)
    return valid
