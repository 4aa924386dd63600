"""Blockwise FP8 (``execution.fp8_recipe='blockwise'``): DeepSeek-V3's recipe on Hopper's FP8 tensor cores.

Every operand is e4m3 with float32 scales (its absolute maximum over 448) on small groups of elements:

- activations and gradients in 1 x 128 tiles: each row's 128 consecutive elements along the dimension the GEMM
  contracts share a scale;
- weights in 128 x 128 blocks: one scale a block, the same blocks for the forward and the input gradient, which
  reads the weight transposed.

So the forward ``x @ w`` takes ``x`` in tiles along the input features, the input gradient ``dy @ w^T`` takes
``dy`` in tiles along the output features, and the weight gradient ``x^T @ dy`` takes both in tiles along the
tokens (DeepSeek's 128 x 1 tiles of ``x``). The backward keeps the 16-bit operands and quantizes them again.

The GEMM is jaxtron's Pallas kernel (Triton, ``gemm``): each 128 x 128 output tile sums the contracted dimension
in steps of 128, each step one FP8 tensor-core dot promoted to float32 and scaled by its two operands' scales, as
DeepSeek-V3 promotes every 128 products. On the CPU the same quantized operands are dequantized and multiplied in
float32 (``jax.lax.platform_dependent``); the tests check the kernel against that in Pallas' interpreter.

A mesh splits the GEMM as XLA splits a matmul (``custom_partitioning``): rows and columns stay split, and a split
contracted dimension is summed over its devices after the kernel. The kernel runs a batch of GEMMs: a ``jax.vmap``
(a pipeline's stages) adds to the batch (``custom_vmap``), since the partitioned call has no batching rule. Tiles
and blocks must lie on one device: ``config/recipes.py`` and ``parallel/checks.py`` ask each device's share of a
contracted dimension to be whole blocks of 128.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.custom_batching import custom_vmap
from jax.experimental import pallas as pl
from jax.experimental.custom_partitioning import custom_partitioning
from jax.experimental.pallas import triton as plt

from jaxtron.ops.block_scaled import projection, recipe_einsum
from jaxtron.ops.triton_lowering import fp8_tensor_cores
from jaxtron.parallel.sharding import split_over

BLOCK = 128  # a tile's elements along the contracted dimension; a weight block's side
E4M3_MAX = 448.0
WARPS, STAGES = 8, 3  # Triton's launch shape for 128 x 128 x 128 FP8 tiles on Hopper
KERNEL_NAME = "jaxtron_blockwise_fp8_gemm"  # metrics/hlo.py prices a call of this name as an FP8 GEMM


def _scale(amax: jax.Array) -> jax.Array:
    return jnp.where(amax > 0, amax / E4M3_MAX, 1.0)


def tiles(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``x`` [R, K] in e4m3 and its scales [R, K / 128] float32, one per 1 x 128 tile along K."""
    t = x.astype(jnp.float32).reshape(x.shape[0], -1, BLOCK)
    scale = _scale(jnp.max(jnp.abs(t), axis=-1))
    return (t / scale[..., None]).astype(jnp.float8_e4m3fn).reshape(x.shape), scale


def blocks(w: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``w`` [R, C] in e4m3 and its scales [R / 128, C / 128] float32, one per 128 x 128 block."""
    r, c = w.shape
    b = w.astype(jnp.float32).reshape(r // BLOCK, BLOCK, c // BLOCK, BLOCK)
    scale = _scale(jnp.max(jnp.abs(b), axis=(1, 3)))
    return (b / scale[:, None, :, None]).astype(jnp.float8_e4m3fn).reshape(r, c), scale


def row_scales(block_scales: jax.Array) -> jax.Array:
    """A weight's block scales [R / 128, C / 128] as per-row tile scales [R, C / 128] (each row its block's)."""
    return jnp.repeat(block_scales, BLOCK, axis=0)


def dequantized(q: jax.Array, scale: jax.Array) -> jax.Array:
    """[R, K] e4m3 with per-row tile scales [R, K / 128] -> float32."""
    return (q.astype(jnp.float32).reshape(q.shape[0], -1, BLOCK) * scale[..., None]).reshape(q.shape)


def _kernel(a_ref, sa_ref, b_ref, sb_ref, out_ref, *, steps: int):
    """Program (g, i, j): output tile (i, j) of GEMM g, a [G, M, K] b [G, N, K]^T, scales transposed [G, K / 128,
    M] and [G, K / 128, N]."""
    g, i, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)

    def step(s, acc):
        a = a_ref[g, pl.ds(i * BLOCK, BLOCK), pl.ds(s * BLOCK, BLOCK)]
        b = b_ref[g, pl.ds(j * BLOCK, BLOCK), pl.ds(s * BLOCK, BLOCK)]
        product = jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
        sa, sb = sa_ref[g, s, pl.ds(i * BLOCK, BLOCK)], sb_ref[g, s, pl.ds(j * BLOCK, BLOCK)]
        return acc + product * sa[:, None] * sb[None, :]

    acc = jax.lax.fori_loop(0, steps, step, jnp.zeros((BLOCK, BLOCK), jnp.float32))
    out_ref[g, pl.ds(i * BLOCK, BLOCK), pl.ds(j * BLOCK, BLOCK)] = acc.astype(out_ref.dtype)


def kernel_gemm(qa, sa, qb, sb, out_dtype, interpret: bool = False) -> jax.Array:
    """The Pallas kernel: G GEMMs, qa [G, M, K] and qb [G, N, K] e4m3 with per-row tile scales sa [G, M, K / 128]
    and sb [G, N, K / 128] -> qa qb^T [G, M, N] in ``out_dtype`` (every size a multiple of 128)."""
    (groups, m, k), n = qa.shape, qb.shape[1]
    if m % BLOCK or n % BLOCK or k % BLOCK:  # the checks refuse such widths; a tail would go uncomputed
        raise ValueError(f"the blockwise kernel takes multiples of {BLOCK}, not [{m}, {k}] x [{n}, {k}]")
    if not interpret:
        fp8_tensor_cores()
    return pl.pallas_call(
        functools.partial(_kernel, steps=k // BLOCK), out_shape=jax.ShapeDtypeStruct((groups, m, n), out_dtype),
        grid=(groups, m // BLOCK, n // BLOCK), interpret=interpret, name=KERNEL_NAME,
        compiler_params=plt.CompilerParams(num_warps=WARPS, num_stages=STAGES),
    )(qa, jnp.swapaxes(sa, 1, 2), qb, jnp.swapaxes(sb, 1, 2))


def emulated_gemm(qa, sa, qb, sb, out_dtype) -> jax.Array:
    """``kernel_gemm``'s numbers in XLA: the dequantized operands multiplied in float32."""
    a, b = (jax.vmap(dequantized)(q, scale) for q, scale in ((qa, sa), (qb, sb)))
    return jnp.einsum("gmk,gnk->gmn", a, b, preferred_element_type=jnp.float32).astype(out_dtype)


def _local_gemm(qa, sa, qb, sb, out_dtype):
    return jax.lax.platform_dependent(qa, sa, qb, sb, cuda=functools.partial(kernel_gemm, out_dtype=out_dtype),
                                      default=functools.partial(emulated_gemm, out_dtype=out_dtype))


def _axes(entry) -> set:
    return set() if entry is None else {entry} if isinstance(entry, str) else set(entry)


def _specs(shapes):
    """(batch, rows', contracted, columns') mesh axes of the GEMMs' operands; the columns' dropped where they share
    an axis with the others (the result cannot be split twice over one axis)."""
    def three(shape):
        spec = (*tuple(shape.sharding.spec), None, None, None)
        return spec[0], spec[1], spec[2]

    (g, m, k), (_, n, _) = three(shapes[0]), three(shapes[2])
    return g, m, k, None if (_axes(m) | _axes(g)) & _axes(n) else n


def _infer(out_dtype, mesh, shapes, result_shape):
    g, m, _, n = _specs(shapes)
    return split_over(mesh, g, m, n)


def _partition(out_dtype, mesh, shapes, result_shape):
    g, m, k, n = _specs(shapes)
    rows, cols = split_over(mesh, g, m, k), split_over(mesh, g, n, k)

    def local(qa, sa, qb, sb):
        out = _local_gemm(qa, sa, qb, sb, out_dtype)
        return out if k is None else jax.lax.psum(out, k)

    return mesh, local, split_over(mesh, g, m, n), (rows, rows, cols, cols)


_partitioned = custom_partitioning(_local_gemm, static_argnums=(4,))
_partitioned.def_partition(infer_sharding_from_operands=_infer, partition=_partition,
                           sharding_rule="g m k, g m k, g n k, g n k -> g m n")


@functools.cache  # one function per output dtype: custom_vmap takes no static argument
def _gemms(out_dtype):
    """``_partitioned`` on operands with any leading batch dimensions ([..., M, K] and so on), folded into its one
    batch dimension. A ``jax.vmap`` of it (a pipeline's stages) adds a batch dimension rather than vmap the
    partitioned call, for which ``custom_partitioning`` has no batching rule."""
    @custom_vmap
    def call(qa, sa, qb, sb):
        lead = qa.shape[:-2]
        folded = [x.reshape(-1, *x.shape[-2:]) for x in (qa, sa, qb, sb)]
        return _partitioned(*folded, out_dtype).reshape(*lead, qa.shape[-2], qb.shape[-2])

    @call.def_vmap
    def _(axis_size, in_batched, *operands):
        operands = [x if batched else jnp.broadcast_to(x, (axis_size, *x.shape))
                    for x, batched in zip(operands, in_batched, strict=True)]
        return call(*operands), True

    return call


def gemm(a: jax.Array, b: jax.Array, dtype, weight: str | None = None) -> jax.Array:
    """``a [M, K] @ b [N, K]^T`` in ``dtype``: ``a`` in 1 x 128 tiles along K; ``b`` likewise, or with ``weight``
    ('rows' or 'columns') in 128 x 128 blocks of the weight it is, laid out as is or transposed."""
    qa, sa = tiles(a)
    if weight is None:
        qb, sb = tiles(b)
    else:
        stored = b if weight == "rows" else b.T  # the weight as the projection holds it, [K, N] -> blocks
        qs, ss = blocks(stored)
        qb, sb = (qs, row_scales(ss)) if weight == "rows" else (qs.T, row_scales(ss.T))
    return _gemms(jnp.dtype(dtype))(qa, sa, qb, sb)


# the forward reads the weight's 128 x 128 blocks as stored, the input gradient transposed; the weight gradient
# takes both operands in tiles along the tokens
scaled_einsum = projection(functools.partial(gemm, weight="columns"), functools.partial(gemm, weight="rows"), gemm)
einsum = recipe_einsum(scaled_einsum)
