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

import jax
import jax.numpy as jnp

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


@jax.custom_vjp
def _operand(x: jax.Array) -> jax.Array:
    return quantize_dequantize(x, E4M3)


def _operand_fwd(x):
    return _operand(x), None


def _operand_bwd(_, g):
    return (g,)  # straight through: the gradient wrt the unquantized operand


_operand.defvjp(_operand_fwd, _operand_bwd)


@jax.custom_vjp
def _gradient_point(y: jax.Array) -> jax.Array:
    return y


def _gradient_point_fwd(y):
    return y, None


def _gradient_point_bwd(_, g):
    return (quantize_dequantize(g, E5M2),)


_gradient_point.defvjp(_gradient_point_fwd, _gradient_point_bwd)


def einsum(equation: str, x: jax.Array, w: jax.Array) -> jax.Array:
    """``jnp.einsum(equation, x, w)`` of a projection (activation ``x``, weight ``w``) as an FP8 matmul.

    Forward: both operands e4m3 with their current scales. Backward: the output gradient e5m2, times the
    e4m3 operands, for the gradients of ``x`` and ``w``. The result has ``x``'s dtype.
    """
    return _gradient_point(jnp.einsum(equation, _operand(x), _operand(w)))


def projection(fp8: bool):
    """The einsum a projection uses: FP8 or plain."""
    return einsum if fp8 else jnp.einsum
