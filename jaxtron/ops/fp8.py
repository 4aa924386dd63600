"""FP8 matmuls with per-tensor current scaling: e4m3 for activations and weights, e5m2 for gradients.

Each operand of a projection is quantized to FP8 with a scale computed from its own absolute maximum in the
same step (current scaling: no state to carry, so it works unchanged inside scanned layers, under remat and
with gradient accumulation), and dequantized right before the matmul::

    scale = amax(x) / max(fp8)          q = fp8(clip(x / scale))          x' = f(q) * scale

On Hopper GPUs XLA's GEMM rewriter folds "convert from FP8, multiply by a scalar, dot" into one cuBLASLt FP8
GEMM that takes the scales as arguments, so the matmul runs at FP8 rate; elsewhere (CPU, older GPUs) the same
program computes the same numbers with ordinary matmuls, which is what the CPU tests check.

In the backward pass the gradient arriving at a projection's output is quantized to e5m2 (wider range, for
gradients) before the two gradient matmuls; the quantization of the inputs passes gradients straight through.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxtron.parallel.state_sharding import WeightLayout, gathered_einsum

E4M3 = jnp.float8_e4m3fn  # forward operands: max 448, 3 mantissa bits
E5M2 = jnp.float8_e5m2  # gradients: max 57344, 2 mantissa bits


def fp8_max(dtype) -> float:
    return float(jnp.finfo(dtype).max)


def current_scale(x: jax.Array, dtype) -> jax.Array:
    """Per-tensor scale that maps the largest magnitude of ``x`` onto the largest finite FP8 value.

    float32 scalar; 1 for an all-zero tensor. A non-finite amax gives a non-finite scale, so an inf or nan in
    the tensor shows up in the result instead of being clipped away.
    """
    amax = jnp.max(jnp.abs(x)).astype(jnp.float32)
    return jnp.where(amax > 0, amax / fp8_max(dtype), jnp.float32(1.0))


def quantize(x: jax.Array, scale: jax.Array, dtype) -> jax.Array:
    limit = fp8_max(dtype)
    return jnp.clip(x.astype(jnp.float32) / scale, -limit, limit).astype(dtype)


def dequantize(q: jax.Array, scale: jax.Array, dtype) -> jax.Array:
    return q.astype(dtype) * scale.astype(dtype)


def quantize_dequantize(x: jax.Array, dtype) -> jax.Array:
    """``x`` rounded to the FP8 grid of its own current scale, back in ``x``'s dtype."""
    scale = jax.lax.stop_gradient(current_scale(x, dtype))
    return dequantize(quantize(x, scale, dtype), scale, x.dtype)


def quantized(x: jax.Array, dtype) -> tuple[jax.Array, jax.Array]:
    """(``x`` in FP8, its scale) with the current scale of ``x``."""
    scale = jax.lax.stop_gradient(current_scale(x, dtype))
    return quantize(x, scale, dtype), scale


def einsum(equation: str, x: jax.Array, w: jax.Array, layout: WeightLayout | None = None) -> jax.Array:
    """``jnp.einsum(equation, x, w)`` of a projection (activation ``x``, weight ``w``) as an FP8 matmul.

    Forward: both operands e4m3 with their current scales. Backward: the output gradient e5m2, times the
    e4m3 operands, for the gradients of ``x`` and ``w`` (straight through the quantization). The result has
    ``x``'s dtype. The operands are kept for the backward in FP8 with their scales, and every matmul reads
    operands dequantized right before it: the pattern XLA's GEMM rewriter turns into one FP8 GEMM with the scales
    as arguments.

    ``layout`` (``state_sharding.weight_layout``): the weight is split over fsdp, quantized where it lies and
    gathered in FP8 (half the bytes of a 16-bit gather), its gradient constrained back to its own sharding; the
    backward keeps the gathered FP8 weight or, with ``layout.regather``, its own shard, gathered again there."""
    return _einsum(equation, x, w, layout)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 3))
def _einsum(equation: str, x: jax.Array, w: jax.Array, layout: WeightLayout | None) -> jax.Array:
    return _einsum_fwd(equation, x, w, layout)[0]


def _einsum_fwd(equation, x, w, layout):
    (qx, sx), (qw, sw) = quantized(x, E4M3), quantized(w, E4M3)
    used = qw if layout is None else layout.gathered(qw)
    out = jnp.einsum(equation, dequantize(qx, sx, x.dtype), dequantize(used, sw, x.dtype))
    kept = layout.scattered(qw) if layout is not None and layout.regather else used  # the shard, held as the weight
    return out, (qx, sx, kept, sw, jnp.zeros((0,), w.dtype))


def _einsum_bwd(equation, layout, res, g):
    qx, sx, qw, sw, w_like = res
    if layout is not None and layout.regather:
        qw = layout.gathered(qw)
    qg, sg = quantized(g, E5M2)
    dtype = g.dtype
    _, vjp = jax.vjp(lambda a, b: jnp.einsum(equation, a, b), dequantize(qx, sx, dtype),
                     dequantize(qw, sw, dtype))
    dx, dw = vjp(dequantize(qg, sg, dtype))
    dw = dw.astype(w_like.dtype)
    return dx, dw if layout is None else layout.scattered(dw)


_einsum.defvjp(_einsum_fwd, _einsum_bwd)


def quantized_per_batch(w: jax.Array, dtype) -> tuple[jax.Array, jax.Array]:
    """(``w`` in FP8, one scale per index of its leading dimension [B]) with each slice's current scale."""
    scale = jax.lax.stop_gradient(jax.vmap(lambda a: current_scale(a, dtype))(w))
    return quantize(w, scale.reshape(-1, *(1,) * (w.ndim - 1)), dtype), scale


def per_batch(x: jax.Array, scale: jax.Array) -> jax.Array:
    return x * scale.reshape(-1, *(1,) * (x.ndim - 1)).astype(x.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def batched_einsum(equation: str, x: jax.Array, w: jax.Array) -> jax.Array:
    """``jnp.einsum(equation, x, w)`` of a batched projection whose batch dimension leads all three operands (the
    experts of capacity mode: "emd,edf->emf"), as FP8 matmuls with one current scale for ``x`` and one per batch
    index for ``w`` (each expert's weights on their own grid). The per-index scale multiplies the result rather
    than the operand, so XLA still folds the rest into one batched cuBLASLt FP8 GEMM, whose scales are scalars.
    Backward as ``einsum``'s: the output gradient e5m2 times the e4m3 operands."""
    return _batched_fwd(equation, x, w)[0]


def _batched_fwd(equation, x, w):
    (qx, sx), (qw, sw) = quantized(x, E4M3), quantized_per_batch(w, E4M3)
    out = per_batch(jnp.einsum(equation, dequantize(qx, sx, x.dtype), qw.astype(x.dtype)), sw)
    return out, (qx, sx, qw, sw, jnp.zeros((0,), w.dtype))


def _batched_bwd(equation, res, g):
    qx, sx, qw, sw, w_like = res
    qg, sg = quantized(g, E5M2)
    dtype = g.dtype
    _, vjp = jax.vjp(lambda a, b: jnp.einsum(equation, a, b), dequantize(qx, sx, dtype), qw.astype(dtype))
    dx, dw = vjp(dequantize(qg, sg, dtype))  # dx against the unscaled weights: each expert's scale after it
    return per_batch(dx, sw), dw.astype(w_like.dtype)


batched_einsum.defvjp(_batched_fwd, _batched_bwd)


# The XLA options a program with FP8 projections compiles with, for its GEMMs to take float8 operands. Evidence: the
# default config's step (execution.fp8=true, bf16) compiled for the H100 target (jax 0.10.2, cuDNN 9.28), counting
# its block projections' GEMMs, forward and both backward (21): with XLA's defaults none reads float8.
COMPILER_OPTIONS = {
    # Triton GEMM fusions read the dequantized 16-bit operands: with them, 0 of 21 GEMMs took float8; with cuBLASLt
    # GEMMs (this option) the rewriter folds "convert from FP8, scale, dot" into an FP8 GEMM: 11 of 21
    "xla_gpu_enable_triton_gemm": False,
    # dot-merger joins the projections that share an input (q, k, v; gate and up) into one GEMM on concatenated
    # dequantized weights, which no FP8 GEMM takes: without it, 21 of 21
    "xla_disable_hlo_passes": "dot-merger",
}


def compiler_options(fp8: bool) -> dict[str, object]:
    """The XLA options of a program with (``fp8``) or without this recipe's FP8 projections."""
    return dict(COMPILER_OPTIONS) if fp8 else {}


def projection(fp8: bool):
    """The einsum a projection uses, ``(equation, x, w, layout)``: FP8 or plain
    (``state_sharding.gathered_einsum``), each gathering a weight split over fsdp as ``layout`` says."""
    return einsum if fp8 else gathered_einsum
