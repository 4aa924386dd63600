"""Llama 4, text (``Llama4ForCausalLM``; the text model of ``Llama4ForConditionalGeneration``): chunked local
attention with RoPE on three of every four layers (``model.attention.chunk``), global layers without RoPE whose
queries grow with the log of the position (``global_nope``, ``temperature_floor``), weightless query and key norms
on the rotated layers (``qk_l2_norm``), and experts on every block (Scout) or every second one (Maverick): top-1 of
a sigmoid router whose weight scales the expert's input (``moe.scale_input``), beside a shared expert.

Hugging Face rotates each head's dimensions in interleaved pairs; jaxtron rotates halves, so the query and key
rows are permuted on import (evens, then odds) and back on export. The permutation leaves a layer without RoPE as it
was: queries and keys move alike. The experts' gate and up projections are one [experts, in, 2 x width] tensor
(gate, then up) and the down projections one [experts, width, in]. A published checkpoint holds the text model
under ``language_model.``, its config.json's keys in ``text_config``, beside a vision encoder left out.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import numpy as np

from jaxtron.config.model import ModelConfig
from jaxtron.families import config_json, hf_tensors
from jaxtron.families.family import Family, Fixture, FormatError, Tensor
from jaxtron.families.hf_tensors import SAME, TRANSPOSE
from jaxtron.families.llama import ROPE, VOCAB

get = config_json.get


def _text(hf: dict) -> dict:
    """The text model's keys: a multimodal config.json holds them in ``text_config``."""
    return {**hf, **hf["text_config"]} if isinstance(hf.get("text_config"), dict) else hf


def _every(marked: list[bool], what: str) -> int:
    """The period of a layer pattern where the last of every k layers is marked (0: none is); FormatError for
    another pattern."""
    every = config_json.last_of_every(marked)
    if every is None:
        raise FormatError(f"config.json's {what} are not the last of every k layers, the pattern jaxtron describes.")
    return every


def _attention(hf: dict, layers: int) -> dict[str, Any]:
    """``model.attention``'s local/global fields: chunked layers among full ones, NoPE on the full ones."""
    rope = [bool(r) for r in (hf.get("no_rope_layers") or
                              [(i + 1) % int(hf.get("no_rope_layer_interval", 4)) != 0 for i in range(layers)])]
    types = hf.get("layer_types") or ["chunked_attention" if r else "full_attention" for r in rope]
    if any(t not in ("chunked_attention", "full_attention") for t in types) or len(types) != layers:
        raise FormatError(f"config.json's layer_types ({types[:8]}...) are not chunked_attention and full_attention "
                          "layers, one a layer.")
    full = [t == "full_attention" for t in types]
    every = _every(full, "full-attention layers")
    if not all(rope) and [not r for r in rope] != full:
        raise FormatError("config.json's no_rope_layers are not its full-attention layers, which jaxtron's Llama 4 "
                          "needs (model.attention.global_nope).")
    chunk = int(get(hf, "attention_chunk_size")) if not all(full) else 0
    nope = not all(rope)
    tuning = nope and bool(hf.get("attn_temperature_tuning", True))
    return dict(chunk=chunk, global_every=every if chunk else 0, global_nope=nope,
                temperature_floor=int(get(hf, "floor_scale", 8192)) if tuning else 0,
                temperature_scale=float(get(hf, "attn_scale", 0.1)), qk_l2_norm=bool(hf.get("use_qk_norm", True)))


def _model_fields(hf: dict, tensor_names) -> dict[str, Any]:
    hf = _text(hf)
    layers = get(hf, "num_hidden_layers")
    fields = config_json.core_fields({**hf, "intermediate_size": get(hf, "intermediate_size_mlp")})
    fields["attention"].update(_attention(hf, layers))
    moe_layers = hf.get("moe_layers")
    step = int(hf.get("interleave_moe_layer_step", 1))
    marked = [i in moe_layers for i in range(layers)] if moe_layers is not None else \
        [(i + 1) % step == 0 for i in range(layers)]
    every = _every(marked, "MoE layers")
    if not every:
        raise FormatError("config.json places no MoE layer; jaxtron's Llama 4 has experts.")
    fields["moe"] = dict(num_experts=get(hf, "num_local_experts"), experts_per_token=get(hf, "num_experts_per_tok"),
                         expert_dim=get(hf, "intermediate_size"), shared_experts=1, every=every, router="sigmoid",
                         router_renormalize=False, balance_bias=False, scale_input=True)
    return fields


def _hf_fields(cfg: ModelConfig, router_aux_loss: float) -> dict[str, Any]:
    a, layers = cfg.attention, range(cfg.num_layers)
    hf = config_json.core_hf(cfg, "llama4_text")
    hf.update(intermediate_size=cfg.resolved_expert_dim, intermediate_size_mlp=cfg.mlp_dim,
              num_local_experts=cfg.moe.num_experts, num_experts_per_tok=cfg.moe.experts_per_token,
              interleave_moe_layer_step=cfg.moe.every, moe_layers=[i for i in layers if cfg.is_moe_block(i)],
              use_qk_norm=a.qk_l2_norm, no_rope_layers=[int(a.rotates(cfg.is_local_block(i))) for i in layers],
              attention_chunk_size=a.chunk or cfg.max_seq_len,
              layer_types=["chunked_attention" if cfg.is_local_block(i) else "full_attention" for i in layers],
              attn_temperature_tuning=bool(a.temperature_floor), floor_scale=a.temperature_floor or 8192,
              attn_scale=a.temperature_scale, router_aux_loss_coef=router_aux_loss, output_router_logits=False)
    return hf


def _halves(h: int) -> tuple[np.ndarray, np.ndarray]:
    """(the order that puts a head's interleaved rotary pairs in rotate-half order, its inverse)."""
    order = hf_tensors.halves(h, 0)
    return order, np.argsort(order)


def _attention_tensors(cfg: ModelConfig, pre: str, stack: str, j: int, hf: dict | None) -> Iterator[Tensor]:
    """Grouped-query attention with each head's query and key rows put in rotate-half order."""
    d, h = cfg.embed_dim, cfg.resolved_head_dim
    order, back = _halves(h)
    for tensor in hf_tensors.attention(cfg, pre, stack, j, hf):
        if tensor.hf_name.endswith(("q_proj.weight", "k_proj.weight")):
            count = tensor.shape[0] // h
            tensor = dataclasses.replace(
                tensor, to_jaxtron=lambda x, c=count: x.T.reshape(d, c, h)[..., order],
                to_hf=lambda x, c=count: x[..., back].reshape(d, c * h).T)
        yield tensor


def _feed_forward(cfg: ModelConfig, pre: str, stack: str, j: int, moe: bool) -> Iterator[Tensor]:
    """A dense block's SwiGLU, or an MoE block's router, experts and shared expert."""
    where, at = pre + "feed_forward.", f"{stack}.mlp."
    if not moe:
        yield from hf_tensors.mlp(where, at, cfg.mlp_dim, cfg.embed_dim, j)
        return
    e, d, f = cfg.moe.num_experts, cfg.embed_dim, cfg.resolved_expert_dim
    yield Tensor(where + "router.weight", (e, d), at + "router", (j,), *TRANSPOSE)
    yield Tensor(where + "experts.gate_up_proj", (e, d, 2 * f), at + "wi_gate", (j,),
                 lambda x: (x[..., :f], x[..., f:]), lambda gate, up: np.concatenate([gate, up], axis=-1),
                 also=((at + "wi_up", (j,)),))
    yield Tensor(where + "experts.down_proj", (e, f, d), at + "wo", (j,), *SAME)
    yield from hf_tensors.mlp(where + "shared_expert.", at + "shared.", f, d, j)


def _causal_lm(cfg: ModelConfig, hf: dict | None) -> Iterator[Tensor]:
    """``Llama4ForCausalLM``'s tensors, in file order."""
    d = cfg.embed_dim
    yield Tensor("model.embed_tokens.weight", (cfg.vocab_size, d), "embedding", (), *SAME)
    seen = {"layers": 0, "moe_layers": 0}
    for i in range(cfg.num_layers):
        moe = cfg.is_moe_block(i)
        stack = "moe_layers" if moe else "layers"
        j, pre = seen[stack], f"model.layers.{i}."
        seen[stack] += 1
        yield Tensor(pre + "input_layernorm.weight", (d,), f"{stack}.attn_norm.scale", (j,), *SAME)
        yield from _attention_tensors(cfg, pre, stack, j, hf)
        yield Tensor(pre + "post_attention_layernorm.weight", (d,), f"{stack}.mlp_norm.scale", (j,), *SAME)
        yield from _feed_forward(cfg, pre, stack, j, moe)
    yield Tensor("model.norm.weight", (d,), "final_norm.scale", (), *SAME)
    if not cfg.tie_embeddings:
        yield Tensor("lm_head.weight", (cfg.vocab_size, d), "head", (), *TRANSPOSE)


def _tensors(cfg: ModelConfig, hf: dict | None = None) -> Iterator[Tensor]:
    """The checkpoint's tensors; a multimodal one's text model sits under ``language_model.``."""
    multimodal = bool(hf) and isinstance(hf.get("text_config"), dict)
    for tensor in _causal_lm(cfg, hf):
        yield dataclasses.replace(tensor, hf_name="language_model." + tensor.hf_name) if multimodal else tensor


def _fixture(every: int, qk_norm: bool, top_k: int, rope: dict) -> dict[str, Any]:
    """Four layers: three chunked ones (chunks of 8 of the fixtures' 24 tokens) and a NoPE one whose temperature
    changes every 4 positions."""
    return dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=24, intermediate_size_mlp=40,
                num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                num_local_experts=4, num_experts_per_tok=top_k, interleave_moe_layer_step=every,
                use_qk_norm=qk_norm, attention_chunk_size=8, floor_scale=4, attn_scale=0.5,
                max_position_embeddings=128, rms_norm_eps=1e-5, tie_word_embeddings=False, rope_parameters=rope)


LLAMA4 = Family(
    name="llama4", model_type="llama4_text", architectures=("Llama4ForCausalLM", "Llama4ForConditionalGeneration"),
    description="chunked RoPE layers and global NoPE ones, top-1 sigmoid experts scaling their input, a shared one",
    model_fields=_model_fields, hf_fields=_hf_fields, tensors=_tensors,
    train_fields=lambda hf: config_json.router_loss_fields(_text(hf)),
    unmodelled=("vision_model.", "multi_modal_projector."),
    mechanisms=frozenset({"llama3_rope", "experts", "sparse_step", "shared_experts", "sigmoid_router",
                          "unnormalized_router", "chunked_attention", "nope_layers", "temperature_tuning",
                          "qk_l2_norm", "input_scaled_experts", "no_balance_bias"}),
    required=frozenset({"experts", "shared_experts", "sigmoid_router", "unnormalized_router", "input_scaled_experts",
                        "no_balance_bias"}),
    # Scout's kind (experts in every block, top-1, query and key norms, Llama-3.1 RoPE bands) and Maverick's
    # (experts in every second block, top-2 here, no norms, plain RoPE)
    fixtures=(Fixture("llama4", 13, _fixture(1, True, 1, dict(ROPE))),
              Fixture("llama4_maverick", 14, _fixture(2, False, 2, {"rope_type": "default",
                                                                     "rope_theta": 500000.0}))),
)
