"""The layer stack: blocks whose parameters are stacked along one logical axis, and the one function that runs it.

A model's blocks live in stacks, each in block order, one per kind of block with parameters of its own shape
(``STACKS``): dense and MoE blocks with attention, dense and MoE blocks with Gated DeltaNet; and in a dense model a
lead of blocks that run first. The unit the stack is stepped over is a *period* (``ModelConfig.period``):
``moe_every`` blocks of an MoE model (its dense blocks, then its MoE block), a run of the local/global pattern
(Gemma 3's five local blocks and a global one, Qwen3.5's three Gated DeltaNet blocks and a full-attention one), or
one block. A period's blocks run in order, each of its kind (``ModelConfig.period_blocks``). The prefix (an MoE
model's dense ``first_dense_layers``, or the blocks a dense model's periods leave over, its lead) belongs to no
period: it runs first, as a plain scan, and a pipeline schedule never stages it. With ``execution.fp8_skip_layers``
the blocks run in spans, the first and last ones in 16 bits and the ones between with FP8 matmuls (``layer_spans``).

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
from jaxtron.config.model import STACKS, BlockKind
from jaxtron.config.schema import ExecutionConfig, ModelConfig
from jaxtron.models.projection import PROJECTION_OUTPUT, Projection, fp8_recipe
from jaxtron.ops import attention as attention_ops
from jaxtron.ops import cudnn as cudnn_ops
from jaxtron.ops import sinks as sink_ops
from jaxtron.parallel.sharding import logical_names, logical_to_spec, spec_axes, whole_over_batch
from jaxtron.parallel.state_sharding import gathering_for_use

# The XLA options of a program that runs its layers in a loop. Evidence: Llama-3 8B (8 layers, sequence 4096, batch
# 4) compiled for the H200 target, jax 0.10.2: XLA fills each stack the loop writes (the saved activations forward,
# the weights' gradients backward) with zeros first, 13.4 + 7.0 GB. This option gives the loop an uninitialized
# buffer where XLA proves every slot is written before it is read: budget 439.5 -> 432.2 ms, the loss unchanged.
COMPILER_OPTIONS = {"xla_gpu_enable_dus_accumulator_zero_init_elimination": True}

Stats = dict[str, jax.Array]
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
                                                  cudnn_ops.PACKED_STATS_NAME, sink_ops.OUTPUT_NAME,
                                                  sink_ops.STATS_NAME), _attention_saveable)

# a weight matmul's output: XLA's dots, and a low-precision recipe's kernels, which the dots' policy cannot see
# (blockwise FP8's Pallas GEMM: unsaved, Llama-3 8B's step ran 6 of its 7 projections' forward GEMMs again)
_save_dots = jax.checkpoint_policies.save_from_both_policies(
    jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    jax.checkpoint_policies.save_only_these_names(PROJECTION_OUTPUT))
# execution.remat -> the jax checkpoint policy of a block ("none": no checkpoint at all)
_POLICIES = {
    "full": jax.checkpoint_policies.nothing_saveable,
    # keep every weight matmul's output; recompute only elementwise ops and attention scores
    "save_dots": _save_dots,
    # keep the attention output, so a flash-attention kernel runs once forward and once backward
    "save_attention": _save_attention,
    "save_dots_attention": jax.checkpoint_policies.save_from_both_policies(_save_dots, _save_attention),
}


def remat_policy(name: str) -> Callable | None:
    """The checkpoint policy ``execution.remat`` names (None for 'none': everything is kept)."""
    if name not in _POLICIES and name != "none":  # 'auto' is resolved before a model is built
        raise ValueError(f"execution.remat={name!r} names no policy; 'auto' is resolved by jaxtron.planning.remat")
    return _POLICIES.get(name)


def compiler_options(execution: ExecutionConfig) -> dict[str, object]:
    """The XLA options of a program whose blocks run as ``execution`` says: ``COMPILER_OPTIONS`` for a loop."""
    return dict(COMPILER_OPTIONS) if execution.scan_layers else {}


def remat_names() -> tuple[str, ...]:
    """Every policy name this module implements, 'none' first."""
    return ("none", *_POLICIES)


@dataclasses.dataclass(frozen=True)
class LayerSpan:
    """A span of blocks ``first`` .. ``end`` - 1 that is scanned together."""
    first: int
    end: int
    fp8: str | None  # the FP8 recipe of its projections and expert GEMMs (execution.fp8_recipe), or None
    prefix: bool  # it is (part of) the dense prefix: a plain scan, never staged


def layer_spans(cfg: ModelConfig, execution: ExecutionConfig) -> list[LayerSpan]:
    """The spans of blocks scanned together: cut at the dense prefix and, with ``execution.fp8_skip_layers``, where
    the 16-bit first and last blocks meet the FP8 ones."""
    n, skip = cfg.num_layers, execution.fp8_skip_layers if execution.fp8 else 0
    cuts = sorted({0, n, cfg.prefix_layers, skip, n - skip})
    recipe = execution.fp8_recipe if execution.fp8 else None
    return [LayerSpan(a, b, recipe if skip <= a < n - skip else None, b <= cfg.prefix_layers)
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


def _block_fn(graphdef: Any, fp8: str | None, remat: str, local: bool = False,
              in_loop: bool = True) -> Callable | None:
    """(hidden, one block's parameters, positions[, segment ids]) -> (hidden, stats) for blocks of ``graphdef``,
    their projections by the FP8 recipe ``fp8`` (None: in the compute dtype), rematerialised per ``remat`` (not
    within ``without_remat``); ``local``: blocks whose attention is windowed; ``in_loop``: the blocks run in a
    loop's body, not in line."""
    if graphdef is None:
        return None

    unrematerialized = WITHOUT_REMAT.get()
    policy = None if unrematerialized else remat_policy(remat)
    # without a checkpoint (and outside 1F1B's explicit backward, which recomputes the block first) the block keeps
    # what its backward reads: a weight gathered for use would be kept whole from the forward to the backward pass
    gather = "keep" if policy is not None or unrematerialized else "regather"

    def apply(h, block, positions, segment_ids=None):
        with gathering_for_use(gather), fp8_recipe(fp8):
            return nnx.merge(graphdef, block)(h, positions, segment_ids, local=local)

    if policy is None:
        return apply
    # in line, XLA would merge the recomputed forward with the first one and keep what the policy drops (Llama-3
    # 8B, 32 layers on 8 H100s: a 165 GB peak where the loop's is 83); a loop body cannot be merged so
    checkpointed = jax.checkpoint(apply, policy=policy, prevent_cse=not in_loop)
    if in_loop:
        return checkpointed

    def cast_then_apply(h, block, *extras):
        # in line, the weights' casts run once, before the checkpoint: its barrier then holds the cast weights the
        # forward made anyway, where inside it each float32 weight was copied for the backward and cast again there
        return checkpointed(h, compute_weights(graphdef, block), *extras)

    return cast_then_apply


def compute_weights(graphdef: Any, block: Any) -> Any:
    """A block's parameters with each projection's weight in its compute dtype (the cast it makes when called),
    where the weight is used as it is stored. A weight gathered for use (split over the batch's axes) is cast
    where it is gathered: cast here, Llama-3 8B's in-line step on fsdp=8 peaked 17 GiB higher (H100 target)."""
    module = nnx.merge(graphdef, jax.tree.map(lambda a: a, block))  # new Variables: the caller's stay as they were
    with jax.named_scope("weight_cast"):
        for _, node in nnx.iter_graph(module):
            if not isinstance(node, Projection) or node.weight[...].dtype == node.dtype:
                continue
            w, names = node.weight[...], logical_names(node.weight)
            names = names[len(names) - w.ndim:]  # a stacked weight's names lead with its stack's axis
            if _used_as_stored(names):
                node.weight.value = w.astype(node.dtype)
    return nnx.split(module)[1]


def _used_as_stored(names: tuple[str | None, ...]) -> bool:
    """Whether a weight named ``names`` is used as stored: no axis of the batch's that splits it has 2 devices."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return True

    def split(spec):
        return [tuple(a for a in spec_axes(spec, d) if mesh.shape[a] > 1) for d in range(len(names))]

    return split(whole_over_batch(names)) == split(logical_to_spec(names))


def per_period(cfg: ModelConfig) -> tuple[int, ...]:
    """Blocks of one period in each stack (``STACKS``' order)."""
    blocks = cfg.period_blocks()
    return tuple(sum(kind.stack == i for kind in blocks) for i in range(len(STACKS)))


def blocks_of_period(blocks: tuple[BlockKind, ...], counts: tuple[int, ...],
                     period: tuple[Any, ...]) -> Iterator[tuple[BlockKind, Any]]:
    """(kind, the block's parameters) of each of a period's ``blocks`` in order: the next block of its stack's
    share of the period (``period``: one tree per stack; [count, ...] when ``counts`` says more than one)."""
    taken = [0] * len(STACKS)
    for kind in blocks:
        tree, j = period[kind.stack], taken[kind.stack]
        taken[kind.stack] += 1
        yield kind, tree if counts[kind.stack] == 1 else jax.tree.map(lambda a, j=j: a[j], tree)


def _period(fns: dict[BlockKind, Callable], blocks: tuple[BlockKind, ...], counts: tuple[int, ...],
            h: jax.Array, period: tuple[Any, ...], extras: tuple) -> tuple[jax.Array, Stats]:
    """One period: each of its ``blocks`` in order, by ``fns`` of its kind (``blocks_of_period``). Stats: the MoE
    block's, or its MoE blocks' stacked [count, ...]."""
    stats = []
    for kind, block in blocks_of_period(blocks, counts, period):
        h, block_stats = fns[kind](h, block, *extras)
        if kind.moe:
            stats.append(block_stats)
    if len(stats) <= 1:
        return h, stats[0] if stats else {}
    return h, {k: jnp.stack([b[k] for b in stats]) for k in stats[0]}


def _periods(tree: Any, per: int, first: int, end: int, whole: bool) -> Any:
    """The blocks of periods ``first`` .. ``end`` - 1 of a stack holding ``per`` blocks per period: [periods, per,
    ...] (per > 1) or [periods, ...]; all of it as stored when ``whole`` (a pipeline's stored stack may hold
    identity periods after the model's)."""
    if tree is None or not per:
        return None
    if per == 1:
        return tree if whole else jax.tree.map(lambda a: a[first:end], tree)
    return jax.tree.map(lambda a: a[first * per:end * per].reshape(end - first, per, *a.shape[1:]), tree)


def span_slices(cfg: ModelConfig, execution: ExecutionConfig, states: tuple[Any, ...], whole: bool = False,
                lead_state: Any = None):
    """Each layer span (``layer_spans``) with its share of the stacks' parameters ``states`` (one per
    ``STACKS``): a prefix span's blocks [blocks, ...] (of ``lead_state`` when the model has a lead stack, else of
    the dense stack), or a stacked span's periods, one tree per stack ([periods, per, ...] or [periods, ...];
    ``_periods``). ``whole``: a span of every period takes the stacks as stored."""
    prefix, period, counts = cfg.prefix_layers, cfg.period, per_period(cfg)
    first_blocks = lead_state if cfg.lead_stack else states[0]
    for span in layer_spans(cfg, execution):
        if span.prefix:
            yield span, jax.tree.map(lambda a, sp=span: a[sp.first:sp.end], first_blocks)
            continue
        first, end = (span.first - prefix) // period, (span.end - prefix) // period
        every = whole and (first, end) == (0, cfg.stack_periods)
        yield span, tuple(_periods(state, n, first, end, every) for state, n in zip(states, counts, strict=True))


def period_range(cfg: ModelConfig, span: LayerSpan) -> tuple[int, int]:
    """The blocks (a prefix span) or periods (a stacked span) ``span`` covers, as a range's ends."""
    if span.prefix:
        return span.first, span.end
    return (span.first - cfg.prefix_layers) // cfg.period, (span.end - cfg.prefix_layers) // cfg.period


def _split(stacks: tuple[nnx.Module | None, ...]) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
    """(graph definitions, parameters) of each stack (None for one the model lacks)."""
    pairs = [nnx.split(m) if m is not None else (None, None) for m in stacks]
    return tuple(p[0] for p in pairs), tuple(p[1] for p in pairs)


def run_stack(cfg: ModelConfig, execution: ExecutionConfig, stacks: tuple[nnx.Module | None, ...], x: jax.Array,
              extras: tuple, runner: StackRunner | None = None,
              lead: nnx.Module | None = None) -> tuple[jax.Array, Stats]:
    """Runs the stacks (stacked modules or None, in ``STACKS``' order) on the residual stream ``x``: the prefix (from
    ``lead``, a dense model's lead stack, when it has one), then the periods of each span through ``runner``
    (default: a scan). ``extras`` are the positions and, for packed rows, the segment ids. Returns the stack's
    output and the MoE blocks' routing stats, each stacked along its first axis in block order (empty for a dense
    model)."""
    defs, states = _split(stacks)
    lead_def, lead_state = nnx.split(lead) if lead is not None else (None, None)
    blocks, counts = cfg.period_blocks(), per_period(cfg)
    stats = []
    scan = functools.partial(scan_stack, unroll=not execution.scan_layers)
    for span, periods in span_slices(cfg, execution, states, whole=True, lead_state=lead_state):
        if span.prefix:
            first_fn = _block_fn(lead_def or defs[0], span.fp8, execution.remat, cfg.is_local_block(span.first),
                                 execution.scan_layers)
            x, _ = scan(lambda h, block, ex, f=first_fn: f(h, block, *ex), x, periods, extras)
            continue
        in_loop = execution.scan_layers or runner is not None
        fns = {kind: _block_fn(defs[kind.stack], span.fp8, execution.remat, kind.local, in_loop)
               for kind in set(blocks)}
        x, span_stats = (runner or scan)(functools.partial(_period, fns, blocks, counts), x, periods, extras)
        if sum(kind.moe for kind in blocks) > 1:  # [periods, MoE blocks of a period, ...] -> [blocks, ...]
            span_stats = jax.tree.map(lambda a: a.reshape(-1, *a.shape[2:]), span_stats)
        stats.append(span_stats)
    if not stats or not stats[0]:
        return x, {}
    return x, {k: jnp.concatenate([s[k] for s in stats]) for k in stats[0]}


# {"prefix": the prefix blocks' caches stacked [blocks, ...], "period": one cache per block of a period, each stacked
# [periods, ...]} (a local block's is a ring of its window: models/window_cache.py)
Cache = dict[str, Any]


def decode_stack(cfg: ModelConfig, execution: ExecutionConfig, stacks: tuple[nnx.Module | None, ...], x: jax.Array,
                 positions: jax.Array, cache: Cache, lead: nnx.Module | None = None) -> tuple[jax.Array, Cache]:
    """``run_stack`` for generation: the tokens ``x`` at ``positions`` through the blocks in the same order, each
    block's attention reading the earlier tokens from its cache and writing these in (``Block.decode``). ``cache``
    as ``Cache`` says; -> (the stack's output, the new cache)."""
    defs, states = _split(stacks)
    lead_def, lead_state = nnx.split(lead) if lead is not None else (None, None)
    blocks, counts = cfg.period_blocks(), per_period(cfg)
    pieces: dict[str, list] = {"prefix": [], "period": []}

    def block_fn(graphdef, fp8, local):
        def apply(h, block, c):
            with fp8_recipe(fp8):
                return nnx.merge(graphdef, block).decode(h, positions, c, local=local)
        return apply

    for span, params in span_slices(cfg, execution, states, lead_state=lead_state):
        first, end = period_range(cfg, span)
        if span.prefix:
            prefix_fn = block_fn(lead_def or defs[0], span.fp8, cfg.is_local_block(span.first))
            caches = jax.tree.map(lambda a, f=first, e=end: a[f:e], cache["prefix"])
            x, c = jax.lax.scan(lambda h, bc, f=prefix_fn: f(h, *bc), x, (params, caches))
            pieces["prefix"].append(c)
            continue
        fns = {kind: block_fn(defs[kind.stack], span.fp8, kind.local) for kind in set(blocks)}

        def one_period(h, pc, fns=fns):
            period, caches = pc
            out = []
            for (kind, block), c in zip(blocks_of_period(blocks, counts, period), caches, strict=True):
                h, c = fns[kind](h, block, c)
                out.append(c)
            return h, tuple(out)

        caches = tuple(jax.tree.map(lambda a, f=first, e=end: a[f:e], c) for c in cache["period"])
        x, c = jax.lax.scan(one_period, x, (params, caches))
        pieces["period"].append(c)
    new = {name: jax.tree.map(lambda *a: jnp.concatenate(a), *parts) for name, parts in pieces.items() if parts}
    return x, new
