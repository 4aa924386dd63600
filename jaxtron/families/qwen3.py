"""Qwen3, dense (``Qwen3ForCausalLM``) and MoE (``Qwen3MoeForCausalLM``): Llama with each head's queries and keys
RMS-normalised before RoPE (``model.attention.qk_norm``) and heads of their own size; the MoE models add experts
every ``decoder_sparse_step`` blocks (``model.moe.every``), routed as Mixtral's (softmax, top-k, renormalised when
``norm_topk_prob``), named as a Llama MLP."""

from __future__ import annotations

from typing import Any

from jaxtron.config.model import ModelConfig
from jaxtron.families import config_json, hf_tensors
from jaxtron.families.family import Family, Fixture, FormatError
from jaxtron.families.llama import VOCAB

NO_WINDOW = {"use_sliding_window": False, "sliding_window": None}
ROPE = {"rope_type": "default", "rope_theta": 1e6}


def _model_fields(hf: dict, tensor_names) -> dict[str, Any]:
    fields = config_json.core_fields(hf)
    fields["attention"]["qk_norm"] = True
    return fields


def _hf_fields(cfg: ModelConfig, router_aux_loss: float) -> dict[str, Any]:
    return {**config_json.core_hf(cfg, "qwen3"), **NO_WINDOW}


def _moe_model_fields(hf: dict, tensor_names) -> dict[str, Any]:
    """Experts of width ``moe_intermediate_size`` every ``decoder_sparse_step`` blocks, dense blocks of width
    ``intermediate_size`` between them."""
    step, dense_only = int(hf.get("decoder_sparse_step", 1)), list(hf.get("mlp_only_layers") or [])
    if dense_only:
        raise FormatError(f"config.json sets mlp_only_layers={dense_only}; jaxtron places dense blocks only by "
                          "decoder_sparse_step.")
    experts = hf.get("num_experts") or config_json.get(hf, "num_local_experts")  # transformers 4.x and 5.x names
    return {**_model_fields(hf, tensor_names), "moe": dict(
        num_experts=experts, experts_per_token=config_json.get(hf, "num_experts_per_tok"),
        expert_dim=config_json.get(hf, "moe_intermediate_size"),
        router_renormalize=bool(hf.get("norm_topk_prob", False)), every=step)}


def _moe_hf_fields(cfg: ModelConfig, router_aux_loss: float) -> dict[str, Any]:
    return {**config_json.core_hf(cfg, "qwen3_moe"), **NO_WINDOW, "num_experts": cfg.moe.num_experts,
            "num_experts_per_tok": cfg.moe.experts_per_token, "moe_intermediate_size": cfg.resolved_expert_dim,
            "decoder_sparse_step": cfg.moe.every, "mlp_only_layers": [], "norm_topk_prob": cfg.moe.router_renormalize,
            "router_aux_loss_coef": router_aux_loss, "output_router_logits": False}


QWEN3 = Family(
    name="qwen3", model_type="qwen3", architectures=("Qwen3ForCausalLM",),
    description="per-head query and key norms (model.attention.qk_norm)",
    model_fields=_model_fields, hf_fields=_hf_fields, tensors=hf_tensors.tensors,
    mechanisms=frozenset({"llama3_rope", "yarn", "qk_norm"}), required=frozenset({"qk_norm"}),
    # head size (16) not hidden / heads, tied embeddings
    fixtures=(Fixture("qwen3", 3, dict(
        vocab_size=VOCAB, hidden_size=48, intermediate_size=80, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=128, rms_norm_eps=1e-6, tie_word_embeddings=True,
        rope_parameters=dict(ROPE))),),
)

QWEN3_MOE = Family(
    name="qwen3_moe", model_type="qwen3_moe", architectures=("Qwen3MoeForCausalLM",),
    description="per-head norms and experts (model.moe.num_experts > 0)",
    model_fields=_moe_model_fields, hf_fields=_moe_hf_fields, tensors=hf_tensors.tensors,
    train_fields=config_json.router_loss_fields,
    mechanisms=frozenset({"llama3_rope", "yarn", "qk_norm", "experts", "sparse_step", "unnormalized_router"}),
    required=frozenset({"qk_norm", "experts"}),
    # a dense block of width 64, then an MoE block of 4 experts of width 24, top-2 renormalised
    fixtures=(Fixture("qwen3_moe", 4, dict(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, moe_intermediate_size=24, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2,
        norm_topk_prob=True, decoder_sparse_step=2, mlp_only_layers=[], max_position_embeddings=128,
        rms_norm_eps=1e-6, rope_parameters=dict(ROPE))),),
)
