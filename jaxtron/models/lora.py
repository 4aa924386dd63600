"""Low-rank adapters (LoRA, Hu et al. 2021) on a model's projections.

A target projection ``y = einsum(x, W)`` becomes ``y + (alpha / rank) * einsum(einsum(x, A), B)``: A holds W's input
dimensions and the rank, B the rank and W's output dimensions, both with W's stacked-layer dimensions in front and
W's logical axis names on the dimensions they share with it (the rank is ``lora_rank``, kept whole), so the rules
table shards them as it shards W. A starts as a scaled normal, B at zero: an adapted model starts equal to its
base. The adapters are ``Adapter`` variables (a kind of ``nnx.Param``), added to a built model by ``add_adapters``;
the modules call ``project`` for every target projection. ``merged`` folds them into the base weights (export).

With ``lora.dropout`` p > 0 the adapters' input is dropped out (kept values scaled by 1 / (1 - p)) in training steps,
inside ``dropout(key)``: the train step's key (the run's seed and the step) folded with each layer's ``Seed`` (a
stacked integer the layer's adapters carry, so every layer and projection draws its own mask) and the projection.
Outside it (evaluation, generation) nothing is dropped.
"""

from __future__ import annotations

import contextlib
import math
import re
import zlib
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxtron.common.trace_state import LORA_DROPOUT_KEY
from jaxtron.config.schema import ConfigError, LoraConfig
from jaxtron.parallel.sharding import logical_names
from jaxtron.parallel.state_sharding import weight_layout

RANK = "lora_rank"


class Adapter(nnx.Param):
    """A LoRA matrix: the only parameters a LoRA run trains."""


class Seed(nnx.Param):
    """Each stacked layer's number for its adapters' dropout masks (an integer: never trained)."""


OWN = (Adapter, Seed)  # what a LoRA run adds to its base, and what its checkpoints hold


@contextlib.contextmanager
def dropout(key: jax.Array) -> Iterator[None]:
    """Adapters with ``lora.dropout`` drop out their input, with masks drawn from ``key``, inside this block."""
    with LORA_DROPOUT_KEY.bound(key):
        yield


# projection name -> (attribute, modules that have it, input dimensions of the unstacked weight, its rank)
PROJECTIONS = {
    "q": ("wq", ("Attention", "LatentAttention"), 1, 3),
    "k": ("wk", ("Attention",), 1, 3),
    "v": ("wv", ("Attention",), 1, 3),
    "o": ("wo", ("Attention", "LatentAttention"), 2, 3),
    "gate": ("wi_gate", ("MLP",), 1, 2),
    "up": ("wi_up", ("MLP",), 1, 2),
    "down": ("wo", ("MLP",), 1, 2),
    "q_a": ("wq_a", ("LatentAttention",), 1, 2),
    "q_b": ("wq_b", ("LatentAttention",), 1, 3),
    "kv_a": ("wkv_a", ("LatentAttention",), 1, 2),
    "kv_b": ("wkv_b", ("LatentAttention",), 1, 3),
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


def _targets(model: nnx.Module, cfg: LoraConfig) -> list[tuple[nnx.Module, str, str]]:
    """(module, weight attribute, projection name) of every target in ``model``; ConfigError for a target that
    names no projection of this model (a gate on a GELU MLP, latent projections without latent attention)."""
    found, wanted = [], target_names(cfg)
    for name in wanted:
        attribute, kinds, _, _ = PROJECTIONS[name]
        here = [(m, attribute, name) for _, m in nnx.iter_graph(model)
                if isinstance(m, nnx.Module) and type(m).__name__ in kinds and getattr(m, attribute, None) is not None]
        if not here:
            raise ConfigError(f"config field 'lora.targets' names '{name}', but this model has no such projection; "
                              "drop it or name projections the model has.")
        found += here
    return found


def add_adapters(model: nnx.Module, cfg: LoraConfig, seed: int) -> nnx.Module:
    """Adds adapters of rank ``cfg.rank`` to the target projections of ``model`` (in place); returns it."""
    from jaxtron.parallel.sharding import logical_names

    key = jax.random.key(seed)
    with nnx.use_eager_sharding(False):  # placed by the caller, as build_model's parameters are
        targets = _targets(model, cfg)
        for index, (module, attribute, name) in enumerate(targets):
            _add(module, attribute, name, cfg, jax.random.fold_in(key, index), logical_names)
        if cfg.dropout:
            for index, module in enumerate({id(m): m for m, _, _ in targets}.values()):
                weight = getattr(module, next(a for m, a, _ in targets if m is module))
                stack = weight.get_value().ndim - next(PROJECTIONS[n][3] for m, _, n in targets if m is module)
                lead, names = weight.get_value().shape[:stack], logical_names(weight)[:stack]
                numbers = index * (1 << 20) + jnp.arange(math.prod(lead), dtype=jnp.int32).reshape(lead)
                module.lora_seed = Seed(numbers, out_sharding=names)
                module.lora_dropout = cfg.dropout
    return model


def _add(module: nnx.Module, attribute: str, name: str, cfg: LoraConfig, key: jax.Array, logical_names) -> None:
    """Adapters A (scaled normal) and B (zeros) of one target weight, named as it is."""
    weight = getattr(module, attribute)
    _, _, inputs, rank = PROJECTIONS[name]
    shape, names = weight.get_value().shape, logical_names(weight)
    stack = len(shape) - rank
    lead, ins, outs = shape[:stack], shape[stack:stack + inputs], shape[stack + inputs:]
    a = jax.random.normal(key, (*lead, *ins, cfg.rank), jnp.float32) / math.sqrt(math.prod(ins))
    setattr(module, f"{attribute}_lora_a", Adapter(a, out_sharding=(*names[:stack + inputs], RANK)))
    setattr(module, f"{attribute}_lora_b", Adapter(jnp.zeros((*lead, cfg.rank, *outs), jnp.float32),
                                                   out_sharding=(*names[:stack], RANK, *names[stack + inputs:])))
    module.lora_scale = cfg.alpha / cfg.rank


def project(einsum: Callable, equation: str, x: jax.Array, module: nnx.Module, attribute: str,
            dtype: Any) -> jax.Array:
    """``einsum(equation, x, weight, layout)`` (``ops/fp8.projection``) of ``module``'s weight ``attribute`` (split
    over fsdp: gathered as ``state_sharding.weight_layout`` says), plus its adapters' low-rank update if it
    has them (both in ``dtype``)."""
    weight = getattr(module, attribute)
    with jax.named_scope("weight_cast"):
        w = weight[...].astype(dtype)
    y = einsum(equation, x, w, weight_layout(logical_names(weight), w.ndim))
    a = getattr(module, f"{attribute}_lora_a", None)
    if a is None:
        return y
    b = getattr(module, f"{attribute}_lora_b")
    rate, key = getattr(module, "lora_dropout", 0.0), LORA_DROPOUT_KEY.get()
    if rate and key is not None:
        key = jax.random.fold_in(jax.random.fold_in(key, module.lora_seed[...]), zlib.crc32(attribute.encode()) >> 1)
        keep = jax.random.bernoulli(key, 1.0 - rate, x.shape)
        x = jnp.where(keep, x / jnp.asarray(1.0 - rate, x.dtype), jnp.zeros((), x.dtype))
    inputs, out = equation.split("->")
    xs, ws = inputs.split(",")
    contracted = "".join(c for c in ws if c in xs)
    low = "".join(c for c in xs if c not in contracted) + "z"
    h = jnp.einsum(f"{xs},{contracted}z->{low}", x, a[...].astype(dtype))
    update = jnp.einsum(f"{low},z{ws[len(contracted):]}->{out}", h, b[...].astype(dtype))
    return y + jnp.asarray(module.lora_scale, dtype) * update


def is_adapter(path: str) -> bool:
    """Whether a dotted parameter path is a LoRA variable (an adapter matrix or a layer's dropout seed)."""
    return bool(re.search(r"_lora_[ab]$|\blora_seed$", path))


def merged(flat: dict[str, np.ndarray], cfg: LoraConfig) -> dict[str, np.ndarray]:
    """Dotted-path parameters with every adapter pair folded into its weight, ``W + (alpha / rank) A B`` (float32),
    and the adapters dropped: the base model's structure, computing what the adapted model computes."""
    out = {k: v for k, v in flat.items() if not is_adapter(k)}
    for path in (k for k in flat if k.endswith("_lora_a")):
        weight = path[:-len("_lora_a")]
        a, b, w = flat[path].astype(np.float32), flat[weight + "_lora_b"].astype(np.float32), out[weight]
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
