"""The step's working copy of the parameters under the distributed optimizer (``optimizer.distributed``).

There the float32 parameters are masters, split over the batch's axes as the moments are
(``state_sharding.optimizer_spec``): each device updates only its shard. A step gathers them once, each projection
weight already in its compute dtype, and every microbatch reads that copy. Before, the masters were held whole
over the batch's axes and every microbatch cast them again. GPT-3 175B's published layout (pipeline=8 data=4
tensor=4, 64 pipeline microbatches, H100 target) spent 2.6 s of its 69.3 s budget on those casts.

The gradients come back in the masters' dtypes: ``as_masters`` casts them (float32 sums stay float32). With a
float32 compute dtype the copy holds the masters' values exactly, so the losses are unchanged.
"""

from __future__ import annotations

from typing import Any

import jax

from jaxtron.models import lora
from jaxtron.models.stack import compute_weights
from jaxtron.parallel.state_sharding import constrain_variables


def working_copy(graphdef: Any, masters: Any) -> Any:
    """The parameters a step computes with: each projection weight used as stored cast to its compute dtype
    (``stack.compute_weights``), everything held in its parameter's layout (gathered over the batch's axes). A
    weight split over the batch's axes for use (fsdp) keeps its dtype: the model casts it where it gathers it."""
    with jax.named_scope("working_copy"):
        # cast where the masters lie, then gathered: left to XLA, Llama-3.1 405B's layout (the masters split over
        # data x sequence) gathered part of each stage weight in float32 before the cast
        cast = constrain_variables(compute_weights(graphdef, masters), optimizer=True)
        return constrain_variables(cast)


def as_masters(grads: Any, masters: Any) -> Any:
    """Gradients of the working copy in the dtypes of the masters they update (LoRA: of the adapters alone)."""
    trainable, _ = lora.split(masters)
    return jax.tree.map(lambda g, m: g.astype(m.dtype), grads, trainable)


def master_shapes(grads: Any, masters: Any) -> Any:
    """``grads``' shapes with the masters' dtypes: the accumulators' of a step's microbatches."""
    trainable, _ = lora.split(masters)
    return jax.tree.map(lambda g, m: jax.ShapeDtypeStruct(g.shape, m.dtype), grads, trainable)
