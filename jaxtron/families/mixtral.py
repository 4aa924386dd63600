"""Mixtral (``MixtralForCausalLM``): Llama's attention, experts in every block (softmax router, top-k
renormalised), named ``block_sparse_moe`` with ``w1`` (gate), ``w3`` (up) and ``w2`` (down)."""

from __future__ import annotations

from typing import Any

from jaxtron.config.model import ModelConfig
from jaxtron.families import config_json, hf_tensors
from jaxtron.families.family import Family, Fixture
from jaxtron.families.llama import VOCAB

NAMES = hf_tensors.Names(moe="block_sparse_moe.", experts=("w1", "w3", "w2"))


def _model_fields(hf: dict, tensor_names) -> dict[str, Any]:
    return {**config_json.core_fields(hf), "moe": dict(
        num_experts=config_json.get(hf, "num_local_experts"),
        experts_per_token=config_json.get(hf, "num_experts_per_tok"), router_renormalize=True, every=1)}


def _hf_fields(cfg: ModelConfig, router_aux_loss: float) -> dict[str, Any]:
    return {**config_json.core_hf(cfg, "mixtral"), "num_local_experts": cfg.moe.num_experts,
            "num_experts_per_tok": cfg.moe.experts_per_token, "router_aux_loss_coef": router_aux_loss,
            "output_router_logits": False, "sliding_window": None}


def _tensors(cfg: ModelConfig, hf: dict | None = None):
    return hf_tensors.tensors(cfg, hf, NAMES)


MIXTRAL = Family(
    name="mixtral", model_type="mixtral", architectures=("MixtralForCausalLM",),
    description="experts in every block, no per-head norms",
    model_fields=_model_fields, hf_fields=_hf_fields, tensors=_tensors, train_fields=config_json.router_loss_fields,
    mechanisms=frozenset({"llama3_rope", "yarn", "experts"}), required=frozenset({"experts"}),
    fixtures=(Fixture("mixtral", 2, dict(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=128,
        rms_norm_eps=1e-5, rope_parameters={"rope_type": "default", "rope_theta": 1e6})),),
)
