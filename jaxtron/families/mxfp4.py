"""MXFP4, the format of gpt-oss's published expert weights (OCP Microscaling, MX v1.0): blocks of 32 values, each
value a 4-bit float e2m1 and each block one 8-bit power-of-two scale e8m0.

A checkpoint stores a tensor as ``*_blocks`` [..., G, 16] uint8, two values a byte (the low nibble first), and
``*_scales`` [..., G] uint8 (the exponent plus 127). ``dequantize`` gives the values [..., G * 32] in float32,
which is exact: every e2m1 value times a power of two is a float32.
"""

from __future__ import annotations

import numpy as np

# the 16 e2m1 codes: sign bit, two exponent bits, one mantissa bit (no infinity, no NaN)
E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32)
BLOCK = 32  # values a scale covers
SCALE_BIAS = 127  # e8m0: the scale is 2 ** (byte - 127)


def dequantize(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """float32 [..., G * 32] of MXFP4 ``blocks`` [..., G, 16] (uint8) and ``scales`` [..., G] (uint8)."""
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != BLOCK // 2:
        raise ValueError(f"MXFP4 blocks {blocks.shape} and scales {scales.shape} do not pair up ([..., G, 16] and "
                         "[..., G])")
    codes = np.empty((*blocks.shape[:-1], BLOCK), np.uint8)
    codes[..., 0::2] = blocks & 0x0F
    codes[..., 1::2] = blocks >> 4
    values = np.ldexp(E2M1[codes], scales.astype(np.int32)[..., None] - SCALE_BIAS)
    return values.reshape(*blocks.shape[:-2], blocks.shape[-2] * BLOCK)
