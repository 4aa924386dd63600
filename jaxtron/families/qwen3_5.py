"""Qwen3.5, dense (``Qwen3_5ForCausalLM``) and MoE (``Qwen3_5MoeForCausalLM``): three Gated DeltaNet blocks to
every full-attention one (``model.linear``). The attention block is Qwen3's with an output gate
(``model.attention.output_gate``), RoPE on a share of each head (``model.rope.fraction``) and norms that scale by
1 + weight. The MoE blocks add one shared expert gated by a sigmoid (``model.moe.shared_gate``) to experts routed
as Qwen3's, always renormalised.

Hugging Face stores each attention head's query and gate rows together in ``q_proj`` (the query's head_dim rows,
then the gate's), a Gated DeltaNet block's queries, keys and values in one ``in_proj_qkv`` (all query heads, then
all key heads, then all value heads) and their convolutions in one ``conv1d`` in the same order.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import numpy as np

from jaxtron.config.model import ModelConfig
from jaxtron.families import config_json, hf_tensors
from jaxtron.families.family import Family, Fixture, FormatError, Tensor
from jaxtron.families.hf_tensors import SAME, TRANSPOSE, Parts
from jaxtron.families.llama import VOCAB

MECHANISMS = frozenset({"qk_norm", "gated_deltanet", "output_gate", "partial_rope", "unit_offset_norms"})


def _text(hf: dict) -> dict:
    """The text model's keys: a multimodal config.json holds them in ``text_config``."""
    return {**hf, **hf["text_config"]} if isinstance(hf.get("text_config"), dict) else hf


def _model_fields(hf: dict, tensor_names) -> dict[str, Any]:
    hf = _text(hf)
    fields = config_json.core_fields(hf)
    layers, every = fields["num_layers"], int(hf.get("full_attention_interval", 4))
    types = hf.get("layer_types") or ["full_attention" if (i + 1) % every == 0 else "linear_attention"
                                      for i in range(layers)]
    every = config_json.last_of_every([kind == "full_attention" for kind in types])
    if not every or any(kind not in ("full_attention", "linear_attention") for kind in types):
        raise FormatError(f"config.json's layer_types ({list(types)[:8]}...) is not runs of Gated DeltaNet layers "
                          "each ended by a full-attention one, the pattern model.linear.every describes.")
    params = hf.get("rope_parameters") or {}
    fraction = float(params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 0.25)))
    fields["rope"]["fraction"] = fraction
    fields["attention"].update(qk_norm=True, output_gate=bool(hf.get("attn_output_gate", True)))
    fields["linear"] = dict(every=every, key_heads=config_json.get(hf, "linear_num_key_heads"),
                            value_heads=config_json.get(hf, "linear_num_value_heads"),
                            key_head_dim=config_json.get(hf, "linear_key_head_dim"),
                            value_head_dim=config_json.get(hf, "linear_value_head_dim"),
                            conv_kernel=config_json.get(hf, "linear_conv_kernel_dim"))
    fields["norm_unit_offset"] = True
    return fields


def _hf_fields(cfg: ModelConfig, router_aux_loss: float, model_type: str = "qwen3_5_text") -> dict[str, Any]:
    lin = cfg.linear
    hf = config_json.core_hf(cfg, model_type)
    theta = hf.pop("rope_theta")
    hf.pop("rope_scaling")
    hf.update(rope_parameters={"rope_type": "default", "rope_theta": theta, "partial_rotary_factor": cfg.rope.fraction},
              attn_output_gate=cfg.attention.output_gate, full_attention_interval=lin.every,
              layer_types=["linear_attention" if lin.is_linear(i) else "full_attention" for i in range(cfg.num_layers)],
              linear_num_key_heads=lin.key_heads, linear_num_value_heads=lin.value_heads,
              linear_key_head_dim=lin.key_head_dim, linear_value_head_dim=lin.value_head_dim,
              linear_conv_kernel_dim=lin.conv_kernel)
    return hf


def _moe_model_fields(hf: dict, tensor_names) -> dict[str, Any]:
    """Experts of width ``moe_intermediate_size`` in every block and one shared expert of
    ``shared_expert_intermediate_size``, which must be the experts' width (jaxtron's shared experts are
    multiples of it)."""
    text = _text(hf)
    fields = _model_fields(hf, tensor_names) if "intermediate_size" in text else \
        _model_fields({**text, "intermediate_size": text.get("moe_intermediate_size")}, tensor_names)
    width, shared = config_json.get(text, "moe_intermediate_size"), text.get("shared_expert_intermediate_size")
    if shared and shared % width:
        raise FormatError(f"config.json sets shared_expert_intermediate_size={shared}, not a multiple of "
                          f"moe_intermediate_size={width}, which jaxtron's shared experts need.")
    fields["moe"] = dict(num_experts=config_json.get(text, "num_experts"),
                         experts_per_token=config_json.get(text, "num_experts_per_tok"), expert_dim=width,
                         shared_experts=(shared or 0) // width, shared_gate=bool(shared), router_renormalize=True)
    return fields


def _moe_hf_fields(cfg: ModelConfig, router_aux_loss: float) -> dict[str, Any]:
    return {**_hf_fields(cfg, router_aux_loss, "qwen3_5_moe_text"), "num_experts": cfg.moe.num_experts,
            "num_experts_per_tok": cfg.moe.experts_per_token, "moe_intermediate_size": cfg.resolved_expert_dim,
            "shared_expert_intermediate_size": cfg.moe.shared_experts * cfg.resolved_expert_dim,
            "router_aux_loss_coef": router_aux_loss, "output_router_logits": False}


def _attention(cfg: ModelConfig, pre: str, stack: str, j: int, hf: dict | None) -> Iterator[Tensor]:
    """Grouped-query attention whose ``q_proj`` holds each head's query rows, then its gate rows."""
    n, d, h = cfg.attention.num_heads, cfg.embed_dim, cfg.resolved_head_dim
    yield Tensor(pre + "self_attn.q_proj.weight", (n * 2 * h, d), f"{stack}.attn.wq.weight", (j,),
                 lambda x: (x.T.reshape(d, n, 2, h)[:, :, 0], x.T.reshape(d, n, 2, h)[:, :, 1]),
                 lambda q, gate: np.stack([q, gate], axis=2).reshape(d, n * 2 * h).T,
                 also=((f"{stack}.attn.wg.weight", (j,)),))
    for tensor in hf_tensors.attention(cfg, pre, stack, j, hf):
        if ".q_proj." not in tensor.hf_name:
            yield tensor


def _delta_net(cfg: ModelConfig, pre: str, stack: str, j: int, hf: dict | None) -> Iterator[Tensor]:
    """A Gated DeltaNet block's projections, convolution, decay parameters and output norm."""
    lin, d, at = cfg.linear, cfg.embed_dim, pre + "linear_attn."
    hk, hv, dk, dv, taps = lin.key_heads, lin.value_heads, lin.key_head_dim, lin.value_head_dim, lin.conv_kernel
    cuts = np.cumsum([hk * dk, hk * dk])  # the query, key and value channels of in_proj_qkv and conv1d
    shapes = ((hk, dk), (hk, dk), (hv, dv))
    targets = tuple((f"{stack}.attn.{name}", (j,)) for name in ("wk.weight", "wv.weight"))

    def split(x: np.ndarray, lead: tuple[int, ...]) -> tuple[np.ndarray, ...]:  # [..., channels] -> per part
        return tuple(p.reshape(*lead, *s) for p, s in zip(np.split(x, cuts, axis=-1), shapes, strict=True))

    yield Tensor(at + "in_proj_qkv.weight", (2 * hk * dk + hv * dv, d), f"{stack}.attn.wq.weight", (j,),
                 lambda x: split(x.T, (d,)), lambda *p: np.concatenate([a.reshape(d, -1) for a in p], -1).T,
                 also=targets)
    conv_targets = tuple((f"{stack}.attn.{name}", (j,)) for name in ("conv_k", "conv_v"))
    yield Tensor(at + "conv1d.weight", (2 * hk * dk + hv * dv, 1, taps), f"{stack}.attn.conv_q", (j,),
                 lambda x: split(x[:, 0, :].T, (taps,)),
                 lambda *p: np.concatenate([a.reshape(taps, -1) for a in p], -1).T[:, None, :], also=conv_targets)
    yield Tensor(at + "in_proj_z.weight", (hv * dv, d), f"{stack}.attn.wz.weight", (j,),
                 lambda x: x.T.reshape(d, hv, dv), lambda x: x.reshape(d, hv * dv).T)
    for name, param in (("in_proj_b", "wb"), ("in_proj_a", "wa")):
        yield Tensor(at + f"{name}.weight", (hv, d), f"{stack}.attn.{param}.weight", (j,), *TRANSPOSE)
    yield Tensor(at + "dt_bias", (hv,), f"{stack}.attn.dt_bias", (j,), *SAME)
    yield Tensor(at + "A_log", (hv,), f"{stack}.attn.a_log", (j,), *SAME)
    yield Tensor(at + "norm.weight", (dv,), f"{stack}.attn.norm.scale", (j,), *SAME)
    yield Tensor(at + "out_proj.weight", (d, hv * dv), f"{stack}.attn.wo.weight", (j,),
                 lambda x: x.T.reshape(hv, dv, d), lambda x: x.reshape(hv * dv, d).T)


def _shared_expert(cfg: ModelConfig, pre: str, stack: str, j: int, hf: dict | None) -> Iterator[Tensor]:
    """The MoE block's shared expert and its gate (a [1, width] projection to one logit)."""
    width, d = cfg.moe.shared_experts * cfg.resolved_expert_dim, cfg.embed_dim
    yield from hf_tensors.mlp(pre + "mlp.shared_expert.", f"{stack}.mlp.shared.", width, d, j)
    yield Tensor(pre + "mlp.shared_expert_gate.weight", (1, d), f"{stack}.mlp.shared_gate", (j,),
                 lambda x: x[0], lambda x: x[None])


def _multimodal(hf: dict | None) -> bool:
    """Whether config.json is a published Qwen3.5 checkpoint's, with a vision encoder beside the text model."""
    return bool(hf) and isinstance(hf.get("text_config"), dict)


def _tensors(parts: Parts):
    """The checkpoint's tensors; a multimodal checkpoint holds the text model under ``model.language_model.``."""
    def tensors(cfg: ModelConfig, hf: dict | None) -> Iterator[Tensor]:
        for tensor in hf_tensors.tensors(cfg, hf, parts=parts):
            if _multimodal(hf) and tensor.hf_name.startswith("model."):
                tensor = dataclasses.replace(tensor, hf_name="model.language_model." + tensor.hf_name[6:])
            yield tensor
    return tensors


# a multimodal checkpoint's vision encoder and its multi-token prediction layer, which transformers' causal LM also
# leaves out
UNMODELLED = ("model.visual.", "mtp.")
PARTS = Parts(attention=_attention, linear=_delta_net)
MOE_PARTS = Parts(attention=_attention, linear=_delta_net, moe_extras=_shared_expert)
LINEAR = dict(linear_conv_kernel_dim=4, linear_key_head_dim=8, linear_value_head_dim=16, linear_num_key_heads=2,
              linear_num_value_heads=4)


def _layer_types(layers: int) -> list[str]:
    """config.json's layer_types of the fixtures: every fourth layer attends fully."""
    return ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)]

ROPE = {"rope_type": "default", "rope_theta": 10_000.0, "partial_rotary_factor": 0.5}

QWEN3_5 = Family(
    name="qwen3_5", model_type="qwen3_5_text", architectures=("Qwen3_5ForCausalLM", "Qwen3_5ForConditionalGeneration"),
    description="Gated DeltaNet blocks among gated attention ones (model.linear.every)",
    model_fields=_model_fields, hf_fields=_hf_fields, tensors=_tensors(PARTS), unmodelled=UNMODELLED,
    mechanisms=MECHANISMS, required=frozenset({"gated_deltanet", "unit_offset_norms"}),
    # two periods of three DeltaNet blocks and a gated attention one; value heads twice the key heads
    fixtures=(Fixture("qwen3_5", 11, dict(
        vocab_size=VOCAB, hidden_size=48, intermediate_size=80, num_hidden_layers=8, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=256, rms_norm_eps=1e-6, tie_word_embeddings=False,
        rope_parameters=dict(ROPE), layer_types=_layer_types(8), **LINEAR), length=88),),
)

QWEN3_5_MOE = Family(
    name="qwen3_5_moe", model_type="qwen3_5_moe_text",
    architectures=("Qwen3_5MoeForCausalLM", "Qwen3_5MoeForConditionalGeneration"),
    description="Gated DeltaNet blocks and experts with a gated shared expert",
    model_fields=_moe_model_fields, hf_fields=_moe_hf_fields, tensors=_tensors(MOE_PARTS), unmodelled=UNMODELLED,
    train_fields=lambda hf: config_json.router_loss_fields(_text(hf)),
    mechanisms=MECHANISMS | {"experts", "shared_experts", "shared_gate"},
    required=frozenset({"gated_deltanet", "unit_offset_norms", "experts"}),
    # one period: three DeltaNet MoE blocks and an attention MoE block, 4 experts of 24, top-2, a shared one
    fixtures=(Fixture("qwen3_5_moe", 12, dict(
        vocab_size=VOCAB, hidden_size=32, moe_intermediate_size=24, shared_expert_intermediate_size=24,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4,
        num_experts_per_tok=2, max_position_embeddings=256, rms_norm_eps=1e-6, rope_parameters=dict(ROPE),
        layer_types=_layer_types(4), **LINEAR), length=88),),
)
