"""jaxtron's Pallas kernels for grouped GEMMs (rows sorted by group), for Hopper GPUs, in Triton through Pallas:
``rows`` (each group's rows times its own matrix: the forward and the input gradient) and ``contract`` (each
group's rows transposed times its output gradient: the weight gradient), with FP8 or 16-bit operands and float32
sums. ``ops/grouped_fp8.py`` runs both for the FP8 expert GEMM, ``ops/grouped.py`` runs ``contract`` for the 16-bit
weight gradient. ``transposed`` gives each group's matrix transposed, as a kernel: XLA would otherwise make a
transposition that feeds a kernel into a layout of its operand, carried back to the float32 parameters, and transpose
the whole stack of them once ahead of the layers' loop (a second copy of the parameters, live all step).

``rows`` computes a grouped GEMM by row tiles: every tile of ``block_m`` rows that holds rows of a group is one
program for that group (a tile across a group boundary is computed for each of its groups, each storing its own
rows), so the programs are at most ``m / block_m + groups``. ``contract`` runs one program per group and output
tile, looping over the group's rows. Both read their operands contracting-dimension innermost, the layout Hopper's
FP8 tensor-core instructions take, and accumulate in float32. Off a GPU they run in Pallas' interpreter: the tests
check them there.

Triton multiplies FP8 operands on Hopper's FP8 tensor cores (``wgmma ... e4m3.e4m3``) only where a dot may
accumulate some products at the tensor core's own precision before adding them in float32; Pallas' Triton lowering
(jax 0.10 and 0.11) builds every dot without saying so, and Triton then converts FP8 operands to f16 for the older
``mma.sync`` instructions. ``fp8_tensor_cores()`` (``ops/triton_lowering.py``) has the lowering say it for FP8
dots: each dot (``BLOCK_K`` products, the tensor core's accumulation) adds into the kernel's float32 sum, one
promotion every 128 products, as DeepSeek-V3 trains. The H100 target's PTX shows the FP8 instruction
(``tests/test_gpu_target.py``). Pallas' lowering takes one FP8 kind per dot, so the backward's e5m2 by e4m3 products
run on bf16 tensor cores, on the same FP8 values.
"""


from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from jaxtron.ops.triton_lowering import fp8_tensor_cores

# tile sizes and launch shape: Triton's tile for FP8 GEMMs on Hopper (128 x 128 x 128, 8 warps, 3 stages)
BLOCK_M, BLOCK_N, BLOCK_K, WARPS, STAGES = 128, 128, 128, 8, 3
_NAME = "jaxtron_fp8_RaggedDot"  # metrics/hlo.py counts a custom call with "RaggedDot" in it as a grouped GEMM


def _block(size: int, preferred: int) -> int:
    """A power of two >= 16 (the least a tensor-core tile takes) and <= ``preferred`` covering ``size`` if it can."""
    return max(16, min(preferred, 1 << max(0, size - 1).bit_length()))


def _pad_to(x: jax.Array, multiples: tuple[int, ...]) -> jax.Array:
    pads = [(0, -size % m) for size, m in zip(x.shape, multiples, strict=True)]
    return jnp.pad(x, pads) if any(p for _, p in pads) else x


def _bounds(group_sizes: jax.Array) -> tuple[jax.Array, jax.Array]:
    ends = jnp.cumsum(group_sizes.astype(jnp.int32))
    return ends - group_sizes.astype(jnp.int32), ends


def _tiles(starts: jax.Array, ends: jax.Array, block_m: int, count: int) -> tuple[jax.Array, jax.Array]:
    """The (group, row tile) of each of ``count`` programs: a group's rows [start, end) lie in the tiles
    start // block_m to ceil(end / block_m); programs past the last tile get group -1."""
    first, last = starts // block_m, -(-ends // block_m)
    per_group = jnp.where(ends > starts, last - first, 0)
    done = jnp.cumsum(per_group)
    program = jnp.arange(count, dtype=jnp.int32)
    group = jnp.minimum(jnp.searchsorted(done, program, side="right"), starts.shape[0] - 1).astype(jnp.int32)
    tile = first[group] + program - (done[group] - per_group[group])
    return jnp.where(program < done[-1], group, -1), tile.astype(jnp.int32)


def _dot_transposed(a: jax.Array, b: jax.Array) -> jax.Array:
    """a [p, c] times b [q, c] transposed, in float32. Pallas' Triton lowering multiplies two FP8 operands of one
    kind only: a backward's e5m2 gradient by an e4m3 operand is computed on both in bf16 (exactly their values)."""
    if a.dtype != b.dtype:
        a, b = a.astype(jnp.bfloat16), b.astype(jnp.bfloat16)
    return jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)


def _rows_kernel(group_ref, tile_ref, start_ref, end_ref, a_ref, b_ref, a_scale_ref, b_scale_ref, _, out_ref, *,
                 block_m: int, block_n: int, block_k: int, steps: int):
    """Program (t, j): rows of tile ``tile[t]`` that belong to group ``group[t]`` times that group's matrix,
    output columns j * block_n onwards. a [m, k], b [groups, n, k] (contracting dimension innermost)."""
    t, j = pl.program_id(0), pl.program_id(1)
    g = group_ref[t]

    @pl.when(g >= 0)
    def _():
        row0 = tile_ref[t] * block_m

        def step(i, acc):
            a = a_ref[pl.ds(row0, block_m), pl.ds(i * block_k, block_k)]
            b = b_ref[g, pl.ds(j * block_n, block_n), pl.ds(i * block_k, block_k)]
            return acc + _dot_transposed(a, b)

        acc = jax.lax.fori_loop(0, steps, step, jnp.zeros((block_m, block_n), jnp.float32))
        rows = row0 + jnp.arange(block_m)
        mine = (rows >= start_ref[g]) & (rows < end_ref[g])
        value = (acc * (a_scale_ref[0] * b_scale_ref[g])).astype(out_ref.dtype)
        plt.store(out_ref.at[pl.ds(row0, block_m), pl.ds(j * block_n, block_n)], value, mask=mine[:, None])


def rows(a: jax.Array, b: jax.Array, group_sizes: jax.Array, a_scale: jax.Array, b_scale: jax.Array, out_dtype,
         interpret: bool = False) -> jax.Array:
    """a [m, k] (FP8, rows sorted by group), b [groups, n, k] (FP8), group_sizes [groups], a_scale [], b_scale
    [groups] -> [m, n] in ``out_dtype``: each group's rows times its matrix, scaled; rows past the groups are zeros."""
    if not interpret:
        fp8_tensor_cores()
    (m, k), (groups, n, _) = a.shape, b.shape
    bm, bn, bk = _block(m, BLOCK_M), _block(n, BLOCK_N), _block(k, BLOCK_K)
    a, b = _pad_to(a, (bm, bk)), _pad_to(b, (1, bn, bk))
    (mp, kp), np_ = a.shape, b.shape[1]
    programs = mp // bm + groups
    starts, ends = _bounds(group_sizes)
    group, tile = _tiles(starts, ends, bm, programs)
    kernel = functools.partial(_rows_kernel, block_m=bm, block_n=bn, block_k=bk, steps=kp // bk)
    out = pl.pallas_call(
        kernel, out_shape=jax.ShapeDtypeStruct((mp, np_), out_dtype), grid=(programs, np_ // bn),
        input_output_aliases={8: 0}, interpret=interpret, name=_NAME,
        compiler_params=plt.CompilerParams(num_warps=WARPS, num_stages=STAGES),
    )(group, tile, starts, ends, a, b, jnp.reshape(a_scale, (1,)).astype(jnp.float32),
      b_scale.astype(jnp.float32), jnp.zeros((mp, np_), out_dtype))
    return out[:m, :n]


def _contract_kernel(start_ref, end_ref, a_ref, b_ref, scale_ref, out_ref, *, block_m: int, block_n: int,
                     block_k: int):
    """Program (g, i, j): group g's output tile (i, j), summed over the group's rows. a [k, m], b [n, m] (rows
    innermost)."""
    g, i, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    start, end = start_ref[g], end_ref[g]

    def step(s, acc):
        cols = s * block_k + jnp.arange(block_k)
        mine = ((cols >= start) & (cols < end))[None, :]
        a = a_ref[pl.ds(i * block_m, block_m), pl.ds(s * block_k, block_k)]
        b = b_ref[pl.ds(j * block_n, block_n), pl.ds(s * block_k, block_k)]
        a, b = jnp.where(mine, a, jnp.zeros_like(a)), jnp.where(mine, b, jnp.zeros_like(b))
        return acc + _dot_transposed(a, b)

    first, last = start // block_k, jnp.where(end > start, -(-end // block_k), start // block_k)
    acc = jax.lax.fori_loop(first, last, step, jnp.zeros((block_m, block_n), jnp.float32))
    out_ref[g, pl.ds(i * block_m, block_m), pl.ds(j * block_n, block_n)] = (acc * scale_ref[0]).astype(out_ref.dtype)


def contract(a: jax.Array, b: jax.Array, group_sizes: jax.Array, scale: jax.Array, out_dtype,
             interpret: bool = False) -> jax.Array:
    """a [k, m], b [n, m] (FP8, columns sorted by group), group_sizes [groups], scale [] -> [groups, k, n]: each
    group's a-columns times its b-columns transposed, scaled (zeros for an empty group)."""
    if not interpret:
        fp8_tensor_cores()
    (k, m), n, groups = a.shape, b.shape[0], group_sizes.shape[0]
    bm, bn, bk = _block(k, BLOCK_M), _block(n, BLOCK_N), _block(m, BLOCK_K)
    a, b = _pad_to(a, (bm, bk)), _pad_to(b, (bn, bk))
    kp, np_ = a.shape[0], b.shape[0]
    starts, ends = _bounds(group_sizes)
    kernel = functools.partial(_contract_kernel, block_m=bm, block_n=bn, block_k=bk)
    out = pl.pallas_call(
        kernel, out_shape=jax.ShapeDtypeStruct((groups, kp, np_), out_dtype), grid=(groups, kp // bm, np_ // bn),
        interpret=interpret, name=_NAME, compiler_params=plt.CompilerParams(num_warps=WARPS, num_stages=STAGES),
    )(starts, ends, a, b, jnp.reshape(scale, (1,)).astype(jnp.float32))
    return out[:, :k, :n]


def _transpose_kernel(w_ref, out_ref):
    out_ref[0] = w_ref[0].T


def transposed(w: jax.Array, interpret: bool = False) -> jax.Array:
    """w [groups, k, n] -> [groups, n, k], each group's matrix transposed by a kernel of its own (its operand and
    result in their plain layouts)."""
    groups, k, n = w.shape
    bk, bn = _block(k, 64), _block(n, 64)
    padded = _pad_to(w, (1, bk, bn))
    out = pl.pallas_call(
        _transpose_kernel, out_shape=jax.ShapeDtypeStruct((groups, padded.shape[2], padded.shape[1]), w.dtype),
        grid=(groups, padded.shape[1] // bk, padded.shape[2] // bn),
        in_specs=[pl.BlockSpec((1, bk, bn), lambda g, i, j: (g, i, j))],
        out_specs=pl.BlockSpec((1, bn, bk), lambda g, i, j: (g, j, i)), interpret=interpret,
        name="jaxtron_transpose", compiler_params=plt.CompilerParams(num_warps=4, num_stages=1))(padded)
    return out[:, :n, :k]
