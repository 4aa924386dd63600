"""Decoder-only transformer: embeddings, a scanned stack of blocks, final norm, logits."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxtron.config.schema import ExecutionConfig, ModelConfig
from jaxtron.models.attention import Attention, LatentAttention
from jaxtron.models.layers import Norm, compute_dtype, embed_lookup, param
from jaxtron.models.mlp import MLP
from jaxtron.models.moe import MoE
from jaxtron.ops import attention as attention_ops
from jaxtron.ops import cudnn as cudnn_ops
from jaxtron.parallel.sharding import constrain

# the residual stream: split along the sequence over the sequence and tensor axes (sequence parallelism)
EMBED_AXES = ("activation_batch", "activation_residual_length", "activation_embed")
# the normed input of attention and of the MLP: whole over the tensor group (gathered there, as Megatron does)
BLOCK_INPUT_AXES = ("activation_batch", "activation_length", "activation_embed")
LOGIT_AXES = ("activation_batch", "activation_length", "activation_vocab")


def _attention_saveable(prim, *_, **__) -> bool:
    """The outputs of the attention kernel: the output and, for cuDNN's flash kernel, its softmax statistics
    (both needed by the backward kernel; saving only the output would rerun the forward kernel)."""
    return cudnn_ops.is_forward(prim)


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


StackRunner = Callable[[Callable, jax.Array, Any, tuple], tuple[jax.Array, dict[str, jax.Array]]]


def scan_stack(body: Callable, x: jax.Array, stack: Any, extras: tuple) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The stack runner without a pipeline: one scan over the periods in order; stats stacked [periods, ...]."""
    return jax.lax.scan(lambda h, period: body(h, period, extras), x, stack)


def layer_groups(cfg: ModelConfig, run: ExecutionConfig) -> list[tuple[int, int, bool]]:
    """(first, end, fp8) of each run of blocks scanned together: with execution.fp8_skip_layers, the first and
    last blocks keep 16-bit matmuls and the ones between use FP8 (expert GEMMs stay 16-bit). The
    ``first_dense_layers`` (all dense, before the MoE ones) are a run of their own."""
    n, skip = cfg.num_layers, run.fp8_skip_layers if run.fp8 else 0
    cuts = sorted({0, n, cfg.prefix_layers, skip, n - skip})
    return [(a, b, run.fp8 and skip <= a < n - skip) for a, b in zip(cuts, cuts[1:])]


class Block(nnx.Module):
    """Pre-norm residual block: attention then a dense MLP or a mixture of experts."""

    def __init__(self, cfg: ModelConfig, run: ExecutionConfig, rngs: nnx.Rngs, attention_impl: str,
                 moe: bool = False):
        self.attn_norm = Norm(cfg, run)
        self.attn = (LatentAttention if cfg.latent_attention else Attention)(cfg, run, rngs, attention_impl)
        self.mlp_norm = Norm(cfg, run)
        self.mlp = MoE(cfg, run, rngs) if moe else MLP(cfg, run, rngs)

    def __call__(self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array | None,
                 fp8: bool = False) -> tuple[jax.Array, dict[str, jax.Array]]:
        """-> (output, routing stats of the MoE block, empty for a dense one)."""
        h = constrain(self.attn_norm(x), BLOCK_INPUT_AXES)
        x = constrain(x + self.attn(h, positions, segment_ids, fp8), EMBED_AXES)
        h = constrain(self.mlp_norm(x), BLOCK_INPUT_AXES)
        stats = {}
        if isinstance(self.mlp, MoE):
            y, stats = self.mlp(h, fp8)
        else:
            y = self.mlp(h, fp8)
        return constrain(x + y, EMBED_AXES), stats


class MTPModule(nnx.Module):
    """One depth of multi-token prediction (DeepSeek-V3): the previous depth's hidden states and the embedding of
    the token k ahead, each RMS-normed, concatenated (embedding first) and projected back to the width, then one
    block (MoE in an MoE model) and a final norm; the output head is the model's."""

    def __init__(self, cfg: ModelConfig, run: ExecutionConfig, rngs: nnx.Rngs, attention_impl: str):
        d = cfg.embed_dim
        self.embed_norm = Norm(cfg, run)
        self.hidden_norm = Norm(cfg, run)
        self.proj = param(rngs, (2 * d, d), (None, "embed"), cfg.init_std)
        self.block = Block(cfg, run, rngs, attention_impl, moe=cfg.num_experts > 0)
        self.norm = Norm(cfg, run)
        self.dtype = compute_dtype(run)

    def __call__(self, h: jax.Array, embedded: jax.Array, positions: jax.Array,
                 segment_ids: jax.Array | None) -> tuple[jax.Array, jax.Array, dict[str, jax.Array]]:
        """-> (this depth's hidden states, the same normed for the head, routing stats)."""
        x = jnp.concatenate([self.embed_norm(embedded), self.hidden_norm(h)], axis=-1)
        x = constrain(jnp.einsum("btc,cd->btd", x, self.proj[...].astype(self.dtype)), EMBED_AXES)
        x, stats = self.block(x, positions, segment_ids)
        return x, self.norm(x), stats


def _stack(cfg: ModelConfig, run: ExecutionConfig, rngs: nnx.Rngs, attention_impl: str, count: int,
           moe: bool, module: type = Block, axis: str = "layers") -> nnx.Module | None:
    """``count`` blocks (or MTP modules) with parameters stacked along the logical axis ``axis`` (None for
    zero): ``layers`` for the periods a pipeline schedule runs, ``unstaged_layers`` for those it does not."""
    if not count:
        return None

    @nnx.split_rngs(splits=count)
    @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: axis})
    def make(rngs: nnx.Rngs) -> nnx.Module:
        return Block(cfg, run, rngs, attention_impl, moe) if module is Block else module(cfg, run, rngs,
                                                                                        attention_impl)

    return make(rngs)


class Transformer(nnx.Module):
    def __init__(self, cfg: ModelConfig, run: ExecutionConfig, rngs: nnx.Rngs, attention_impl: str = "xla"):
        self.cfg, self.run = cfg, run
        d, v = cfg.embed_dim, cfg.vocab_size
        self.embedding = param(rngs, (v, d), ("vocab", "embed"), cfg.init_std)
        self.positions = param(rngs, (cfg.max_seq_len, d), ("position", "embed"), cfg.init_std) \
            if cfg.position_embedding == "learned" else None
        # dense blocks in `layers`, MoE blocks in `moe_layers`, each in block order (see ModelConfig.is_moe_block);
        # a dense prefix (which needs moe_every=1) is all of `layers`, run outside a pipeline schedule
        moe = cfg.num_moe_layers
        self.layers = _stack(cfg, run, rngs, attention_impl, cfg.num_layers - moe, False,
                             axis="unstaged_layers" if cfg.prefix_layers else "layers")
        self.moe_layers = _stack(cfg, run, rngs, attention_impl, moe, True)
        self.final_norm = Norm(cfg, run)
        self.mtp = _stack(cfg, run, rngs, attention_impl, cfg.mtp_depth, False, MTPModule, "unstaged_layers")
        self.head = None if cfg.tie_embeddings else param(rngs, (d, v), ("embed", "vocab"), cfg.init_std)

    def __call__(self, tokens: jax.Array, positions: jax.Array | None = None,
                 segment_ids: jax.Array | None = None) -> jax.Array:
        """tokens: int [batch, length] -> float32 logits [batch, length, vocab]."""
        return logits_of(self.hidden(tokens, positions, segment_ids), self.output_head())

    def hidden(self, tokens: jax.Array, positions: jax.Array | None = None,
               segment_ids: jax.Array | None = None, stack_runner: StackRunner | None = None) -> jax.Array:
        """tokens: int [batch, length] -> the final normed hidden states [batch, length, embed]."""
        return self.hidden_and_stats(tokens, positions, segment_ids, stack_runner)[0]

    def hidden_and_stats(self, tokens: jax.Array, positions: jax.Array | None = None,
                         segment_ids: jax.Array | None = None,
                         stack_runner: StackRunner | None = None) -> tuple[jax.Array, dict[str, jax.Array]]:
        """The final normed hidden states and the routing stats (see ``residual_and_stats``)."""
        x, stats = self.residual_and_stats(tokens, positions, segment_ids, stack_runner)
        return self.final_norm(x), stats

    def mtp_hidden(self, residual: jax.Array, tokens: jax.Array, positions: jax.Array | None = None,
                   segment_ids: jax.Array | None = None) -> tuple[list[jax.Array], dict[str, jax.Array]]:
        """Multi-token prediction from the stack's output ``residual`` (before the final norm): the normed hidden
        states of each depth k = 1..mtp_depth, whose position i predicts token i + k + 1 (the
        row rolled by k; the caller masks what wrapped around or crossed a document), and the routing stats of
        the modules' blocks stacked [depths, ...]."""
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
        graphdef, stack = nnx.split(self.mtp)
        outputs, stats, h = [], [], residual
        for k in range(1, self.cfg.mtp_depth + 1):
            module = nnx.merge(graphdef, jax.tree.map(lambda a, k=k: a[k - 1], stack))
            ahead = embed_lookup(self.embedding[...], jnp.roll(tokens, -k, axis=1), compute_dtype(self.run))
            h, normed, block_stats = module(h, ahead, positions, segment_ids)
            outputs.append(normed)
            stats.append(block_stats)
        return outputs, ({key: jnp.stack([s[key] for s in stats]) for key in stats[0]} if stats[0] else {})

    def residual_and_stats(self, tokens: jax.Array, positions: jax.Array | None = None,
                           segment_ids: jax.Array | None = None,
                           stack_runner: StackRunner | None = None) -> tuple[jax.Array, dict[str, jax.Array]]:
        """The stack's output (before the final norm) and the routing stats of the MoE blocks, each stacked along
        its first axis (empty for a dense model; see ``jaxtron.models.moe.route``).

        ``stack_runner(body, x, stack, extras)`` runs the scanned stack: ``body(x, period, extras)`` applies one
        period (``moe_every`` blocks of an MoE model, else one block) given that period's slice of ``stack``;
        ``extras`` are the positions and segment ids, each with the batch as its first axis. The default scans
        the periods in order; a pipeline schedule runs them on its stages instead (either gives stats [MoE
        blocks, ...]). A dense prefix runs before, as a plain scan."""
        cfg = self.cfg
        dt = compute_dtype(self.run)
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
        x = embed_lookup(self.embedding[...], tokens, dt)
        if self.positions is not None:
            x = x + embed_lookup(self.positions[...], positions, dt, "position")
        x = constrain(x, EMBED_AXES)

        # The scan runs periods of `moe_every` blocks (one block for a dense model): the dense ones, then MoE;
        # the first_dense_layers (dense, before any MoE block) run as a plain scan of their own.
        period, prefix = cfg.period, cfg.prefix_layers
        dense_per_period = period - 1 if cfg.num_experts else 1
        dense_def, dense = nnx.split(self.layers) if self.layers is not None else (None, None)
        moe_def, moe = nnx.split(self.moe_layers) if self.moe_layers is not None else (None, None)
        runner = stack_runner or scan_stack
        extras = (positions, segment_ids) if segment_ids is not None else (positions,)
        stats = []
        for start, stop, fp8 in layer_groups(cfg, self.run):
            run_dense, run_moe = (self._runner(g, fp8) for g in (dense_def, moe_def))
            if stop <= prefix:
                blocks = jax.tree.map(lambda a, start=start, stop=stop: a[start:stop], dense)
                x, _ = scan_stack(lambda h, block, ex: run_dense(h, block, *ex), x, blocks, extras)
                continue
            first, end = (start - prefix) // period, (stop - prefix) // period

            def body(h, xs, extras):
                dense_part, moe_part = xs
                if dense_per_period == 1 and dense_part is not None:
                    h, _ = run_dense(h, dense_part, *extras)
                elif dense_part is not None:
                    for j in range(dense_per_period):
                        h, _ = run_dense(h, jax.tree.map(lambda a, j=j: a[j], dense_part), *extras)
                return (h, {}) if moe_part is None else run_moe(h, moe_part, *extras)

            def periods(tree, per):
                """The blocks of periods first..end-1 of the periods after the prefix: [periods, per, ...]
                (per > 1) or [periods, ...]."""
                if tree is None or not per:
                    return None
                if per == 1:
                    # all the periods: the stack as stored (a pipeline's may hold identity periods after them)
                    whole = (first, end) == (0, cfg.stack_periods)
                    return tree if whole else jax.tree.map(lambda a: a[first:end], tree)
                return jax.tree.map(lambda a: a[first * per:end * per].reshape(end - first, per, *a.shape[1:]), tree)

            x, group_stats = runner(body, x, (periods(dense, dense_per_period), periods(moe, 1)), extras)
            stats.append(group_stats)
        stats = {k: jnp.concatenate([s[k] for s in stats]) for k in stats[0]} if stats and stats[0] else {}
        return x, stats

    def _runner(self, graphdef, fp8: bool):
        """(hidden, block state, positions[, segment ids]) -> (new hidden, stats) for blocks of ``graphdef``,
        rematerialised per ``execution.remat``."""
        if graphdef is None:
            return None

        def apply(h, layer_state, positions, segment_ids=None):
            return nnx.merge(graphdef, layer_state)(h, positions, segment_ids, fp8)

        if self.run.remat == "none":
            return apply
        return jax.checkpoint(apply, policy=REMAT_POLICIES[self.run.remat], prevent_cse=False)

    def output_head(self) -> jax.Array:
        """The [embed, vocab] output matrix in the compute dtype (the embedding's transpose when tied)."""
        head = self.embedding[...].T if self.head is None else self.head[...]
        return head.astype(compute_dtype(self.run))


def logits_of(x: jax.Array, head: jax.Array) -> jax.Array:
    """[batch, length, embed] x [embed, vocab] -> float32 logits, straight out of the matmul (the loss needs
    float32 and no 16-bit copy is kept besides)."""
    logits = jnp.einsum("btd,dv->btv", x, head, preferred_element_type=jnp.float32)
    return constrain(logits, LOGIT_AXES)
