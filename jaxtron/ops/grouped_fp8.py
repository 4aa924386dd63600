"""The expert GEMM in FP8: rows sorted by expert [m, k] times each expert's matrix [groups, k, n], with e4m3
operands in the forward and an e5m2 gradient in the backward, current scaling as in ``ops/fp8.py``: one scale for
the rows (and one for the gradient), one per expert for the weights.

Forward ``out = (x_q @ w_q[g]) * s_x * s_w[g]``; backward ``dx = (dy_q @ w_q[g]^T) * s_dy * s_w[g]`` and
``dw[g] = (x_q[g]^T @ dy_q[g]) * s_x * s_dy``, straight through the quantization.

Two implementations compute these numbers:

- 'pallas': jaxtron's two Triton kernels written in Pallas (``ops/grouped_kernels.py``), for Hopper GPUs, whose
  tensor cores multiply FP8 operands at twice the bf16 rate (tokamax's Hopper kernel takes 16-bit rows only).
- 'reference': ``grouped.matmul`` on the dequantized operands (16-bit GEMMs computing the FP8 numbers): CPUs,
  older GPUs, and the tests' reference.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxtron.ops import fp8 as fp8_ops
from jaxtron.ops import grouped
from jaxtron.ops.grouped_kernels import contract, rows
from jaxtron.ops.triton_lowering import fp8_tensor_cores

__all__ = ["contract", "fp8_tensor_cores", "matmul", "rows"]

E4M3, E5M2 = fp8_ops.E4M3, fp8_ops.E5M2


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def matmul(x: jax.Array, weights: jax.Array, group_sizes: jax.Array, implementation: str,
           interpret: bool = False) -> jax.Array:
    """rows [m, k] sorted by group, weights [groups, k, n], group_sizes [groups] -> [m, n] in the rows' dtype,
    computed in FP8 as the module says. ``implementation``: 'pallas' or a 16-bit grouped GEMM's name for the
    reference ('xla', 'tokamax'). ``interpret``: the Pallas kernels in Pallas' interpreter (tests off a GPU)."""
    return _forward(x, weights, group_sizes, implementation, interpret)[0]


def _forward(x, w, group_sizes, implementation, interpret):
    (qx, sx), (qw, sw) = fp8_ops.quantized(x, E4M3), fp8_ops.quantized_per_batch(w, E4M3)
    if implementation == "pallas":
        out = rows(qx, jnp.swapaxes(qw, 1, 2), group_sizes, sx, sw, x.dtype, interpret)
    else:
        qx, qw = _kept(qx), _kept(qw)
        out = _reference(fp8_ops.dequantize(qx, sx, x.dtype), fp8_ops.per_batch(qw.astype(x.dtype), sw), group_sizes,
                         implementation)
    return out, (qx, sx, qw, sw, group_sizes, jnp.zeros((0,), w.dtype))


def _reference(x, w, group_sizes, implementation):
    return grouped.matmul(x, w, group_sizes, implementation)


def _kept(q: jax.Array) -> jax.Array:
    """An FP8 operand of the reference path, kept FP8: XLA:GPU under its default ``xla_allow_excess_precision``
    removes a conversion to FP8 and straight back, and the reference then computed on the unrounded 16-bit values
    (3.8-6% off the FP8 numbers on an H200, ``benchmarks/grouped_errors_h200.md``). The barrier leaves the two
    conversions apart."""
    return jax.lax.optimization_barrier(q)


def _bwd(implementation, interpret, res, dy):
    qx, sx, qw, sw, group_sizes, w_like = res
    dy = grouped.zero_past_groups(dy, group_sizes)
    qg, sg = fp8_ops.quantized(dy, E5M2)
    dtype = dy.dtype
    if implementation == "pallas":
        dx = rows(qg, qw, group_sizes, sg, sw, dtype, interpret)
        dw = contract(qx.T, qg.T, group_sizes, sx * sg, jnp.float32, interpret)
    else:
        qg = _kept(qg)
        x, w = fp8_ops.dequantize(qx, sx, dtype), fp8_ops.per_batch(qw.astype(dtype), sw)
        _, pullback = jax.vjp(lambda a, b: _reference(a, b, group_sizes, implementation), x, w)
        dx, dw = pullback(fp8_ops.dequantize(qg, sg, dtype))
    return grouped.zero_past_groups(dx, group_sizes), dw.astype(w_like.dtype), None


matmul.defvjp(_forward, _bwd)

