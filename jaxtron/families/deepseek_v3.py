"""DeepSeek-V3 (``DeepseekV3ForCausalLM``): multi-head latent attention, a dense prefix, routed experts with a
shared expert and the sigmoid router with its balancing bias (``e_score_correction_bias``), multi-token prediction.

Latent attention's tensors map one to one onto ``LatentAttention``'s projections: ``q_a_proj``/``q_b_proj`` (or
``q_proj``), ``kv_a_proj_with_mqa`` (the latent and the shared rotated key in one matrix), ``kv_b_proj`` and
``o_proj``, each transposed and its heads split out. DeepSeek's checkpoints store the rotated dimensions of queries
and keys in interleaved pairs (``rope_interleave``); jaxtron rotates halves, so those rows are permuted (evens, then
odds) on the way in and back on the way out, which changes no value. The first ``first_k_dense_replace`` blocks are
dense. The prediction modules are the layers after the last, with copies of the embedding and the head.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

from jaxtron.config.model import ModelConfig
from jaxtron.families import config_json, hf_tensors
from jaxtron.families.family import Family, Fixture, FormatError, Tensor
from jaxtron.families.hf_tensors import SAME, TRANSPOSE
from jaxtron.families.llama import VOCAB

get = config_json.get


def _model_fields(hf: dict, tensor_names) -> dict[str, Any]:
    """The multi-token prediction modules config.json announces (``num_nextn_predict_layers``) come along when the
    checkpoint's ``tensor_names`` hold the first one's projection; transformers writes the field for models
    without them."""
    fields = config_json.core_fields(hf)
    heads = get(hf, "num_attention_heads")
    if get(hf, "num_key_value_heads", heads) != heads:
        raise FormatError(f"config.json sets num_key_value_heads={hf['num_key_value_heads']} with "
                          f"num_attention_heads={heads}; latent attention has one key and value head per query head.")
    for key, ok in (("scoring_func", "sigmoid"), ("topk_method", "noaux_tc"), ("moe_layer_freq", 1)):
        if hf.get(key, ok) != ok:
            raise FormatError(f"config.json sets {key}={hf[key]!r}; jaxtron's DeepSeek-V3 needs {key}={ok!r}.")
    depth = int(hf.get("num_nextn_predict_layers") or 0)
    mtp = depth if f"model.layers.{get(hf, 'num_hidden_layers')}.eh_proj.weight" in tensor_names else 0
    fields["attention"].update(num_kv_heads=heads, head_dim=get(hf, "qk_nope_head_dim"),
                               qk_rope_head_dim=get(hf, "qk_rope_head_dim"), v_head_dim=get(hf, "v_head_dim"),
                               q_lora_rank=get(hf, "q_lora_rank", 0), kv_lora_rank=get(hf, "kv_lora_rank"))
    fields["moe"] = dict(num_experts=get(hf, "n_routed_experts"), experts_per_token=get(hf, "num_experts_per_tok"),
                         expert_dim=get(hf, "moe_intermediate_size"), shared_experts=get(hf, "n_shared_experts", 0),
                         first_dense_layers=get(hf, "first_k_dense_replace", 0), every=1, router="sigmoid",
                         router_groups=get(hf, "n_group", 1), router_top_groups=get(hf, "topk_group", 1),
                         router_scale=float(get(hf, "routed_scaling_factor", 1.0)),
                         router_renormalize=bool(get(hf, "norm_topk_prob", False)))
    fields["mtp"] = dict(depth=mtp)
    return fields


def _hf_fields(cfg: ModelConfig, router_aux_loss: float) -> dict[str, Any]:
    return {**config_json.core_hf(cfg, "deepseek_v3"),
            "qk_nope_head_dim": cfg.resolved_head_dim, "qk_rope_head_dim": cfg.attention.qk_rope_head_dim,
            "head_dim": cfg.attention.qk_rope_head_dim, "qk_head_dim": cfg.qk_head_dim,
            "v_head_dim": cfg.resolved_v_head_dim,
            "q_lora_rank": cfg.attention.q_lora_rank or None, "kv_lora_rank": cfg.attention.kv_lora_rank,
            "n_routed_experts": cfg.moe.num_experts, "num_experts_per_tok": cfg.moe.experts_per_token,
            "moe_intermediate_size": cfg.resolved_expert_dim, "n_shared_experts": cfg.moe.shared_experts,
            "first_k_dense_replace": cfg.moe.first_dense_layers, "n_group": cfg.moe.router_groups,
            "topk_group": cfg.moe.router_top_groups, "routed_scaling_factor": cfg.moe.router_scale,
            "norm_topk_prob": cfg.moe.router_renormalize, "rope_interleave": True,
            "num_nextn_predict_layers": cfg.mtp.depth}


def _attention(cfg: ModelConfig, pre: str, stack: str, j: int, hf: dict | None) -> Iterator[Tensor]:
    """Latent attention's tensors of block ``pre`` (an export writes interleaved rotary rows)."""
    a = cfg.attention
    d, n, rope, rank = cfg.embed_dim, a.num_heads, a.qk_rope_head_dim, a.kv_lora_rank
    nope, qk, v = cfg.resolved_head_dim, cfg.qk_head_dim, cfg.resolved_v_head_dim
    interleaved = bool((hf or {}).get("rope_interleave", True))
    q_order = hf_tensors.halves(rope, nope) if interleaved else np.arange(qk)
    kv_order = hf_tensors.halves(rope, rank) if interleaved else np.arange(rank + rope)
    q_back, kv_back = np.argsort(q_order), np.argsort(kv_order)
    att = f"{stack}.attn."

    def query(rows):  # [n*qk, rows] <-> [rows, n, qk]
        return (lambda x: x.T.reshape(rows, n, qk)[..., q_order],
                lambda x: x[..., q_back].reshape(rows, n * qk).T)

    if a.q_lora_rank:
        r = a.q_lora_rank
        yield Tensor(pre + "self_attn.q_a_proj.weight", (r, d), att + "wq_a.weight", (j,), *TRANSPOSE)
        yield Tensor(pre + "self_attn.q_a_layernorm.weight", (r,), att + "q_norm.scale", (j,), *SAME)
        yield Tensor(pre + "self_attn.q_b_proj.weight", (n * qk, r), att + "wq_b.weight", (j,), *query(r))
    else:
        yield Tensor(pre + "self_attn.q_proj.weight", (n * qk, d), att + "wq.weight", (j,), *query(d))
    yield Tensor(pre + "self_attn.kv_a_proj_with_mqa.weight", (rank + rope, d), att + "wkv_a.weight", (j,),
                 lambda x: x.T[:, kv_order], lambda x: x[:, kv_back].T)
    yield Tensor(pre + "self_attn.kv_a_layernorm.weight", (rank,), att + "kv_norm.scale", (j,), *SAME)
    yield Tensor(pre + "self_attn.kv_b_proj.weight", (n * (nope + v), rank), att + "wkv_b.weight", (j,),
                 lambda x: x.T.reshape(rank, n, nope + v), lambda x: x.reshape(rank, n * (nope + v)).T)
    yield Tensor(pre + "self_attn.o_proj.weight", (d, n * v), att + "wo.weight", (j,),
                 lambda x: x.T.reshape(n, v, d), lambda x: x.reshape(n * v, d).T)


def _moe_extras(cfg: ModelConfig, pre: str, stack: str, j: int, hf: dict | None) -> Iterator[Tensor]:
    """What an MoE block has besides Qwen3-MoE's router and experts: the balancing bias and the shared expert."""
    yield Tensor(pre + "mlp.gate.e_score_correction_bias", (cfg.moe.num_experts,), f"{stack}.mlp.router_bias",
                 (j,), *SAME)
    if cfg.moe.shared_experts:
        yield from hf_tensors.mlp(pre + "mlp.shared_experts.", f"{stack}.mlp.shared.",
                                  cfg.moe.shared_experts * cfg.resolved_expert_dim, cfg.embed_dim, j)


def _prediction_modules(cfg: ModelConfig, hf: dict | None) -> Iterator[Tensor]:
    """Module k's own tensors (the two input norms, the projection of [embedding; hidden], the final norm, and the
    copies of the embedding and head that DeepSeek's checkpoints keep in every module: jaxtron shares the model's),
    then its block's, as the layers after the last."""
    d, v = cfg.embed_dim, cfg.vocab_size
    for k in range(cfg.mtp.depth):
        pre = f"model.layers.{cfg.num_layers + k}."
        yield Tensor(pre + "embed_tokens.weight", (v, d), "embedding", (), *SAME, copy=True)
        yield Tensor(pre + "enorm.weight", (d,), "mtp.embed_norm.scale", (k,), *SAME)
        yield Tensor(pre + "hnorm.weight", (d,), "mtp.hidden_norm.scale", (k,), *SAME)
        yield Tensor(pre + "eh_proj.weight", (d, 2 * d), "mtp.proj.weight", (k,), *TRANSPOSE)
        yield Tensor(pre + "shared_head.norm.weight", (d,), "mtp.norm.scale", (k,), *SAME)
        yield Tensor(pre + "shared_head.head.weight", (v, d), "embedding" if cfg.tie_embeddings else "head", (),
                     *(SAME if cfg.tie_embeddings else TRANSPOSE), copy=True)
        yield from hf_tensors.block(cfg, pre, "mtp.block", k, cfg.moe.num_experts > 0, hf, parts=PARTS)


PARTS = hf_tensors.Parts(attention=_attention, moe_extras=_moe_extras, after=_prediction_modules)


def _tensors(cfg: ModelConfig, hf: dict | None = None) -> Iterator[Tensor]:
    return hf_tensors.tensors(cfg, hf, parts=PARTS)


def _train_fields(hf: dict) -> dict[str, float]:
    return {"router_aux_loss": 0.0, "router_z_loss": 0.0}  # balanced by its router bias, no loss coefficient


def _fixture(low_rank_query: bool) -> dict[str, Any]:
    """Latent attention (with a low-rank query and YaRN, or a full-rank one and the default RoPE), one dense block
    then MoE blocks of 8 experts in 4 groups (top-2 groups, top-2 experts) plus a shared expert."""
    rope = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 32,
            "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0} if low_rank_query else \
        {"rope_type": "default", "rope_theta": 10000.0}
    return dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=3,
                first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=4,
                q_lora_rank=24 if low_rank_query else None, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=12,
                v_head_dim=10, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, n_group=4, topk_group=2,
                norm_topk_prob=True, routed_scaling_factor=2.5, max_position_embeddings=128, rms_norm_eps=1e-6,
                rope_interleave=True, tie_word_embeddings=False, rope_parameters=rope)


DEEPSEEK_V3 = Family(
    name="deepseek_v3", model_type="deepseek_v3", architectures=("DeepseekV3ForCausalLM",),
    description="latent attention (model.attention.kv_lora_rank > 0), the sigmoid router, shared experts",
    model_fields=_model_fields, hf_fields=_hf_fields, tensors=_tensors, train_fields=_train_fields,
    mechanisms=frozenset({"llama3_rope", "yarn", "latent_attention", "experts", "dense_prefix", "shared_experts",
                          "sigmoid_router", "unnormalized_router", "router_scale", "multi_token_prediction"}),
    required=frozenset({"latent_attention", "experts", "sigmoid_router"}),
    fixtures=(Fixture("deepseek_v3", 5, _fixture(low_rank_query=True)),
              Fixture("deepseek_v3_q", 6, _fixture(low_rank_query=False), v4=True)),
)
