"""Block-scaled matmuls: MXFP8, the OCP microscaling format Blackwell's tensor cores take (``execution.fp8_recipe
='mxfp8'``).

Each operand of a GEMM is quantized in blocks of 32 consecutive elements along the dimension that GEMM contracts.
A block's scale is a power of two (e8m0): its absolute maximum over 448, rounded up to the next power of two, so no
element clips. Its elements are e4m3. Every GEMM of a projection quantizes its own operands along its own
contracted dimension, as Transformer Engine's MXFP8 recipe does:

- forward, ``x @ w``: ``x`` and ``w`` in blocks along the input features;
- input gradient, ``dy @ w^T``: ``dy`` and ``w`` in blocks along the output features;
- weight gradient, ``x^T @ dy``: ``x`` and ``dy`` in blocks along the tokens.

The backward keeps the 16-bit ``x`` and ``w`` and quantizes them again along the new contracted dimensions. On a
GPU each GEMM is ``jax.nn.scaled_matmul``, which XLA compiles into cuDNN's block-scaled GEMM on Blackwell
(``__cudnn$blockScaledDot``). On the CPU, which has no such kernel, the same quantized operands are dequantized
and multiplied in float32: the numbers the CPU tests check (``jax.lax.platform_dependent`` picks the form).

Blocks and shards. A block must lie on one device, or a mesh would quantize other groups of elements than one
device does. It does when each device's share of every contracted dimension is a multiple of 32: the input
features (whole where used, or split over ``tensor`` for the output projections), the output features (split
over ``tensor`` for the others), and the tokens (each row's ``seq_len / sequence`` of them, rows never mixed).
``config/schema.py`` and ``parallel/checks.py`` refuse a model or a mesh that breaks this.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp

from jaxtron.parallel.sharding import shard_count
from jaxtron.parallel.state_sharding import gathered_einsum

BLOCK = 32  # MXFP8's elements a scale: OCP MX v1.0
E4M3_MAX = 448.0
MIN_EXPONENT = -126  # the smallest scale kept, 2^-126 (float32's smallest normal): an all-zero block's


def dimension_numbers(equation: str) -> tuple[int, int]:
    """(``x``'s kept dimensions, the contracted ones) of a projection's einsum ``equation``: ``x``'s trailing
    dimensions contracted with ``w``'s leading ones, the output ``x``'s kept then ``w``'s; a ValueError else."""
    inputs, out = equation.split("->")
    lhs, rhs = inputs.split(",")
    shared = "".join(c for c in lhs if c in rhs)
    kept = lhs[:len(lhs) - len(shared)]
    if not (lhs.endswith(shared) and rhs.startswith(shared) and out == kept + rhs[len(shared):]):
        raise ValueError(f"{equation!r} is not a projection's einsum (x's last dimensions with w's first ones)")
    return len(kept), len(shared)


def block_scales(x: jax.Array) -> jax.Array:
    """One power-of-two scale per block of ``BLOCK`` along ``x``'s last axis [..., K / BLOCK], float32: the
    block's absolute maximum over 448 rounded up (exactly, by its float exponent)."""
    blocks = x.astype(jnp.float32).reshape(*x.shape[:-1], x.shape[-1] // BLOCK, BLOCK)
    ratio = jnp.max(jnp.abs(blocks), axis=-1) / E4M3_MAX
    mantissa, exponent = jnp.frexp(ratio)  # ratio = mantissa 2^exponent, mantissa in [0.5, 1)
    exponent = jnp.where(mantissa == 0.5, exponent - 1, exponent)  # an exact power of two is its own scale
    # 2^exponent built from its bits (XLA's exp2 is not exact on every backend)
    biased = (jnp.maximum(exponent, MIN_EXPONENT) + 127).astype(jnp.uint32) << 23
    return jax.lax.bitcast_convert_type(biased, jnp.float32)


def quantized(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(``x`` in e4m3, ``block_scales``) of ``x`` along its last axis."""
    scale = block_scales(x)
    blocks = x.astype(jnp.float32).reshape(*x.shape[:-1], x.shape[-1] // BLOCK, BLOCK)
    return (blocks / scale[..., None]).astype(jnp.float8_e4m3fn).reshape(x.shape), scale


def dequantized(q: jax.Array, scale: jax.Array) -> jax.Array:
    """``quantized``'s inverse in float32: each block's elements times its scale."""
    blocks = q.astype(jnp.float32).reshape(*q.shape[:-1], q.shape[-1] // BLOCK, BLOCK)
    return (blocks * scale[..., None]).reshape(q.shape)


def gemm(a: jax.Array, b: jax.Array, dtype) -> jax.Array:
    """``a [M, K] @ b [N, K]^T`` in ``dtype``, both operands quantized in blocks along K."""
    (qa, sa), (qb, sb) = quantized(a), quantized(b)

    def on_gpu(qa, sa, qb, sb):
        scales = (s.astype(jnp.float8_e8m0fnu)[None] for s in (sa, sb))
        return jax.nn.scaled_matmul(qa[None], qb[None], *scales, preferred_element_type=dtype)[0]

    def emulated(qa, sa, qb, sb):
        out = jnp.dot(dequantized(qa, sa), dequantized(qb, sb).T, preferred_element_type=jnp.float32)
        return out.astype(dtype)

    return jax.lax.platform_dependent(qa, sa, qb, sb, cuda=on_gpu, default=emulated)


def row_pieces(lead: tuple[int, ...]) -> int:
    """Into how many pieces the mesh in context cuts a row's tokens (``activation_length``), for kept dimensions
    ``lead`` = [batch, length, ...]; 1 without a mesh, or where the length does not divide."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or len(lead) < 2:
        return 1
    pieces = shard_count(dict(mesh.shape), "activation_length")
    return pieces if lead[1] % pieces == 0 else 1


def as_rows(x: jax.Array, kept: int) -> jax.Array:
    """``x``'s kept dimensions [batch, length, ...] as one of rows, the length's pieces outermost.

    Merging a batch split over data with a length split over sequence has no tiled layout: XLA would gather every
    token onto every device (a whole-sequence GEMM on each, measured on sequence=2). With the pieces outermost,
    each device's rows are one contiguous block. A piece keeps its tokens in order, so tiles along the tokens
    group what one device's do."""
    lead, pieces = x.shape[:kept], row_pieces(x.shape[:kept])
    if pieces > 1:
        x = jnp.swapaxes(x.reshape(lead[0], pieces, lead[1] // pieces, *x.shape[2:]), 0, 1)
    return x.reshape(math.prod(lead), *x.shape[kept + (pieces > 1):])


def from_rows(y: jax.Array, lead: tuple[int, ...]) -> jax.Array:
    """``as_rows``' inverse: rows [M, ...] back to ``lead`` [batch, length, ...]."""
    pieces = row_pieces(lead)
    if pieces == 1:
        return y.reshape(*lead, *y.shape[1:])
    rest = y.shape[1:]
    y = y.reshape(pieces, lead[0], lead[1] // pieces, *lead[2:], *rest)
    return jnp.swapaxes(y, 0, 1).reshape(*lead, *rest)


def as_matrices(equation: str, x: jax.Array, w: jax.Array) -> tuple:
    """A projection's operands as matrices: (``x`` [M, K] in ``as_rows``' order, ``w`` [K, N] in ``x``'s dtype,
    ``x``'s kept shape, ``w``'s output shape)."""
    kept, contracted = dimension_numbers(equation)
    k = math.prod(x.shape[kept:])
    rows = as_rows(x, kept)
    return rows.reshape(rows.shape[0], k), w.astype(x.dtype).reshape(k, -1), x.shape[:kept], w.shape[contracted:]


def projection(forward: Callable, input_gradient: Callable, weight_gradient: Callable) -> Callable:
    """``scaled_einsum(equation, x, w)``: a projection's einsum whose three GEMMs are a recipe's, each ``(a [M, K],
    b [N, K], dtype) -> a b^T`` quantizing along K: ``forward(x, w^T)``, ``input_gradient(dy, w)`` and
    ``weight_gradient(x^T, dy^T)`` (float32). The backward keeps the 16-bit ``x`` and ``w``; the result has
    ``x``'s dtype."""
    @functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
    def scaled_einsum(equation: str, x: jax.Array, w: jax.Array) -> jax.Array:
        return _forward(equation, x, w)[0]

    def _forward(equation, x, w):
        x2, w2, lead, tail = as_matrices(equation, x, w)
        y = forward(x2, w2.T, x.dtype)
        return from_rows(y.reshape(y.shape[0], *tail), lead), (x, w)

    def _backward(equation, res, g):
        x, w = res
        x2, w2, lead, _ = as_matrices(equation, x, w)
        g2 = as_rows(g, len(lead)).reshape(x2.shape[0], w2.shape[1])
        dx = input_gradient(g2, w2, x.dtype)  # [M, N] x [K, N]^T: along the output features
        dw = weight_gradient(x2.T, g2.T, jnp.float32)  # [K, M] x [N, M]^T: along the tokens
        return from_rows(dx, lead).reshape(x.shape), dw.reshape(w.shape).astype(w.dtype)

    scaled_einsum.defvjp(_forward, _backward)
    return scaled_einsum


def recipe_einsum(scaled_einsum: Callable) -> Callable:
    """A projection's ``einsum(equation, x, w, layout)`` by ``scaled_einsum``, the weight gathered for use as
    ``layout`` says (``state_sharding.gathered_einsum``): in 16 bits, quantized where it is used."""
    return functools.partial(gathered_einsum, matmul=scaled_einsum)


# MXFP8: every GEMM's operands in 32-element blocks along its contraction
scaled_einsum = projection(gemm, gemm, gemm)
einsum = recipe_einsum(scaled_einsum)
