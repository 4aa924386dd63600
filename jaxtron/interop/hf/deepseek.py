"""DeepSeek-V3 in Hugging Face form (``DeepseekV3ForCausalLM``): config.json <-> ModelConfig, and tensor names.

Latent attention's tensors map one to one onto ``LatentAttention``'s parameters: ``q_a_proj``/``q_b_proj`` (or
``q_proj``), ``kv_a_proj_with_mqa`` (the latent and the shared rotated key in one matrix), ``kv_b_proj`` and
``o_proj``, each transposed and its heads split out. DeepSeek's checkpoints store the rotated dimensions of
queries and keys in interleaved pairs (``rope_interleave``); jaxtron rotates halves, so those rows are permuted
(evens, then odds) on the way in and back on the way out, which changes no value. The first
``first_k_dense_replace`` blocks are dense, the rest MoE: routed experts, a shared expert and the sigmoid router
with its ``e_score_correction_bias``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from jaxtron.config.schema import ModelConfig
from jaxtron.interop.hf.safetensors import FormatError


def model_fields(hf: dict, get: Callable, tensor_names: Any = ()) -> dict[str, Any]:
    """The ModelConfig fields particular to DeepSeek-V3, per group (``get(hf, key[, default])`` reads a required
    key). The
    multi-token prediction modules that config.json announces (``num_nextn_predict_layers``) come along when the
    checkpoint's ``tensor_names`` hold the first one's projection; transformers writes the field for models
    without them."""
    heads = get(hf, "num_attention_heads")
    if get(hf, "num_key_value_heads", heads) != heads:
        raise FormatError(f"config.json sets num_key_value_heads={hf['num_key_value_heads']} with "
                          f"num_attention_heads={heads}; latent attention has one key and value head per query head.")
    for key, ok in (("scoring_func", "sigmoid"), ("topk_method", "noaux_tc"), ("moe_layer_freq", 1)):
        if hf.get(key, ok) != ok:
            raise FormatError(f"config.json sets {key}={hf[key]!r}; jaxtron's DeepSeek-V3 needs {key}={ok!r}.")
    depth = int(hf.get("num_nextn_predict_layers") or 0)
    mtp = depth if f"model.layers.{get(hf, 'num_hidden_layers')}.eh_proj.weight" in tensor_names else 0
    attention = dict(num_kv_heads=heads, head_dim=get(hf, "qk_nope_head_dim"),
                     qk_rope_head_dim=get(hf, "qk_rope_head_dim"), v_head_dim=get(hf, "v_head_dim"),
                     q_lora_rank=get(hf, "q_lora_rank", 0), kv_lora_rank=get(hf, "kv_lora_rank"))
    moe = dict(num_experts=get(hf, "n_routed_experts"), experts_per_token=get(hf, "num_experts_per_tok"),
               expert_dim=get(hf, "moe_intermediate_size"), shared_experts=get(hf, "n_shared_experts", 0),
               first_dense_layers=get(hf, "first_k_dense_replace", 0), every=1, router="sigmoid",
               router_groups=get(hf, "n_group", 1), router_top_groups=get(hf, "topk_group", 1),
               router_scale=float(get(hf, "routed_scaling_factor", 1.0)),
               router_renormalize=bool(get(hf, "norm_topk_prob", False)))
    return {"attention": attention, "moe": moe, "mtp": dict(depth=mtp)}


def hf_fields(cfg: ModelConfig) -> dict[str, Any]:
    """config.json's DeepSeek-V3 fields of a jaxtron model with latent attention and a sigmoid router."""
    if not (cfg.moe.num_experts and cfg.moe.router == "sigmoid" and cfg.moe.every == 1):
        raise FormatError("a model with latent attention exports as DeepSeek-V3, which needs experts in every block "
                          "after the first dense ones (model.moe.every=1) and model.moe.router='sigmoid'.")
    return {"qk_nope_head_dim": cfg.resolved_head_dim, "qk_rope_head_dim": cfg.attention.qk_rope_head_dim,
            "head_dim": cfg.attention.qk_rope_head_dim, "qk_head_dim": cfg.qk_head_dim,
            "v_head_dim": cfg.resolved_v_head_dim,
            "q_lora_rank": cfg.attention.q_lora_rank or None, "kv_lora_rank": cfg.attention.kv_lora_rank,
            "n_routed_experts": cfg.moe.num_experts, "num_experts_per_tok": cfg.moe.experts_per_token,
            "moe_intermediate_size": cfg.resolved_expert_dim, "n_shared_experts": cfg.moe.shared_experts,
            "first_k_dense_replace": cfg.moe.first_dense_layers, "n_group": cfg.moe.router_groups,
            "topk_group": cfg.moe.router_top_groups, "routed_scaling_factor": cfg.moe.router_scale,
            "norm_topk_prob": cfg.moe.router_renormalize, "rope_interleave": True,
            "num_nextn_predict_layers": cfg.mtp.depth}


def _halves(size: int, start: int) -> np.ndarray:
    """Index that puts the interleaved rotary pairs of dims start..start+size-1 in rotate-half order."""
    rotary = start + np.concatenate([np.arange(0, size, 2), np.arange(1, size, 2)])
    return np.concatenate([np.arange(start), rotary])


def attention_tensors(cfg: ModelConfig, pre: str, stack: str, j: int, tensor: Callable,
                      interleaved: bool = True) -> Iterator:
    """The latent attention tensors of block ``pre`` (``tensor(hf_name, shape, param, index, to_jaxtron,
    to_hf)`` builds one)."""
    a = cfg.attention
    d, n, rope, rank = cfg.embed_dim, a.num_heads, a.qk_rope_head_dim, a.kv_lora_rank
    nope, qk, v = cfg.resolved_head_dim, cfg.qk_head_dim, cfg.resolved_v_head_dim
    q_order = _halves(rope, nope) if interleaved else np.arange(qk)
    kv_order = _halves(rope, rank) if interleaved else np.arange(rank + rope)
    q_back, kv_back = np.argsort(q_order), np.argsort(kv_order)
    att = f"{stack}.attn."

    def query(rows):  # [n*qk, rows] <-> [rows, n, qk]
        return (lambda x: x.T.reshape(rows, n, qk)[..., q_order],
                lambda x: x[..., q_back].reshape(rows, n * qk).T)

    if cfg.attention.q_lora_rank:
        r = cfg.attention.q_lora_rank
        yield tensor(pre + "self_attn.q_a_proj.weight", (r, d), att + "wq_a.weight", (j,), *TRANSPOSE)
        yield tensor(pre + "self_attn.q_a_layernorm.weight", (r,), att + "q_norm.scale", (j,), *SAME)
        yield tensor(pre + "self_attn.q_b_proj.weight", (n * qk, r), att + "wq_b.weight", (j,), *query(r))
    else:
        yield tensor(pre + "self_attn.q_proj.weight", (n * qk, d), att + "wq.weight", (j,), *query(d))
    yield tensor(pre + "self_attn.kv_a_proj_with_mqa.weight", (rank + rope, d), att + "wkv_a.weight", (j,),
                 lambda x: x.T[:, kv_order], lambda x: x[:, kv_back].T)
    yield tensor(pre + "self_attn.kv_a_layernorm.weight", (rank,), att + "kv_norm.scale", (j,), *SAME)
    yield tensor(pre + "self_attn.kv_b_proj.weight", (n * (nope + v), rank), att + "wkv_b.weight", (j,),
                 lambda x: x.T.reshape(rank, n, nope + v), lambda x: x.reshape(rank, n * (nope + v)).T)
    yield tensor(pre + "self_attn.o_proj.weight", (d, n * v), att + "wo.weight", (j,),
                 lambda x: x.T.reshape(n, v, d), lambda x: x.reshape(n * v, d).T)


def moe_extras(cfg: ModelConfig, pre: str, stack: str, j: int, tensor: Callable) -> Iterator:
    """What a DeepSeek-V3 MoE block has besides Qwen3-MoE's router and experts: the balancing bias and the
    shared expert."""
    d = cfg.embed_dim
    mlp = f"{stack}.mlp."
    yield tensor(pre + "mlp.gate.e_score_correction_bias", (cfg.moe.num_experts,), mlp + "router_bias", (j,), *SAME)
    if cfg.moe.shared_experts:
        s = cfg.moe.shared_experts * cfg.resolved_expert_dim
        for hf_name, name, shape in (("gate_proj", "wi_gate", (s, d)), ("up_proj", "wi_up", (s, d)),
                                     ("down_proj", "wo", (d, s))):
            yield tensor(pre + f"mlp.shared_experts.{hf_name}.weight", shape, mlp + f"shared.{name}.weight", (j,),
                         *TRANSPOSE)


def mtp_tensors(cfg: ModelConfig, pre: str, k: int, tensor: Callable) -> Iterator:
    """Multi-token prediction module k's own tensors (its block's follow under the same prefix): the two input
    norms, the projection of [embedding; hidden] and the final norm, and the copies of the token embedding and
    output head that DeepSeek's checkpoints keep in every module (jaxtron shares the model's)."""
    d, v = cfg.embed_dim, cfg.vocab_size
    yield tensor(pre + "embed_tokens.weight", (v, d), "embedding", (), *SAME, copy=True)
    yield tensor(pre + "enorm.weight", (d,), "mtp.embed_norm.scale", (k,), *SAME)
    yield tensor(pre + "hnorm.weight", (d,), "mtp.hidden_norm.scale", (k,), *SAME)
    yield tensor(pre + "eh_proj.weight", (d, 2 * d), "mtp.proj.weight", (k,), *TRANSPOSE)
    yield tensor(pre + "shared_head.norm.weight", (d,), "mtp.norm.scale", (k,), *SAME)
    yield tensor(pre + "shared_head.head.weight", (v, d), "embedding" if cfg.tie_embeddings else "head", (),
                 *(SAME if cfg.tie_embeddings else TRANSPOSE), copy=True)


SAME = (lambda x: x, lambda x: x)  # (to jaxtron, to Hugging Face) of a tensor stored alike in both
TRANSPOSE = (lambda x: x.T, lambda x: x.T)  # of a matrix, [out, in] there and [in, out] here
