"""A projection: one weight and everything that decides how a matmul uses it.

A ``Projection`` maps ``x [..., *inputs]`` to ``[..., *outputs]`` with a float32 weight ``[*inputs, *outputs]``
that carries one logical name per dimension. It owns:

- the compute cast: the weight in ``execution.dtype`` (under the ``weight_cast`` scope the step's budget reads);
- the low-precision recipe (``execution.fp8_recipe``): FP8 with current scaling (``ops/fp8.py``) inside
  ``fp8_recipe("tensorwise")``, DeepSeek-V3's tiles (``ops/blockwise_fp8.py``), MXFP8 (``ops/block_scaled.py``) or
  NVFP4 (``ops/nvfp4.py``) blocks inside theirs; the layer stack opens it around the blocks of an FP8 layer span;
- the FSDP gather layout (``state_sharding.weight_layout``): a weight split over fsdp is gathered for use;
- its LoRA adapters (``lora_a``, ``lora_b``, ``models/lora.py`` adds them), their scale and dropout;
- with ``bias``, a bias over its outputs (gpt-oss's attention).

Model code reads ``self.wq(x)``. Stacked layers hold their projections stacked too: ``layers.attn.wq.weight``.
Checkpoints of the older layout, whose weights sat directly under their module (``layers.attn.wq``), load through
``jaxtron.checkpoint.layouts``.
"""

from __future__ import annotations

import contextlib
import string
from collections.abc import Iterator, Sequence

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from jaxtron.common.trace_state import FP8_RECIPE, LORA_DROPOUT_KEY
from jaxtron.models.layers import param
from jaxtron.ops import block_scaled, blockwise_fp8, nvfp4
from jaxtron.ops import fp8 as fp8_ops
from jaxtron.parallel.sharding import logical_names
from jaxtron.parallel.state_sharding import gathered_einsum, weight_layout

# the FP8 recipes a projection computes (execution.fp8_recipe) and the einsum of each, (equation, x, w, layout)
PROJECTION_OUTPUT = "projection_output"  # a recipe's output, which the checkpoint policies that keep dots keep
RECIPES = {"tensorwise": fp8_ops.einsum, "blockwise": blockwise_fp8.einsum, "mxfp8": block_scaled.einsum,
           "nvfp4": nvfp4.einsum}


class Adapter(nnx.Param):
    """A LoRA matrix: the only parameters a LoRA run trains."""


class Seed(nnx.Param):
    """Each stacked layer's number for its adapters' dropout masks (an integer: never trained)."""


@contextlib.contextmanager
def fp8_recipe(recipe: str | None) -> Iterator[None]:
    """Within this block (while tracing) projections and expert GEMMs compute with the FP8 ``recipe`` (None:
    in the compute dtype)."""
    if recipe is not None and recipe not in RECIPES:
        raise ValueError(f"fp8_recipe takes one of {tuple(RECIPES)} or None, not {recipe!r}")
    with FP8_RECIPE.bound(recipe):
        yield


def fp8_enabled() -> bool:
    """Whether the block being traced computes its matmuls in FP8 (``fp8_recipe``)."""
    return FP8_RECIPE.get() is not None


def equation(x_ndim: int, inputs: int, outputs: int) -> str:
    """The einsum of a projection: ``x``'s last ``inputs`` dimensions contracted with the weight's first ones."""
    letters = string.ascii_lowercase
    lead = x_ndim - inputs
    batch, contracted = letters[:lead], letters[lead:x_ndim]
    out = letters[x_ndim:x_ndim + outputs]
    return f"{batch}{contracted},{contracted}{out}->{batch}{out}"


class Projection(nnx.Module):
    """``x [..., *inputs] -> [..., *outputs]`` through a weight of shape ``(*inputs, *outputs)`` named ``names``
    (one logical name per dimension), drawn from N(0, std^2), computed in ``dtype``."""

    def __init__(self, rngs: nnx.Rngs, inputs: Sequence[int], outputs: Sequence[int], names: Sequence[str | None],
                 std: float, dtype, bias: bool = False):
        self.weight = param(rngs, (*inputs, *outputs), names, std)
        # a bias over the outputs, zero at the start; its last axis is named 'bias' (no weight decay, not one of
        # Muon's matrices), the others as the weight's outputs ([heads, bias] for a query bias)
        bias_names = (*names[len(inputs):-1], "bias")
        self.bias = nnx.Param(jnp.zeros(tuple(outputs), jnp.float32), out_sharding=bias_names) if bias else None
        self.inputs, self.outputs = len(inputs), len(outputs)
        self.dtype = jnp.dtype(dtype)
        # LoRA, which models/lora.py adds: A [*inputs, rank] and B [rank, *outputs] (data, though None until then)
        self.lora_a: Adapter | None = nnx.data(None)
        self.lora_b: Adapter | None = nnx.data(None)
        self.lora_scale = 0.0  # alpha / rank
        self.lora_dropout = 0.0
        self.lora_seed: Seed | None = nnx.data(None)  # with dropout: the layer's number, stacked as the weight is
        self.lora_tag = 0  # with dropout: this projection's number among its module's

    def __call__(self, x: jax.Array) -> jax.Array:
        with jax.named_scope("weight_cast"):
            w = self.weight[...].astype(self.dtype)
        layout = weight_layout(logical_names(self.weight), w.ndim)
        eq = equation(x.ndim, self.inputs, self.outputs)
        recipe = FP8_RECIPE.get()
        y = gathered_einsum(eq, x, w, layout) if recipe is None else checkpoint_name(
            RECIPES[recipe](eq, x, w, layout), PROJECTION_OUTPUT)
        if self.bias is not None:
            y = y + self.bias[...].astype(self.dtype)
        if self.lora_a is None:
            return y
        return y + jnp.asarray(self.lora_scale, self.dtype) * self._low_rank(x)

    def _low_rank(self, x: jax.Array) -> jax.Array:
        """``(drop(x) A) B``, both in the compute dtype; dropout only inside ``lora.dropout`` (a training step)."""
        key = LORA_DROPOUT_KEY.get()
        if self.lora_dropout and key is not None:
            key = jax.random.fold_in(jax.random.fold_in(key, self.lora_seed[...]), self.lora_tag)
            keep = jax.random.bernoulli(key, 1.0 - self.lora_dropout, x.shape)
            x = jnp.where(keep, x / jnp.asarray(1.0 - self.lora_dropout, x.dtype), jnp.zeros((), x.dtype))
        a, b = self.lora_a[...].astype(self.dtype), self.lora_b[...].astype(self.dtype)
        h = jnp.einsum(equation(x.ndim, self.inputs, 1), x, a)
        return jnp.einsum(equation(h.ndim, 1, self.outputs), h, b)
