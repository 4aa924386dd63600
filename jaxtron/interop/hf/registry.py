"""The Hugging Face families jaxtron converts, and the entry points of the mapping: config.json <-> ModelConfig and
the tensors of a checkpoint.

A family is named by config.json's ``model_type`` and ``architectures``. Which family a jaxtron model exports as
follows from its architecture (``family_of``); which one a config.json describes, from those two fields
(``family_of_config_json``). The mappings themselves live beside: ``llama.py`` for Llama, Qwen3 (dense and MoE) and
Mixtral, which share a layout, and ``deepseek.py`` for what DeepSeek-V3 adds. A new family is a row here and its
mapping there (docs/adding_a_model_family.md).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

from jaxtron.config.schema import ModelConfig
from jaxtron.interop.hf import llama
from jaxtron.interop.hf.llama import Tensor
from jaxtron.interop.hf.safetensors import FormatError


@dataclasses.dataclass(frozen=True)
class Family:
    model_type: str  # config.json's "model_type"
    architecture: str  # config.json's "architectures"[0], the transformers class
    is_it: str  # what makes a jaxtron model this family


FAMILIES = (
    Family("llama", "LlamaForCausalLM", "grouped-query attention, dense SwiGLU blocks"),
    Family("qwen3", "Qwen3ForCausalLM", "per-head query and key norms (model.attention.qk_norm)"),
    Family("qwen3_moe", "Qwen3MoeForCausalLM", "per-head norms and experts (model.moe.num_experts > 0)"),
    Family("mixtral", "MixtralForCausalLM", "experts in every block, no per-head norms"),
    Family("deepseek_v3", "DeepseekV3ForCausalLM", "latent attention (model.attention.kv_lora_rank > 0)"),
)
BY_TYPE = {f.model_type: f for f in FAMILIES}


def family_of(cfg: ModelConfig) -> Family:
    """The family a jaxtron model exports as: DeepSeek-V3 with latent attention, Qwen3 when it normalises queries
    and keys, else Llama or (with experts) Mixtral."""
    if cfg.latent_attention:
        return BY_TYPE["deepseek_v3"]
    if cfg.attention.qk_norm:
        return BY_TYPE["qwen3_moe" if cfg.moe.num_experts else "qwen3"]
    return BY_TYPE["mixtral" if cfg.moe.num_experts else "llama"]


def family_of_config_json(hf: dict) -> Family:
    """The family a config.json describes, by its architecture or else its model type; FormatError for others."""
    arch = (hf.get("architectures") or [None])[0]
    for family in FAMILIES:
        if arch == family.architecture:
            return family
    if hf.get("model_type") in BY_TYPE:
        return BY_TYPE[hf["model_type"]]
    raise FormatError(f"config.json describes architecture {arch or hf.get('model_type')!r}; jaxtron converts "
                      f"{', '.join(f.architecture for f in FAMILIES)}.")


def model_config(hf: dict, name: str = "", tensor_names: Any = ()) -> ModelConfig:
    """The jaxtron ModelConfig of a Hugging Face config.json (as a dict); FormatError for what cannot map.
    ``tensor_names``: the checkpoint's, which decide whether DeepSeek-V3's multi-token prediction modules come
    along (config.json may announce modules the weights do not have)."""
    return llama.model_config(hf, family_of_config_json(hf).model_type, name, tensor_names)


def train_fields(hf: dict) -> dict[str, float]:
    """The training config's fields that a Hugging Face config.json sets: Mixtral's router loss coefficients."""
    return llama.train_fields(hf)


def hf_config(cfg: ModelConfig, router_aux_loss: float = 0.0) -> dict[str, Any]:
    """config.json (transformers 4.x field names, which 5.x still reads) for a jaxtron ModelConfig trained with
    the load-balancing coefficient ``router_aux_loss`` (``train.router_aux_loss``; Mixtral only)."""
    family = family_of(cfg)
    return {"architectures": [family.architecture], **llama.hf_config(cfg, family.model_type, router_aux_loss)}


def tensors(cfg: ModelConfig, hf: dict | None = None) -> Iterator[Tensor]:
    """Every tensor of the Hugging Face checkpoint of ``cfg``, in file order (``hf``: the config.json read, for
    DeepSeek-V3's ``rope_interleave``; an export writes interleaved rotary rows)."""
    return llama.tensors(cfg, family_of(cfg).model_type, hf)
