"""Dropless experts' grouped GEMM in blockwise FP8 (``execution.fp8_recipe='blockwise'``, ``ops/blockwise_fp8.py``):
rows sorted by expert [m, k] times each expert's matrix [groups, k, n], DeepSeek-V3's tiles and blocks.

- forward ``x @ w[g]``: each row in 1 x 128 tiles along k, each expert's matrix in 128 x 128 blocks;
- input gradient ``dy @ w[g]^T``: each row of ``dy`` in tiles along n, the same blocks read transposed;
- weight gradient ``x[g]^T @ dy[g]``: both in tiles of 128 rows counted from the expert's first row (DeepSeek
  pads each expert's rows to 128; here an expert's last tile is short), so no tile holds two experts' rows.

'pallas' runs jaxtron's two Triton kernels, each step of 128 products an FP8 tensor-core dot promoted to float32
with its two scales; 'reference' computes the same quantized numbers dequantized (CPUs, and the tests' reference).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from jaxtron.ops import grouped
from jaxtron.ops.blockwise_fp8 import BLOCK, blocks, dequantized, row_scales, tiles
from jaxtron.ops.grouped_kernels import STAGES, WARPS, _bounds, _pad_to, _tiles
from jaxtron.ops.triton_lowering import fp8_tensor_cores

KERNEL_NAME = "jaxtron_blockwise_fp8_RaggedDot"  # "RaggedDot": metrics/hlo.py prices it as a grouped GEMM


def token_tiles(x: jax.Array, group_sizes: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``x`` [m, k] (rows sorted by group) in e4m3 with one scale per feature and tile of 128 rows counted from its
    group's first row: (q [m, k], scales [tiles, k], each group's first tile [groups])."""
    first = jnp.cumsum(-(-group_sizes // BLOCK)) - (-(-group_sizes // BLOCK))  # tiles before each group
    tile = _row_tiles(first, group_sizes, x.shape[0])
    # at most one short tile a group beyond the whole ones, and one for the rows past the groups
    count = -(-x.shape[0] // BLOCK) + group_sizes.shape[0] + 1
    amax = jax.ops.segment_max(jnp.abs(x.astype(jnp.float32)), tile, num_segments=count)
    scale = jnp.where(amax > 0, amax / 448.0, 1.0)
    return (x.astype(jnp.float32) / scale[tile]).astype(jnp.float8_e4m3fn), scale, first.astype(jnp.int32)


def _rows_kernel(group_ref, tile_ref, start_ref, end_ref, a_ref, sa_ref, b_ref, sb_ref, _, out_ref, *, steps: int):
    """Program (t, j): rows of tile ``tile[t]`` in group ``group[t]`` times that group's matrix, columns j * 128
    onwards. a [m, k], scales [k / 128, m]; b [groups, n, k], scales [groups, k / 128, n]."""
    t, j = pl.program_id(0), pl.program_id(1)
    g = group_ref[t]

    @pl.when(g >= 0)
    def _():
        row0 = tile_ref[t] * BLOCK

        def step(s, acc):
            a = a_ref[pl.ds(row0, BLOCK), pl.ds(s * BLOCK, BLOCK)]
            b = b_ref[g, pl.ds(j * BLOCK, BLOCK), pl.ds(s * BLOCK, BLOCK)]
            product = jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
            sa, sb = sa_ref[s, pl.ds(row0, BLOCK)], sb_ref[g, s, pl.ds(j * BLOCK, BLOCK)]
            return acc + product * sa[:, None] * sb[None, :]

        acc = jax.lax.fori_loop(0, steps, step, jnp.zeros((BLOCK, BLOCK), jnp.float32))
        rows = row0 + jnp.arange(BLOCK)
        mine = (rows >= start_ref[g]) & (rows < end_ref[g])
        plt.store(out_ref.at[pl.ds(row0, BLOCK), pl.ds(j * BLOCK, BLOCK)], acc.astype(out_ref.dtype),
                  mask=mine[:, None])


def rows(qa, sa, qb, sb, group_sizes, out_dtype, interpret: bool = False) -> jax.Array:
    """qa [m, k] with tile scales [m, k / 128]; qb [groups, n, k] with per-row block scales [groups, n, k / 128]
    -> [m, n]: each group's rows times its matrix (rows past the groups zero). k and n multiples of 128."""
    if not interpret:
        fp8_tensor_cores()
    (m, k), (groups, n, _) = qa.shape, qb.shape
    qa, sa = _pad_to(qa, (BLOCK, 1)), _pad_to(sa, (BLOCK, 1))
    programs = qa.shape[0] // BLOCK + groups
    starts, ends = _bounds(group_sizes)
    group, tile = _tiles(starts, ends, BLOCK, programs)
    out = pl.pallas_call(
        functools.partial(_rows_kernel, steps=k // BLOCK), grid=(programs, n // BLOCK),
        out_shape=jax.ShapeDtypeStruct((qa.shape[0], n), out_dtype), input_output_aliases={8: 0},
        interpret=interpret, name=KERNEL_NAME, compiler_params=plt.CompilerParams(num_warps=WARPS, num_stages=STAGES),
    )(group, tile, starts, ends, qa, sa.T, qb, jnp.swapaxes(sb, 1, 2), jnp.zeros((qa.shape[0], n), out_dtype))
    return out[:m]


def _contract_kernel(start_ref, end_ref, first_ref, a_ref, sa_ref, b_ref, sb_ref, out_ref):
    """Program (g, i, j): group g's weight gradient tile (i, j), its rows in tiles from its first row. a [k, m],
    b [n, m] (rows innermost, padded by a tile), scales [tiles, k] and [tiles, n]."""
    g, i, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    start, end = start_ref[g], end_ref[g]

    def step(s, acc):
        cols = start + s * BLOCK + jnp.arange(BLOCK)
        mine = (cols < end)[None, :]
        a = a_ref[pl.ds(i * BLOCK, BLOCK), pl.ds(start + s * BLOCK, BLOCK)]
        b = b_ref[pl.ds(j * BLOCK, BLOCK), pl.ds(start + s * BLOCK, BLOCK)]
        a, b = jnp.where(mine, a, jnp.zeros_like(a)), jnp.where(mine, b, jnp.zeros_like(b))
        product = jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
        tile = first_ref[g] + s
        sa, sb = sa_ref[tile, pl.ds(i * BLOCK, BLOCK)], sb_ref[tile, pl.ds(j * BLOCK, BLOCK)]
        return acc + product * sa[:, None] * sb[None, :]

    acc = jax.lax.fori_loop(0, -(-(end - start) // BLOCK), step, jnp.zeros((BLOCK, BLOCK), jnp.float32))
    out_ref[g, pl.ds(i * BLOCK, BLOCK), pl.ds(j * BLOCK, BLOCK)] = acc


def contract(qa, sa, qb, sb, first, group_sizes, interpret: bool = False) -> jax.Array:
    """qa [m, k] and qb [m, n] e4m3 in ``token_tiles`` (scales [tiles, k], [tiles, n], each group's first tile)
    -> [groups, k, n] float32: each group's rows of qa transposed times its rows of qb."""
    if not interpret:
        fp8_tensor_cores()
    k, n, groups = qa.shape[1], qb.shape[1], group_sizes.shape[0]
    a, b = (jnp.pad(q.T, ((0, 0), (0, BLOCK))) for q in (qa, qb))  # a group's last tile may read past m
    starts, ends = _bounds(group_sizes)
    return pl.pallas_call(
        _contract_kernel, out_shape=jax.ShapeDtypeStruct((groups, k, n), jnp.float32),
        grid=(groups, k // BLOCK, n // BLOCK), interpret=interpret, name=KERNEL_NAME,
        compiler_params=plt.CompilerParams(num_warps=WARPS, num_stages=STAGES),
    )(starts, ends, first, a, sa, b, sb)


def _weight_blocks(w: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Each expert's matrix [groups, k, n] in 128 x 128 blocks: (q [groups, k, n], block scales [groups, k / 128,
    n / 128])."""
    return jax.vmap(blocks)(w)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def matmul(x: jax.Array, weights: jax.Array, group_sizes: jax.Array, implementation: str,
           interpret: bool = False) -> jax.Array:
    """rows [m, k] sorted by group, weights [groups, k, n], group_sizes [groups] -> [m, n] in the rows' dtype, in
    blockwise FP8 as the module says. ``implementation``: 'pallas', or a 16-bit grouped GEMM's name for the
    reference ('xla', 'tokamax'). ``interpret``: the kernels in Pallas' interpreter (tests off a GPU)."""
    return _forward(x, weights, group_sizes, implementation, interpret)[0]


def _forward(x, w, group_sizes, implementation, interpret):
    qx, sx = tiles(x)
    qw, sw = _weight_blocks(w.astype(x.dtype))  # [groups, k, n], read as [groups, n, k] with per-row scales
    qwt, swt = jnp.swapaxes(qw, 1, 2), jax.vmap(lambda s: row_scales(s.T))(sw)
    if implementation == "pallas":
        out = rows(qx, sx, qwt, swt, group_sizes, x.dtype, interpret)
    else:
        deq_w = jnp.swapaxes(jax.vmap(dequantized)(qwt, swt), 1, 2)
        out = grouped.matmul(dequantized(qx, sx).astype(x.dtype), deq_w.astype(x.dtype), group_sizes, implementation)
    return grouped.zero_past_groups(out, group_sizes), (x, w, group_sizes)


def _backward(implementation, interpret, res, dy):
    x, w, group_sizes = res
    dy = grouped.zero_past_groups(dy, group_sizes)
    dtype = dy.dtype
    qg, sg = tiles(dy)
    qw, sw = _weight_blocks(w.astype(dtype))  # [groups, k, n]: rows k, contracted n, as the input gradient reads
    sw_rows = jax.vmap(row_scales)(sw)
    (qxt, sxt, first), (qgt, sgt, _) = token_tiles(x, group_sizes), token_tiles(dy, group_sizes)
    if implementation == "pallas":
        dx = rows(qg, sg, qw, sw_rows, group_sizes, dtype, interpret)
        dw = contract(qxt, sxt, qgt, sgt, first, group_sizes, interpret)
    else:
        deq_w = jnp.swapaxes(jax.vmap(dequantized)(qw, sw_rows), 1, 2)  # [groups, n, k] as the matrices of dy
        dx = grouped.matmul(dequantized(qg, sg).astype(dtype), deq_w.astype(dtype), group_sizes, implementation)
        tile = _row_tiles(first, group_sizes, x.shape[0])
        xt, gt = qxt.astype(jnp.float32) * sxt[tile], qgt.astype(jnp.float32) * sgt[tile]
        _, pullback = jax.vjp(lambda b: grouped.matmul(xt, b, group_sizes, implementation),
                              jnp.zeros((w.shape[0], *w.shape[1:]), jnp.float32))
        (dw,) = pullback(gt)
    return grouped.zero_past_groups(dx, group_sizes), dw.astype(w.dtype), None


def _row_tiles(first: jax.Array, group_sizes: jax.Array, m: int) -> jax.Array:
    """Each row's tile in ``token_tiles``' numbering; a row past the groups gets a tile of its own past the last
    (its values, whatever they are, must not set a group's scale)."""
    starts, ends = _bounds(group_sizes)
    row = jnp.arange(m)
    group = jnp.minimum(jnp.searchsorted(ends, row, side="right"), group_sizes.shape[0] - 1)
    past = -(-m // BLOCK) + group_sizes.shape[0]
    return jnp.where(row < ends[-1], first[group] + (row - starts[group]) // BLOCK, past)


matmul.defvjp(_forward, _backward)
