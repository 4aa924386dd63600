"""Low-rank adapters (LoRA, Hu et al. 2021) on a model's projections.

A target projection ``y = x W`` becomes ``y + (alpha / rank) (x A) B``: A holds W's input dimensions and the rank,
B the rank and W's output dimensions, both with W's stacked-layer dimensions in front and W's logical axis names on
the dimensions they share with it (the rank is ``lora_rank``, kept whole), so the rules table shards them as it
shards W. A starts as a scaled normal, B at zero: an adapted model starts equal to its base. The adapters are
``Adapter`` variables (a kind of ``nnx.Param``) of the ``Projection`` they adapt (``lora_a``, ``lora_b``), added to a
built model by ``add_adapters``; the projection computes them (``models/projection.py``). ``merged`` folds them into
the base weights (export).

With ``lora.dropout`` p > 0 the adapters' input is dropped out (kept values scaled by 1 / (1 - p)) in training steps,
inside ``dropout(key)``: the train step's key (the run's seed and the step) folded with each layer's ``Seed`` (a
stacked integer each adapted projection carries, numbered by the module it belongs to, so every layer draws its own
mask) and the projection's tag (its name's checksum). Outside it (evaluation, generation) nothing is dropped.
"""

from __future__ import annotations

import contextlib
import math
import re
import zlib
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxtron.common.trace_state import LORA_DROPOUT_KEY
from jaxtron.config.schema import ConfigError, LoraConfig
from jaxtron.models.projection import Adapter, Projection, Seed
from jaxtron.parallel.sharding import logical_names

RANK = "lora_rank"
OWN = (Adapter, Seed)  # what a LoRA run adds to its base, and what its checkpoints hold


@contextlib.contextmanager
def dropout(key: jax.Array) -> Iterator[None]:
    """Adapters with ``lora.dropout`` drop out their input, with masks drawn from ``key``, inside this block."""
    with LORA_DROPOUT_KEY.bound(key):
        yield


# projection name -> (attribute, modules that have it)
PROJECTIONS = {
    "q": ("wq", ("Attention", "LatentAttention")),
    "k": ("wk", ("Attention",)),
    "v": ("wv", ("Attention",)),
    "o": ("wo", ("Attention", "LatentAttention")),
    "gate": ("wi_gate", ("MLP",)),
    "up": ("wi_up", ("MLP",)),
    "down": ("wo", ("MLP",)),
    "q_a": ("wq_a", ("LatentAttention",)),
    "q_b": ("wq_b", ("LatentAttention",)),
    "kv_a": ("wkv_a", ("LatentAttention",)),
    "kv_b": ("wkv_b", ("LatentAttention",)),
}
HF_NAMES = {"q_proj": "q", "k_proj": "k", "v_proj": "v", "o_proj": "o", "gate_proj": "gate", "up_proj": "up",
            "down_proj": "down", "q_a_proj": "q_a", "q_b_proj": "q_b", "kv_a_proj_with_mqa": "kv_a",
            "kv_b_proj": "kv_b"}


def target_names(cfg: LoraConfig) -> list[str]:
    """lora.targets as projection names; ConfigError naming any that is not one."""
    names = []
    for raw in (t.strip() for t in cfg.targets.split(",") if t.strip()):
        name = HF_NAMES.get(raw, raw)
        if name not in PROJECTIONS:
            raise ConfigError(f"config field 'lora.targets' names '{raw}', which is no projection; use names from "
                              f"{', '.join(PROJECTIONS)} (or Hugging Face's q_proj, ..., down_proj).")
        names.append(name)
    return names


def _targets(model: nnx.Module, cfg: LoraConfig) -> list[tuple[nnx.Module, str]]:
    """(module, projection attribute) of every target in ``model``; ConfigError for a target that names no
    projection of this model (a gate on a GELU MLP, latent projections without latent attention)."""
    found = []
    for name in target_names(cfg):
        attribute, kinds = PROJECTIONS[name]
        here = [(m, attribute) for _, m in nnx.iter_graph(model)
                if isinstance(m, nnx.Module) and type(m).__name__ in kinds
                and isinstance(getattr(m, attribute, None), Projection)]
        if not here:
            raise ConfigError(f"config field 'lora.targets' names '{name}', but this model has no such projection; "
                              "drop it or name projections the model has.")
        found += here
    return found


def add_adapters(model: nnx.Module, cfg: LoraConfig, seed: int) -> nnx.Module:
    """Adds adapters of rank ``cfg.rank`` to the target projections of ``model`` (in place); returns it."""
    key = jax.random.key(seed)
    with nnx.use_eager_sharding(False):  # placed by the caller, as build_model's parameters are
        targets = _targets(model, cfg)
        for index, (module, attribute) in enumerate(targets):
            _add(getattr(module, attribute), cfg, jax.random.fold_in(key, index))
        if cfg.dropout:  # each module's layers numbered apart from every other module's
            modules = list({id(m): m for m, _ in targets}.values())
            for module, attribute in targets:
                projection = getattr(module, attribute)
                lead = projection.weight.get_value().ndim - projection.inputs - projection.outputs
                shape, names = projection.weight.get_value().shape[:lead], logical_names(projection.weight)[:lead]
                first = modules.index(module) * (1 << 20)
                projection.lora_seed = Seed(first + jnp.arange(math.prod(shape), dtype=jnp.int32).reshape(shape),
                                            out_sharding=names)
                projection.lora_dropout = cfg.dropout
                projection.lora_tag = zlib.crc32(attribute.encode()) >> 1
    return model


def _add(projection: Projection, cfg: LoraConfig, key: jax.Array) -> None:
    """Adapters A (scaled normal) and B (zeros) of one projection, named as its weight is."""
    shape, names = projection.weight.get_value().shape, logical_names(projection.weight)
    stack = len(shape) - projection.inputs - projection.outputs
    lead, ins, outs = shape[:stack], shape[stack:stack + projection.inputs], shape[stack + projection.inputs:]
    a = jax.random.normal(key, (*lead, *ins, cfg.rank), jnp.float32) / math.sqrt(math.prod(ins))
    projection.lora_a = Adapter(a, out_sharding=(*names[:stack + projection.inputs], RANK))
    projection.lora_b = Adapter(jnp.zeros((*lead, cfg.rank, *outs), jnp.float32),
                                out_sharding=(*names[:stack], RANK, *names[stack + projection.inputs:]))
    projection.lora_scale = cfg.alpha / cfg.rank


def is_adapter(path: str) -> bool:
    """Whether a dotted parameter path is a LoRA variable (an adapter matrix or a layer's dropout seed)."""
    return bool(re.search(r"\.lora_(a|b|seed)$", path))


def merged(flat: dict[str, np.ndarray], cfg: LoraConfig) -> dict[str, np.ndarray]:
    """Dotted-path parameters with every adapter pair folded into its weight, ``W + (alpha / rank) A B`` (float32),
    and the adapters dropped: the base model's structure, computing what the adapted model computes."""
    out = {k: v for k, v in flat.items() if not is_adapter(k)}
    for path in (k for k in flat if k.endswith(".lora_a")):
        projection = path[:-len(".lora_a")]
        weight = projection + ".weight"
        a, b, w = flat[path].astype(np.float32), flat[projection + ".lora_b"].astype(np.float32), out[weight]
        stack = a.ndim + b.ndim - 2 - w.ndim  # a: stack, inputs, rank; b: stack, rank, outputs; w: stack, in, out
        layers = math.prod(a.shape[:stack])
        delta = np.einsum("lir,lro->lio", a.reshape(layers, -1, a.shape[-1]), b.reshape(layers, b.shape[stack], -1))
        out[weight] = (w.astype(np.float32) + cfg.alpha / cfg.rank * delta.reshape(w.shape)).astype(w.dtype)
    return out


def split(params: Any) -> tuple[Any, Any]:
    """(the parameters that train, the frozen ones): (adapters, the base) when ``params`` (an nnx State) holds
    adapters, else (params, None)."""
    adapters, base = nnx.split_state(params, Adapter, ...)
    return (adapters, base) if len(jax.tree.leaves(adapters)) else (params, None)


def join(trainable: Any, frozen: Any) -> Any:
    """The whole parameter State from ``split``'s two parts."""
    return trainable if frozen is None else nnx.merge_state(frozen, trainable)


def own(params: Any, like: Any = None, lora: bool = True) -> Any:
    """The LoRA variables (adapters and seeds) of a parameter State, or of a tree shaped like ``like``'s (its
    shardings, say); with ``lora=False`` the rest: the base model."""
    paths = {p for p, v in nnx.to_flat_state(params if like is None else like) if isinstance(v, OWN) == lora}
    return nnx.filter_state(params, lambda path, _: path in paths)


def saved_part(state: Any, like: Any = None) -> Any:
    """What a checkpoint holds of a train state (or of a tree shaped like one, its shardings say): everything,
    with only the LoRA variables of the parameters when ``like``'s (default: the state's own) parameters have some."""
    reference = (state if like is None else like).params
    if not any(isinstance(v, OWN) for _, v in nnx.to_flat_state(reference)):
        return state
    return state.replace(params=own(state.params, reference))
