"""Model families, each one declared value (``family.Family``) in a module of this package, found by looking: a
new family is a new module here (docs/adding_a_model_family.md).

``model.family`` names a model's family; nothing is guessed from its fields but for a config written before the
field (``jaxtron.config.loader``). The entry points the rest of the package calls: ``get`` (a family by name),
``of_config_json`` (the family a config.json describes), ``model_config`` and ``hf_config`` (config.json both ways),
``tensors`` (the checkpoint's tensors both ways), ``check_export`` (what the family can represent).
"""

from __future__ import annotations

import difflib
import functools
import importlib
import pkgutil
from collections.abc import Collection, Iterator
from typing import Any

from jaxtron.config.checks import ConfigError
from jaxtron.config.model import ModelConfig
from jaxtron.families import mechanisms
from jaxtron.families.family import Family, FormatError, Tensor

__all__ = ["Family", "FormatError", "Tensor"]  # what callers name through the package

# modules of this package that declare no family
_SHARED = {"config_json", "family", "hf_tensors", "mechanisms", "mxfp4"}


@functools.cache
def all_families() -> dict[str, Family]:
    """Every declared family by name, in the order of their modules' names."""
    found: dict[str, Family] = {}
    for module in sorted(m.name for m in pkgutil.iter_modules(__path__) if m.name not in _SHARED):
        for value in vars(importlib.import_module(f"{__name__}.{module}")).values():
            if isinstance(value, Family):
                if value.name in found and found[value.name] is not value:
                    raise RuntimeError(f"two families are named {value.name!r}")
                found[value.name] = value
    return found


def get(name: str) -> Family:
    """The family ``name`` (``model.family``); ConfigError naming the closest one for an unknown name."""
    families = all_families()
    if name in families:
        return families[name]
    close = difflib.get_close_matches(name, families, n=1)
    hint = f"did you mean '{close[0]}'? " if close else ""
    raise ConfigError(f"config field 'model.family' is {name!r}, which is no family; {hint}use one of "
                      f"{', '.join(families)}.")


def of_config_json(hf: dict) -> Family:
    """The family a config.json describes, by its architecture or else its model type; FormatError for others."""
    arch = (hf.get("architectures") or [None])[0]
    exported = [f for f in all_families().values() if f.exported]
    for family in exported:
        if arch in family.architectures:
            return family
    for family in exported:
        if hf.get("model_type") == family.model_type:
            return family
    raise FormatError(f"config.json describes architecture {arch or hf.get('model_type')!r}; jaxtron converts "
                      f"{', '.join(f.architectures[0] for f in exported)}.")


def model_config(hf: dict, name: str = "", tensor_names: Collection[str] = ()) -> ModelConfig:
    """The ModelConfig of a Hugging Face config.json (a dict), its family set; FormatError for what cannot map.
    ``tensor_names``: the checkpoint's (DeepSeek-V3's prediction modules come along only when it has them)."""
    family = of_config_json(hf)
    fields = family.model_fields(hf, tensor_names)
    return ModelConfig(name=name or hf.get("_name_or_path", "") or family.name, family=family.name, **fields)


def check_export(cfg: ModelConfig) -> Family:
    """The family ``cfg`` exports as, after checking that the family can represent every mechanism ``cfg``
    switches on and has every one it needs; FormatError naming the field otherwise."""
    family = get(cfg.family)
    if not family.exported:
        family.hf_fields(cfg, 0.0)  # says why, in the family's words
    used = mechanisms.used(cfg)
    for name in sorted(used - family.mechanisms):
        raise FormatError(f"model.family={family.name!r} has no Hugging Face form of {mechanisms.field(name)}; "
                          "set model.family to a family that has, or leave that mechanism out to export.")
    for name in sorted(family.required - used):
        raise FormatError(f"model.family={family.name!r} needs {mechanisms.field(name)} ({family.description}); "
                          "set it, or model.family to the family this model is.")
    return family


def hf_config(cfg: ModelConfig, router_aux_loss: float = 0.0) -> dict[str, Any]:
    """config.json (transformers 4.x field names, which 5.x still reads) for ``cfg`` trained with the
    load-balancing coefficient ``router_aux_loss`` (``train.router_aux_loss``)."""
    family = check_export(cfg)
    return {"architectures": [family.architectures[0]], **family.hf_fields(cfg, router_aux_loss)}


def tensors(cfg: ModelConfig, hf: dict | None = None) -> Iterator[Tensor]:
    """Every tensor of the Hugging Face checkpoint of ``cfg``, in file order (``hf``: the config.json read, for
    DeepSeek-V3's ``rope_interleave``; an export writes interleaved rotary rows)."""
    return get(cfg.family).tensors(cfg, hf)


def train_fields(hf: dict) -> dict[str, float]:
    """The training config's fields that a Hugging Face config.json sets (router loss coefficients)."""
    return of_config_json(hf).train_fields(hf)

