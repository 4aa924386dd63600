"""Capacity mode's expert GEMMs under a block-scaled FP8 recipe (``execution.fp8_recipe`` 'blockwise', 'mxfp8' or
'nvfp4'): each expert's slots times its matrix, as the recipe computes a projection (forward and both gradients),
the experts batched by ``jax.vmap``. Dropless mode's grouped GEMM takes blockwise only (``ops/grouped_blockwise.py``):
XLA's ragged dot takes no scales.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxtron.config.recipes import RECIPE_BLOCKS
from jaxtron.ops import block_scaled, blockwise_fp8, nvfp4

# a block-scaled recipe's GEMM of one expert
EXPERT_RECIPES = {"blockwise": blockwise_fp8.scaled_einsum, "mxfp8": block_scaled.scaled_einsum,
                  "nvfp4": nvfp4.scaled_einsum}


def expert_einsum(recipe: str, equation: str, x: jax.Array, w: jax.Array) -> jax.Array:
    """Capacity mode's batched GEMM ``equation`` ("emd,edf->emf": experts lead) as each expert's GEMM by the
    block-scaled ``recipe``. The slots are padded with zero rows to whole blocks: the weight gradient contracts
    over them, and zeros change no block's maximum."""
    per_expert = equation.replace("e", "")
    m = x.shape[1]
    x = jnp.pad(x, ((0, 0), (0, -m % RECIPE_BLOCKS[recipe]), (0, 0)))
    return jax.vmap(lambda a, b: EXPERT_RECIPES[recipe](per_expert, a, b))(x, w)[:, :m]
