"""The layer stack: blocks whose parameters are stacked along one logical axis, and the one function that runs it.

A model's blocks live in at most two stacks, each in block order: the dense blocks and the MoE blocks. The unit the
stack is stepped over is a *period*: ``moe_every`` blocks of an MoE model (its dense blocks, then its MoE block), one
block of a dense model. An MoE model's dense prefix (``first_dense_layers``) belongs to no period: it runs first,
as a plain scan, and a pipeline schedule never stages it. With ``execution.fp8_skip_layers`` the blocks run in
spans, the first and last ones in 16 bits and the ones between with FP8 matmuls (``layer_spans``).

``run_stack`` scans the periods of each span in order, or hands them to a runner (a pipeline schedule,
``jaxtron.training.pipeline.fill_drain.Schedule``), which calls ``body(hidden, one period's parameters, extras)``
however it places the periods. Every block runs under the remat policy ``execution.remat`` names (``remat_policy``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxtron.common.trace_state import WITHOUT_REMAT
from jaxtron.config.schema import ExecutionConfig, ModelConfig
from jaxtron.models.projection import fp8_recipe
from jaxtron.ops import attention as attention_ops
from jaxtron.ops import cudnn as cudnn_ops
from jaxtron.parallel.state_sharding import gathering_for_use

Stats = dict[str, jax.Array]
FP8_RECIPE = "tensorwise"  # what an FP8 span's projections and expert GEMMs compute with (ops/fp8.py)
# body(hidden [b, T, D], one period's parameters, extras) -> (hidden, that period's routing stats)
Body = Callable[[jax.Array, Any, tuple], tuple[jax.Array, Stats]]
# runner(body, hidden, the periods' parameters stacked [periods, ...], extras) -> (hidden, stats [periods, ...])
StackRunner = Callable[[Body, jax.Array, Any, tuple], tuple[jax.Array, Stats]]


def _attention_saveable(prim, *_, **__) -> bool:
    """The outputs of the attention kernel: the output and, for cuDNN's flash kernel, its softmax statistics
    (both needed by the backward kernel; saving only the output would rerun the forward kernel)."""
    return cudnn_ops.is_forward(prim)


_save_attention = jax.checkpoint_policies.save_from_both_policies(
    jax.checkpoint_policies.save_only_these_names(attention_ops.OUTPUT_NAME, cudnn_ops.PACKED_OUTPUT_NAME,
                                                  cudnn_ops.PACKED_STATS_NAME), _attention_saveable)

# execution.remat -> the jax checkpoint policy of a block ("none": no checkpoint at all)
_POLICIES = {
    "full": jax.checkpoint_policies.nothing_saveable,
    # keep every weight matmul's output; recompute only elementwise ops and attention scores
    "save_dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    # keep the attention output, so a flash-attention kernel runs once forward and once backward
    "save_attention": _save_attention,
    "save_dots_attention": jax.checkpoint_policies.save_from_both_policies(
        jax.checkpoint_policies.dots_with_no_batch_dims_saveable, _save_attention),
}


def remat_policy(name: str) -> Callable | None:
    """The checkpoint policy ``execution.remat`` names (None for 'none': everything is kept)."""
    if name not in _POLICIES and name != "none":  # 'auto' is resolved before a model is built
        raise ValueError(f"execution.remat={name!r} names no policy; 'auto' is resolved by jaxtron.planning.remat")
    return _POLICIES.get(name)


def remat_names() -> tuple[str, ...]:
    """Every policy name this module implements, 'none' first."""
    return ("none", *_POLICIES)


@dataclasses.dataclass(frozen=True)
class LayerSpan:
    """A span of blocks ``first`` .. ``end`` - 1 that is scanned together."""
    first: int
    end: int
    fp8: bool  # its projections and expert GEMMs use FP8 matmuls
    prefix: bool  # it is (part of) the dense prefix: a plain scan, never staged


def layer_spans(cfg: ModelConfig, execution: ExecutionConfig) -> list[LayerSpan]:
    """The spans of blocks scanned together: cut at the dense prefix and, with ``execution.fp8_skip_layers``, where
    the 16-bit first and last blocks meet the FP8 ones."""
    n, skip = cfg.num_layers, execution.fp8_skip_layers if execution.fp8 else 0
    cuts = sorted({0, n, cfg.prefix_layers, skip, n - skip})
    return [LayerSpan(a, b, execution.fp8 and skip <= a < n - skip, b <= cfg.prefix_layers)
            for a, b in itertools.pairwise(cuts)]


def stacked(make: Callable[[nnx.Rngs], nnx.Module], rngs: nnx.Rngs, count: int, axis: str) -> nnx.Module | None:
    """``count`` modules ``make(rngs)`` with their parameters stacked along the logical axis ``axis`` (None for
    zero): ``layers`` for the periods a pipeline schedule runs, ``unstaged_layers`` for those it never does."""
    if not count:
        return None

    @nnx.split_rngs(splits=count)
    @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: axis})
    def make_all(rngs: nnx.Rngs) -> nnx.Module:
        return make(rngs)

    return make_all(rngs)


def scan_stack(body: Body, x: jax.Array, stack: Any, extras: tuple, unroll: bool = False) -> tuple[jax.Array, Stats]:
    """The runner without a pipeline: one scan over the periods in order; stats stacked [periods, ...]. ``unroll``
    (execution.scan_layers=False): every period in line, no loop."""
    return jax.lax.scan(lambda h, period: body(h, period, extras), x, stack, unroll=unroll)


@contextlib.contextmanager
def without_remat() -> Iterator[None]:
    """Within this context the blocks a stack runs are not checkpointed, whatever ``execution.remat`` says: for a
    caller that takes each block's vector-Jacobian product right after recomputing its forward (the 1F1B
    schedule, ``jaxtron/training/pipeline/one_f_one_b.py``), where a checkpoint would only run the forward twice."""
    with WITHOUT_REMAT.bound(True):
        yield


def _block_fn(graphdef: Any, fp8: bool, remat: str) -> Callable | None:
    """(hidden, one block's parameters, positions[, segment ids]) -> (hidden, stats) for blocks of ``graphdef``,
    rematerialised per ``remat`` (not within ``without_remat``)."""
    if graphdef is None:
        return None

    unrematerialized = WITHOUT_REMAT.get()
    policy = None if unrematerialized else remat_policy(remat)
    # without a checkpoint (and outside 1F1B's explicit backward, which recomputes the block first) the block keeps
    # what its backward reads: a weight gathered for use would be kept whole from the forward to the backward pass
    gather = "keep" if policy is not None or unrematerialized else "regather"

    def apply(h, block, positions, segment_ids=None):
        with gathering_for_use(gather), fp8_recipe(FP8_RECIPE if fp8 else None):
            return nnx.merge(graphdef, block)(h, positions, segment_ids)

    return apply if policy is None else jax.checkpoint(apply, policy=policy, prevent_cse=False)


def _period(dense_fn: Callable | None, moe_fn: Callable | None, dense_per_period: int, h: jax.Array,
            period: tuple[Any, Any], extras: tuple) -> tuple[jax.Array, Stats]:
    """One period: its dense blocks ([dense_per_period, ...] when more than one), then its MoE block."""
    dense, moe = period
    if dense is not None and dense_per_period == 1:
        h, _ = dense_fn(h, dense, *extras)
    elif dense is not None:
        for j in range(dense_per_period):
            h, _ = dense_fn(h, jax.tree.map(lambda a, j=j: a[j], dense), *extras)
    return (h, {}) if moe is None else moe_fn(h, moe, *extras)


def _periods(tree: Any, per: int, first: int, end: int, whole: bool) -> Any:
    """The blocks of periods ``first`` .. ``end`` - 1 of a stack holding ``per`` blocks per period: [periods, per,
    ...] (per > 1) or [periods, ...]; all of it as stored when ``whole`` (a pipeline's stored stack may hold
    identity periods after the model's)."""
    if tree is None or not per:
        return None
    if per == 1:
        return tree if whole else jax.tree.map(lambda a: a[first:end], tree)
    return jax.tree.map(lambda a: a[first * per:end * per].reshape(end - first, per, *a.shape[1:]), tree)


def span_slices(cfg: ModelConfig, execution: ExecutionConfig, dense_state: Any, moe_state: Any,
                 whole: bool = False):
    """Each layer span (``layer_spans``) with its share of the stacks ``dense_state`` and ``moe_state`` (their
    parameters, or anything stacked as they are: a decode's caches): a prefix span's dense blocks [blocks, ...], or
    a stacked span's periods (dense [periods, per, ...] or [periods, ...], MoE [periods, ...]; ``_periods``).
    ``whole``: a span of every period takes the stacks as stored."""
    prefix, period = cfg.prefix_layers, cfg.period
    dense_per_period = period - 1 if cfg.moe.num_experts else 1
    for span in layer_spans(cfg, execution):
        if span.prefix:
            yield span, jax.tree.map(lambda a, sp=span: a[sp.first:sp.end], dense_state)
            continue
        first, end = (span.first - prefix) // period, (span.end - prefix) // period
        every = whole and (first, end) == (0, cfg.stack_periods)
        yield span, (_periods(dense_state, dense_per_period, first, end, every),
                      _periods(moe_state, 1, first, end, every))


def run_stack(cfg: ModelConfig, execution: ExecutionConfig, dense: nnx.Module | None, moe: nnx.Module | None,
              x: jax.Array, extras: tuple, runner: StackRunner | None = None) -> tuple[jax.Array, Stats]:
    """Runs the dense and MoE stacks (stacked modules or None) on the residual stream ``x``: the prefix, then the
    periods of each span through ``runner`` (default: a scan). ``extras`` are the positions and, for packed rows,
    the segment ids. Returns the stack's output and the MoE blocks' routing stats, each stacked along its first
    axis in block order (empty for a dense model)."""
    dense_def, dense_state = nnx.split(dense) if dense is not None else (None, None)
    moe_def, moe_state = nnx.split(moe) if moe is not None else (None, None)
    dense_per_period = cfg.period - 1 if cfg.moe.num_experts else 1
    stats = []
    scan = functools.partial(scan_stack, unroll=not execution.scan_layers)
    for span, periods in span_slices(cfg, execution, dense_state, moe_state, whole=True):
        dense_fn = _block_fn(dense_def, span.fp8, execution.remat)
        if span.prefix:
            x, _ = scan(lambda h, block, ex, f=dense_fn: f(h, block, *ex), x, periods, extras)
            continue
        body = functools.partial(_period, dense_fn, _block_fn(moe_def, span.fp8, execution.remat), dense_per_period)
        x, span_stats = (runner or scan)(body, x, periods, extras)
        stats.append(span_stats)
    if not stats or not stats[0]:
        return x, {}
    return x, {k: jnp.concatenate([s[k] for s in stats]) for k in stats[0]}


Cache = dict[str, Any]  # {"layers": the dense blocks' caches stacked [blocks, ...], "moe_layers": the MoE blocks'}


def decode_stack(cfg: ModelConfig, execution: ExecutionConfig, dense: nnx.Module | None, moe: nnx.Module | None,
                 x: jax.Array, positions: jax.Array, cache: Cache) -> tuple[jax.Array, Cache]:
    """``run_stack`` for generation: the tokens ``x`` at ``positions`` through the blocks in the same order, each
    block's attention reading the earlier tokens from its cache and writing these in (``Block.decode``). ``cache``
    holds each stack's block caches stacked as its parameters are; -> (the stack's output, the new cache)."""
    dense_def, dense_state = nnx.split(dense) if dense is not None else (None, None)
    moe_def, moe_state = nnx.split(moe) if moe is not None else (None, None)
    dense_per_period = cfg.period - 1 if cfg.moe.num_experts else 1
    pieces: dict[str, list] = {"layers": [], "moe_layers": []}

    def block_fn(graphdef, fp8):
        def apply(h, block, c):
            with fp8_recipe(FP8_RECIPE if fp8 else None):
                return nnx.merge(graphdef, block).decode(h, positions, c)
        return apply

    cache_slices = span_slices(cfg, execution, cache.get("layers"), cache.get("moe_layers"))
    for (span, params), (_, caches) in zip(span_slices(cfg, execution, dense_state, moe_state), cache_slices,
                                            strict=True):
        dense_fn = block_fn(dense_def, span.fp8)
        if span.prefix:
            x, c = jax.lax.scan(lambda h, bc, f=dense_fn: f(h, *bc), x, (params, caches))
            pieces["layers"].append(c)
            continue
        moe_fn = block_fn(moe_def, span.fp8)

        def one_period(h, pc, dense_fn=dense_fn, moe_fn=moe_fn):
            (dense_p, moe_p), (dense_c, moe_c) = pc
            if dense_p is not None and dense_per_period == 1:
                h, dense_c = dense_fn(h, dense_p, dense_c)
            elif dense_p is not None:
                out = []
                for j in range(dense_per_period):
                    h, c = dense_fn(h, *jax.tree.map(lambda a, j=j: a[j], (dense_p, dense_c)))
                    out.append(c)
                dense_c = jax.tree.map(lambda *a: jnp.stack(a), *out)
            if moe_p is not None:
                h, moe_c = moe_fn(h, moe_p, moe_c)
            return h, (dense_c, moe_c)

        x, (dense_c, moe_c) = jax.lax.scan(one_period, x, (params, caches))
        if dense_c is not None:
            pieces["layers"].append(jax.tree.map(lambda a: a.reshape(-1, *a.shape[2:]), dense_c)
                                    if dense_per_period > 1 else dense_c)
        if moe_c is not None:
            pieces["moe_layers"].append(moe_c)
    new = {name: jax.tree.map(lambda *a: jnp.concatenate(a), *parts) for name, parts in pieces.items() if parts}
    return x, new
