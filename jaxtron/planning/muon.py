"""Muon's share of a step (``optimizer.name='muon'``, ``jaxtron/training/optimizer.py``): the Newton-Schulz GEMMs
each device runs on the whole matrices it holds, and the collectives that move its momentum's Nesterov blend to
whole matrices and the orthogonalized update back.

A stack of matrices (layers, experts) is split over all devices (``state_sharding.whole_matrix_steps``), padded
with zero matrices where it does not divide over them: each device orthogonalizes its share. All-to-alls over the
axes that split the matrices move a device's shard of the padded stack, less the part it keeps, at the
Newton-Schulz precision (``optimizer.muon_dtype``); the updates come back from the axes that leave the parameter
whole (data) by an all-gather.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from jaxtron.config.schema import Config
from jaxtron.parallel.sharding import logical_to_spec, spec_axes
from jaxtron.parallel.state_sharding import whole_matrix_stack, whole_matrix_steps
from jaxtron.planning.gpus import GPU
from jaxtron.planning.params import Param, elements_per_device
from jaxtron.training.optimizer import matrix_dimensions

# float32 GEMMs run on TF32 tensor cores (jax's default precision on GPUs) at half the bf16 rate
PRECISION_RATE = {"float32": 0.5, "bfloat16": 1.0}
VALUE_BYTES = {"float32": 4, "bfloat16": 2}


def newton_schulz_flops(rows: int, cols: int, steps: int) -> float:
    """FLOPs of ``steps`` Newton-Schulz iterations on one rows x cols matrix: each makes A = X X^T, B = b A + c A A
    and a X + B X on the short side's square (m = min, n = max): 2 m^2 n + 2 m^3 + 2 m^2 n."""
    m, n = min(rows, cols), max(rows, cols)
    return steps * (4.0 * m * m * n + 2.0 * m ** 3)


def matrix_layout(param: Param, sizes: Mapping[str, int], value_bytes: int = 4) -> dict | None:
    """How Muon handles ``param`` on the mesh ``sizes``: 'matrices' a device orthogonalizes, 'flops' of their
    Newton-Schulz iteration (per step: times ``optimizer.muon_steps``) and 'moves', the collectives of a step as
    ``moves`` lists them, for values of ``value_bytes``; None for AdamW's parameters."""
    dims = matrix_dimensions(param.names)
    if dims is None:
        return None
    matrix = (*dims.reduction_axis, *dims.output_axis)
    rows = math.prod(param.shape[i] for i in dims.reduction_axis)
    cols = math.prod(param.shape[i] for i in dims.output_axis)
    own = logical_to_spec(param.names)
    steps = whole_matrix_steps(param.names, matrix, sizes)
    first, length = whole_matrix_stack(param.names, param.shape, matrix, sizes)
    if first < 0:  # one matrix, no stack: every device of the group gathers it and orthogonalizes it whole
        group = math.prod(sizes.get(a, 1) for i in matrix for a in spec_axes(own, i))
        held = elements_per_device(param.shape, own, sizes) * value_bytes
        moves = [("all-gather", held * group, held * (group - 1), spec_axes(own, matrix[0]))] if group > 1 else []
        matrices = elements_per_device(param.shape, own, sizes) * group / (rows * cols)
    else:
        padded = tuple(length if i == first else n for i, n in enumerate(param.shape))
        moves, before = [], own
        for spec in steps:
            new = tuple(a for a in spec_axes(spec, first) if a not in spec_axes(before, first))
            devices = math.prod(sizes[a] for a in new)
            held = elements_per_device(padded, before, sizes) * value_bytes
            if any(a in spec_axes(own, i) for i in matrix for a in new):  # there and back: an all-to-all each way
                moves += [("all-to-all", held, held * (devices - 1) / devices, new)] * 2
            else:  # a slice there, an all-gather back
                moves.append(("all-gather", held, held * (devices - 1) / devices, new))
            before = spec
        matrices = elements_per_device(padded, before, sizes) / (rows * cols)
    return {"matrices": matrices, "flops": matrices * newton_schulz_flops(rows, cols, 1), "moves": moves}


def newton_schulz_step_flops(cfg: Config, params: tuple[Param, ...], sizes: Mapping[str, int]) -> float:
    """FLOPs of the Newton-Schulz GEMMs one device runs in a step (0 under AdamW)."""
    if cfg.optimizer.name != "muon":
        return 0.0
    return cfg.optimizer.muon_steps * sum(layout["flops"] for p in params if (layout := matrix_layout(p, sizes)))


def optimizer_time(cfg: Config, params: tuple[Param, ...], sizes: Mapping[str, int], gpu: GPU) -> float:
    """Seconds per step of Muon's Newton-Schulz GEMMs on one device (0 under AdamW)."""
    if cfg.optimizer.name != "muon":
        return 0.0
    rate = gpu.peak_flops["bfloat16"] * gpu.matmul_efficiency * PRECISION_RATE[cfg.optimizer.muon_dtype]
    return newton_schulz_step_flops(cfg, params, sizes) / rate


def moves(cfg: Config, params: tuple[Param, ...], sizes: Mapping[str, int]) -> list[tuple[str, float, float, tuple]]:
    """Muon's collectives per step and device: (kind, whole bytes, bytes sent, mesh axes). For each stack of
    matrices, an all-to-all each way per sharded matrix dimension (``state_sharding.whole_matrix_steps``) and an
    all-gather of the update over the axes that leave the parameter whole; for a lone matrix, an all-gather."""
    if cfg.optimizer.name != "muon":
        return []
    value = VALUE_BYTES[cfg.optimizer.muon_dtype]
    return [move for p in params if (layout := matrix_layout(p, sizes, value)) for move in layout["moves"]]
