"""gpt-oss (``GptOssForCausalLM``): local layers of a 128-token window alternating with global ones, a learned sink
logit per head, biases on the attention's projections, YaRN RoPE whose ramp is not rounded, and experts in every
block: a router with a bias (softmax over the top k logits, which is the top k of the softmax renormalised), expert
biases, and the clamped SwiGLU ``(up + 1) * gate * sigmoid(alpha * gate)``.

The experts' gate and up projections are one tensor with the two interleaved along its last axis (gate first);
jaxtron keeps them apart. The published checkpoints store the expert matrices as MXFP4 (``families/mxfp4.py``):
``*_blocks`` and ``*_scales`` in place of each, laid out [experts, out, in]; the import dequantizes them to float32.
The export writes the plain form, which transformers reads too.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

from jaxtron.config.model import ModelConfig
from jaxtron.families import config_json, hf_tensors, mxfp4
from jaxtron.families.family import Family, Fixture, FormatError, Tensor
from jaxtron.families.hf_tensors import SAME, TRANSPOSE
from jaxtron.families.llama import VOCAB

get = config_json.get


def _model_fields(hf: dict, tensor_names) -> dict[str, Any]:
    quantized = (hf.get("quantization_config") or {}).get("quant_method")
    if quantized not in (None, "mxfp4"):
        raise FormatError(f"config.json's weights are quantized by '{quantized}'; jaxtron reads gpt-oss in MXFP4 or "
                          "unquantized.")
    fields = config_json.core_fields(hf, own=("attention_bias", "sliding_window"))
    width = get(hf, "intermediate_size")
    fields.update(activation="clamped_swiglu", swiglu_limit=float(get(hf, "swiglu_limit", 7.0)),
                  swiglu_alpha=float(get(hf, "swiglu_alpha", 1.702)), mlp_dim=width)
    fields["attention"].update(head_dim=get(hf, "head_dim"), sinks=True, bias=bool(hf.get("attention_bias", True)),
                               **config_json.local_layers(hf))
    experts = hf.get("num_local_experts") or get(hf, "num_experts")
    top_k = hf.get("num_experts_per_tok") or get(hf, "experts_per_token")
    fields["moe"] = dict(num_experts=experts, experts_per_token=top_k, router_renormalize=True, every=1,
                         router_logit_bias=True, expert_bias=True)
    return fields


def _hf_fields(cfg: ModelConfig, router_aux_loss: float) -> dict[str, Any]:
    return {**config_json.core_hf(cfg, "gpt_oss"), "attention_bias": cfg.attention.bias,
            "sliding_window": cfg.attention.window or None, "layer_types": config_json.layer_types(cfg),
            "num_local_experts": cfg.moe.num_experts, "num_experts_per_tok": cfg.moe.experts_per_token,
            "experts_per_token": cfg.moe.experts_per_token, "intermediate_size": cfg.resolved_expert_dim,
            "swiglu_limit": cfg.swiglu_limit, "swiglu_alpha": cfg.swiglu_alpha,
            "router_aux_loss_coef": router_aux_loss, "output_router_logits": False}


def _split(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[..., 2f] gate and up interleaved -> (gate, up) [..., f]."""
    return x[..., 0::2], x[..., 1::2]


def _interleave(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    return np.stack([gate, up], axis=-1).reshape(*gate.shape[:-1], 2 * gate.shape[-1])


def _experts(cfg: ModelConfig, pre: str, stack: str, j: int, hf: dict | None) -> Iterator[Tensor]:
    """The router, its bias and the experts' matrices and biases of block ``pre``, plain or MXFP4."""
    e, d, f = cfg.moe.num_experts, cfg.embed_dim, cfg.resolved_expert_dim
    at, where = f"{stack}.mlp.", pre + "mlp."
    yield Tensor(where + "router.weight", (e, d), at + "router", (j,), *TRANSPOSE)
    yield Tensor(where + "router.bias", (e,), at + "router_logit_bias", (j,), *SAME)
    quantized = (hf or {}).get("quantization_config", {}).get("quant_method") == "mxfp4"
    gate_up, down = where + "experts.gate_up_proj", where + "experts.down_proj"
    both = ((at + "wi_up", (j,)),)
    if quantized:  # [E, out, in / 32, 16] blocks; dequantized [E, out, in], transposed to [E, in, out]
        yield Tensor(gate_up + "_blocks", (e, 2 * f, d // mxfp4.BLOCK, mxfp4.BLOCK // 2), at + "wi_gate", (j,),
                     lambda b, s: _split(np.swapaxes(mxfp4.dequantize(b, s), 1, 2)), _interleave, also=both,
                     read_with=(gate_up + "_scales",))
    else:
        yield Tensor(gate_up, (e, d, 2 * f), at + "wi_gate", (j,), _split, _interleave, also=both)
    yield Tensor(gate_up + "_bias", (e, 2 * f), at + "wi_gate_bias", (j,), _split, _interleave,
                 also=((at + "wi_up_bias", (j,)),))
    if quantized:
        yield Tensor(down + "_blocks", (e, d, f // mxfp4.BLOCK, mxfp4.BLOCK // 2), at + "wo", (j,),
                     lambda b, s: np.swapaxes(mxfp4.dequantize(b, s), 1, 2), lambda x: x,
                     read_with=(down + "_scales",))
    else:
        yield Tensor(down, (e, f, d), at + "wo", (j,), *SAME)
    yield Tensor(down + "_bias", (e, d), at + "wo_bias", (j,), *SAME)


def _tensors(cfg: ModelConfig, hf: dict | None = None) -> Iterator[Tensor]:
    """The Llama layout but for the experts (``_experts``), which every block has."""
    d = cfg.embed_dim
    yield Tensor("model.embed_tokens.weight", (cfg.vocab_size, d), "embedding", (), *SAME)
    for i in range(cfg.num_layers):
        pre = f"model.layers.{i}."
        yield Tensor(pre + "input_layernorm.weight", (d,), "moe_layers.attn_norm.scale", (i,), *SAME)
        yield from hf_tensors.attention(cfg, pre, "moe_layers", i, hf)
        yield Tensor(pre + "post_attention_layernorm.weight", (d,), "moe_layers.mlp_norm.scale", (i,), *SAME)
        yield from _experts(cfg, pre, "moe_layers", i, hf)
    yield Tensor("model.norm.weight", (d,), "final_norm.scale", (), *SAME)
    if not cfg.tie_embeddings:
        yield Tensor("lm_head.weight", (cfg.vocab_size, d), "head", (), *TRANSPOSE)


def _fixture() -> dict[str, Any]:
    """Four blocks alternating a 6-token window (of the fixtures' 24) and global attention, 4 experts top-2, the
    clamp low enough to bite, YaRN unrounded."""
    return dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=24, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=6,
                swiglu_limit=1.5, max_position_embeddings=128, rms_norm_eps=1e-5, tie_word_embeddings=False,
                rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "beta_fast": 32.0,
                                 "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 32})


GPT_OSS = Family(
    name="gpt_oss", model_type="gpt_oss", architectures=("GptOssForCausalLM",),
    description="alternating windowed and global layers with sinks and biases, experts with biases, clamped SwiGLU",
    model_fields=_model_fields, hf_fields=_hf_fields, tensors=_tensors, train_fields=config_json.router_loss_fields,
    mechanisms=frozenset({"yarn", "untruncated_yarn", "experts", "local_layers", "sinks", "attention_bias",
                          "clamped_swiglu", "router_logit_bias", "expert_bias"}),
    required=frozenset({"experts", "sinks", "clamped_swiglu", "router_logit_bias", "expert_bias"}),
    fixtures=(Fixture("gpt_oss", 8, _fixture()),),
)
