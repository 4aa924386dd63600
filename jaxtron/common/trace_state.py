"""Values set for the extent of a ``with`` block while a program is traced, all of them here and all one kind: a
``TraceState`` (a context variable, so that nested blocks and threads each see their own). The code that sets one
names it; the code that reads one asks ``get()``. Explicit arguments are the rule; these are the exceptions, where
the value must cross the model's own code (a Flax module's call) that neither sets nor reads it.

- ``BATCH_OVER_STAGES``: the rows of ``activation_batch`` also split over the pipeline's axes (the work outside a
  pipeline schedule). Set by ``training.pipeline.fill_drain.Schedule.outside``; read by
  ``parallel.sharding.logical_to_spec``.
- ``AXES_TAKEN``: mesh axes an enclosing ``vmap(..., spmd_axis_name=...)`` holds, which no logical name may map onto.
  Set by ``parallel.sharding.axes_taken`` (``replica_map``); read by ``logical_to_spec``.
- ``GATHER_FOR_USE``: how projections gather their fsdp-split weights (None, "keep", "regather"). Set by
  ``parallel.state_sharding.gathering_for_use`` (the layer stack's block function); read by ``weight_layout``.
- ``WITHOUT_REMAT``: the stack's blocks run without checkpoints (the 1F1B schedule's explicit backward). Set by
  ``models.stack.without_remat``; read by the stack's block function.
- ``LORA_DROPOUT_KEY``: the random key of the adapters' dropout masks. Set by ``models.lora.dropout`` (the train
  step); read by ``models.projection.Projection``.
- ``FP8_RECIPE``: the FP8 recipe the blocks being traced compute their matmuls with (None: the compute dtype). Set
  by ``models.projection.fp8_recipe`` (the layer stack's block function, for an FP8 layer span); read by
  ``Projection`` and the MoE block's expert GEMMs.
- ``EXPERT_GEMM_TARGET``: the compile-only GPU a program is compiled for. Set by ``ops.grouped.on_target`` (the
  dry run); read by ``ops.grouped.target_gpu``.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import Any


class TraceState:
    """A value that a ``with state.bound(value):`` block sets for its extent, and ``get()`` reads."""

    def __init__(self, name: str, default: Any = None):
        self.name = name
        self._var = contextvars.ContextVar(name, default=default)

    def get(self) -> Any:
        return self._var.get()

    @contextlib.contextmanager
    def bound(self, value: Any) -> Iterator[None]:
        token = self._var.set(value)
        try:
            yield
        finally:
            self._var.reset(token)


BATCH_OVER_STAGES = TraceState("batch_over_stages", False)
AXES_TAKEN = TraceState("axes_taken", ())
GATHER_FOR_USE = TraceState("gather_for_use", None)
WITHOUT_REMAT = TraceState("without_remat", False)
LORA_DROPOUT_KEY = TraceState("lora_dropout_key", None)
FP8_RECIPE = TraceState("fp8_recipe", None)
EXPERT_GEMM_TARGET = TraceState("expert_gemm_target", None)
