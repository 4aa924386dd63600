"""Gemma 3, text (``Gemma3ForCausalLM``): local sliding-window layers with their own RoPE base among global ones
(the last of every ``global_every``, 6 as published), per-head query and key norms, a query scale of its own
(``query_pre_attn_scalar``), norms before and after attention and the MLP that scale by 1 + weight, a GeGLU with
tanh GELU, embeddings scaled by sqrt(hidden) and a tied head. The global layers' RoPE is stretched linearly in the
4B, 12B and 27B models.

config.json: transformers 5 writes ``rope_parameters`` per layer kind (``full_attention``, ``sliding_attention``);
4.x wrote ``rope_theta``, ``rope_local_base_freq`` and ``rope_scaling``. Both are read; export writes the 4.x keys,
which 5.x still reads.
"""

from __future__ import annotations

from typing import Any

from jaxtron.config.model import ModelConfig
from jaxtron.families import config_json, hf_tensors
from jaxtron.families.family import Family, Fixture, FormatError
from jaxtron.families.llama import VOCAB

get = config_json.get


def _rope(hf: dict) -> dict[str, Any]:
    """``model.rope`` of a Gemma 3 config.json: the global layers' base and linear stretch, the local layers' base."""
    params = hf.get("rope_parameters") or {}
    full = dict(params.get("full_attention") or {})
    local = dict(params.get("sliding_attention") or {})
    if not params:  # transformers 4.x
        full = {"rope_theta": hf.get("rope_theta", 1e6), **(hf.get("rope_scaling") or {})}
        local = {"rope_theta": hf.get("rope_local_base_freq", 1e4)}
    if local.get("rope_type", "default") != "default":
        raise FormatError(f"config.json stretches the local layers' RoPE ({local['rope_type']}); jaxtron's Gemma 3 "
                          "rotates them unstretched.")
    kind = full.get("rope_type", full.get("type", "default"))
    rope = {"theta": float(full.get("rope_theta", 1e6)), "local_theta": float(local.get("rope_theta", 1e4))}
    if kind == "linear":
        rope.update(scaling="linear", factor=float(full["factor"]))
    elif kind != "default":
        raise FormatError(f"config.json asks for global RoPE scaling of type '{kind}'; jaxtron's Gemma 3 supports "
                          "none and 'linear'.")
    return rope


def _model_fields(hf: dict, tensor_names) -> dict[str, Any]:
    for key in ("final_logit_softcapping", "attn_logit_softcapping"):
        if hf.get(key) is not None:
            raise FormatError(f"config.json sets {key}={hf[key]}; jaxtron's Gemma 3 has no logit soft-capping.")
    if hf.get("use_bidirectional_attention"):
        raise FormatError("config.json sets use_bidirectional_attention; jaxtron trains causal models only.")
    if get(hf, "hidden_activation", "gelu_pytorch_tanh") != "gelu_pytorch_tanh":
        raise FormatError(f"config.json sets hidden_activation={hf['hidden_activation']!r}; jaxtron's Gemma 3 needs "
                          "'gelu_pytorch_tanh'.")
    fields = config_json.core_fields({**hf, "rope_parameters": None, "rope_scaling": None},
                                     own=("hidden_act", "sliding_window"))
    fields.update(activation="geglu", norm_unit_offset=True, post_norms=True, embed_scale=True,
                  tie_embeddings=bool(hf.get("tie_word_embeddings", True)), rope=_rope(hf))
    head_dim = get(hf, "head_dim", get(hf, "hidden_size") // get(hf, "num_attention_heads"))
    fields["attention"].update(qk_norm=True, head_dim=head_dim, **config_json.local_layers(hf),
                               query_pre_attn_scalar=float(get(hf, "query_pre_attn_scalar", head_dim)))
    return fields


def _hf_fields(cfg: ModelConfig, router_aux_loss: float) -> dict[str, Any]:
    hf = config_json.core_hf(cfg, "gemma3_text")
    del hf["hidden_act"]
    scalar = cfg.attention.query_pre_attn_scalar or cfg.resolved_head_dim
    hf.update(hidden_activation="gelu_pytorch_tanh",  # transformers' config takes a whole number here
              query_pre_attn_scalar=int(scalar) if float(scalar).is_integer() else scalar,
              sliding_window=cfg.attention.window or None,
              layer_types=config_json.layer_types(cfg), rope_local_base_freq=cfg.rope.local_theta or cfg.rope.theta,
              final_logit_softcapping=None, attn_logit_softcapping=None, use_bidirectional_attention=False)
    return hf


def _fixture() -> dict[str, Any]:
    """Four layers (one local lead block, then a period of local, global, local), a window of 6 tokens of the
    fixtures' 24, the global layers' RoPE stretched linearly, the local ones' of another base, and a query scale
    other than the head size."""
    return dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=24, sliding_window=6,
                layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
                max_position_embeddings=128, rms_norm_eps=1e-6, tie_word_embeddings=True,
                rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
                                 "sliding_attention": {"rope_type": "default", "rope_theta": 100.0}})


GEMMA3 = Family(
    name="gemma3", model_type="gemma3_text", architectures=("Gemma3ForCausalLM",),
    description="local layers with their own RoPE base, 1 + weight norms before and after each part, GeGLU",
    model_fields=_model_fields, hf_fields=_hf_fields, tensors=hf_tensors.tensors,
    mechanisms=frozenset({"qk_norm", "local_layers", "local_rope", "linear_rope", "query_scale", "unit_offset_norms",
                          "post_norms", "embed_scale", "geglu"}),
    required=frozenset({"qk_norm", "unit_offset_norms", "post_norms", "embed_scale", "geglu"}),
    fixtures=(Fixture("gemma3", 7, _fixture()),),
)
