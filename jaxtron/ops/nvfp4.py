"""NVFP4 (``execution.fp8_recipe='nvfp4'``): NVIDIA's published recipe for training in 4 bits on Blackwell.

The format: E2M1 elements (0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives) in blocks of 16, each block with an
e4m3 scale, and one float32 scale a tensor (its absolute maximum over 6 x 448, so every block's scale fits e4m3).
The recipe:

- weights in 16 x 16 blocks: one quantization serves the forward and the input gradient, which reads it
  transposed;
- activations and gradients in 1 x 16 blocks along the dimension each GEMM contracts;
- the gradients (the input gradient's and the weight gradient's ``dy``) rounded stochastically, the rest to the
  nearest value;
- a random Hadamard transform on the weight gradient's two operands along the tokens: blocks of 16 tokens times
  one fixed 16 x 16 orthogonal matrix (signs drawn once, then Hadamard's). The same transform on both sides of
  the contraction leaves the product alone in exact arithmetic and spreads an outlier over its block before it is
  quantized.

Stochastic rounding draws its threshold from a hash of each value's leading 24 bits: no generator state to carry,
the same draw on resume and, but where a sum in another order crosses one of those bits, on every mesh. The last blocks
in 16 bits, as the recipe keeps them, are ``execution.fp8_skip_layers``.

On a GPU each GEMM is ``jax.nn.scaled_matmul`` on E2M1 operands and e4m3 scales, cuDNN's block-scaled GEMM on
Blackwell (which alone has FP4 tensor cores); its float32 output times the two tensors' scales. On the CPU the
same quantized operands run dequantized. Blocks and shards align as MXFP8's do (``ops/block_scaled.py``), in 16s.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxtron.ops.block_scaled import projection, recipe_einsum

BLOCK = 16
E2M1_MAX, E4M3_MAX = 6.0, 448.0
SIGNS_SEED = 0  # the Hadamard transform's random signs


def tensor_scale(x: jax.Array) -> jax.Array:
    """The float32 scale of a whole tensor: its absolute maximum over 6 x 448 (1 for an all-zero one)."""
    amax = jnp.max(jnp.abs(x)).astype(jnp.float32)
    return jnp.where(amax > 0, amax / (E2M1_MAX * E4M3_MAX), 1.0)


def _uniform(v: jax.Array) -> jax.Array:
    """A number in [0, 1) from each float32's top 24 bits (a 32-bit mixing hash): stochastic rounding's threshold.
    The 8 bits below are left out: a value that a sum in another order moves by a few ulps (another mesh) keeps
    its draw but for 1 in 256 or so; with 16 bits, values within a bfloat16 step shared one draw, too few for an
    unbiased rounding (tests/test_nvfp4.py)."""
    h = jax.lax.bitcast_convert_type(v, jnp.uint32) >> 8
    h = (h ^ (h >> 16)) * jnp.uint32(0x7FEB352D)
    h = (h ^ (h >> 15)) * jnp.uint32(0x846CA68B)
    h = h ^ (h >> 16)
    return (h >> 8).astype(jnp.float32) * (1.0 / (1 << 24))


def round_e2m1(v: jax.Array, stochastic: bool) -> jax.Array:
    """``v`` (within [-6, 6]) to E2M1: to the nearest value (a tie to the one with an even mantissa: 0, 1, 2 or 4),
    or up with probability its distance from the value below over the gap. Rounded in float32 arithmetic, then
    cast exactly: XLA:CPU's unoptimized conversion rounds twice (2.5007 to 2)."""
    a = jnp.abs(v)
    # E2M1's magnitudes are evenly spaced within [0, 2], [2, 4] and [4, 6]: steps of 0.5, 1 and 2 (elementwise
    # arithmetic: a search of the grid cost Llama-3 8B's B200 step 77 ms of gathers at 4 layers)
    step = jnp.where(a < 2.0, 0.5, jnp.where(a < 4.0, 1.0, 2.0))
    low = jnp.minimum(jnp.floor(a / step) * step, E2M1_MAX)
    high = jnp.minimum(low + step, E2M1_MAX)
    frac = (a - low) / step
    if stochastic:
        up = _uniform(v) < frac
    else:
        even_high = (high == 1.0) | (high == 2.0) | (high == 4.0)
        up = (frac > 0.5) | ((frac == 0.5) & even_high)
    return (jnp.sign(v) * jnp.where(up, high, low)).astype(jnp.float4_e2m1fn)


def quantized(x: jax.Array, scale: jax.Array, stochastic: bool = False, rows: int = 1):
    """``x`` [R, K] in E2M1 and its block scales [R, K / 16] (e4m3 values, float32) under the tensor's ``scale``:
    blocks of ``rows`` x 16 (1 for activations and gradients, 16 for weights; each row keeps its block's scale)."""
    r, k = x.shape
    b = x.astype(jnp.float32).reshape(r // rows, rows, k // BLOCK, BLOCK)
    block = jnp.max(jnp.abs(b), axis=(1, 3), keepdims=True) / E2M1_MAX / scale
    block = block.astype(jnp.float8_e4m3fn).astype(jnp.float32)  # the scale as the GEMM reads it
    v = jnp.clip(b / jnp.where(block > 0, block * scale, 1.0), -E2M1_MAX, E2M1_MAX)
    q = round_e2m1(v, stochastic).reshape(r, k)
    return q, jnp.broadcast_to(block, (r // rows, rows, k // BLOCK, 1)).reshape(r, k // BLOCK)


def dequantized(q: jax.Array, block: jax.Array, scale: jax.Array) -> jax.Array:
    """``quantized``'s inverse in float32."""
    r, k = q.shape
    return (q.astype(jnp.float32).reshape(r, k // BLOCK, BLOCK) * block[..., None] * scale).reshape(r, k)


def _gemm(qa, sa, ga, qb, sb, gb):
    """qa [M, K] qb [N, K] E2M1 with block scales and tensor scales -> qa qb^T [M, N] float32."""
    def on_gpu(qa, sa, qb, sb):
        scales = (s.astype(jnp.float8_e4m3fn)[None] for s in (sa, sb))
        return jax.nn.scaled_matmul(qa[None], qb[None], *scales, preferred_element_type=jnp.float32)[0]

    def emulated(qa, sa, qb, sb):
        return jnp.dot(dequantized(qa, sa, 1.0), dequantized(qb, sb, 1.0).T, preferred_element_type=jnp.float32)

    return jax.lax.platform_dependent(qa, sa, qb, sb, cuda=on_gpu, default=emulated) * (ga * gb)


def gemm(a: jax.Array, b: jax.Array, dtype, a_rounding: bool = False, b_rounding: bool = False,
         weight: str | None = None) -> jax.Array:
    """``a [M, K] @ b [N, K]^T`` in ``dtype``, each in 1 x 16 blocks along K (``*_rounding``: stochastic); with
    ``weight`` ('rows' or 'columns') ``b`` is a weight in 16 x 16 blocks, laid out as stored or transposed."""
    ga, gb = tensor_scale(a), tensor_scale(b)
    qa, sa = quantized(a, ga, a_rounding)
    if weight is None:
        qb, sb = quantized(b, gb, b_rounding)
    elif weight == "rows":
        qb, sb = quantized(b, gb, rows=BLOCK)
    else:  # the weight as stored is b^T [K, N]: its 16 x 16 blocks, read transposed
        qt, st = quantized(b.T, gb, rows=BLOCK)
        qb, sb = qt.T, jnp.repeat(st[::BLOCK].T, BLOCK, axis=0)
    return _gemm(qa, sa, ga, qb, sb, gb).astype(dtype)


@functools.cache
def hadamard() -> np.ndarray:
    """The transform's 16 x 16 orthogonal matrix: random signs (``SIGNS_SEED``) times Hadamard's, over 4."""
    h = np.array([[1.0]])
    while h.shape[0] < BLOCK:
        h = np.block([[h, h], [h, -h]])
    signs = np.random.default_rng(SIGNS_SEED).choice([-1.0, 1.0], BLOCK)
    return (signs[:, None] * h / math.sqrt(BLOCK)).astype(np.float32)


def transformed(a: jax.Array) -> jax.Array:
    """``a`` [R, M] with each block of 16 along M times ``hadamard()``."""
    r, m = a.shape
    return jnp.einsum("rbt,ts->rbs", a.astype(jnp.float32).reshape(r, m // BLOCK, BLOCK),
                      jnp.asarray(hadamard())).reshape(r, m)


def _weight_gradient(xt: jax.Array, gt: jax.Array, dtype) -> jax.Array:
    """Both operands through the same transform along the tokens, the gradient rounded stochastically."""
    return gemm(transformed(xt), transformed(gt), dtype, b_rounding=True)


# the weight's 16 x 16 blocks read as stored, then transposed; the gradients rounded stochastically
scaled_einsum = projection(functools.partial(gemm, weight="columns"),
                           functools.partial(gemm, a_rounding=True, weight="rows"), _weight_gradient)
einsum = recipe_einsum(scaled_einsum)
