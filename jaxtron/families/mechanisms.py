"""The mechanisms a model config switches on beyond the core every family shares (grouped-query attention, SwiGLU,
RMSNorm, RoPE), each with the field that switches it on. A family declares which of them it can express and which
it needs; ``check`` refuses an export that its family could not represent, naming the field, so that nothing is
written that Hugging Face would read as another model."""

from __future__ import annotations

from collections.abc import Callable

from jaxtron.config.model import ModelConfig

# name -> (whether a config uses it, the field that switches it on)
MECHANISMS: dict[str, tuple[Callable[[ModelConfig], bool], str]] = {
    "qk_norm": (lambda c: c.attention.qk_norm, "model.attention.qk_norm"),
    "latent_attention": (lambda c: c.latent_attention, "model.attention.kv_lora_rank > 0"),
    "llama3_rope": (lambda c: c.rope.factor != 1.0 and c.rope.scaling == "llama3", "model.rope.scaling='llama3'"),
    "yarn": (lambda c: c.rope.factor != 1.0 and c.rope.scaling == "yarn", "model.rope.scaling='yarn'"),
    "experts": (lambda c: c.moe.num_experts > 0, "model.moe.num_experts > 0"),
    "sparse_step": (lambda c: c.moe.num_experts > 0 and c.moe.every > 1, "model.moe.every > 1"),
    "dense_prefix": (lambda c: c.moe.num_experts > 0 and c.prefix_layers > 0, "model.moe.first_dense_layers > 0"),
    "shared_experts": (lambda c: c.moe.num_experts > 0 and c.moe.shared_experts > 0, "model.moe.shared_experts > 0"),
    "sigmoid_router": (lambda c: c.moe.num_experts > 0 and c.moe.router == "sigmoid", "model.moe.router='sigmoid'"),
    "unnormalized_router": (lambda c: c.moe.num_experts > 0 and not c.moe.router_renormalize,
                            "model.moe.router_renormalize=False"),
    "router_scale": (lambda c: c.moe.num_experts > 0 and c.moe.router_scale != 1.0, "model.moe.router_scale != 1"),
    "multi_token_prediction": (lambda c: c.mtp.depth > 0, "model.mtp.depth > 0"),
    "gelu": (lambda c: c.activation == "gelu", "model.activation='gelu'"),
    "layernorm": (lambda c: c.norm == "layernorm", "model.norm='layernorm'"),
    "learned_positions": (lambda c: c.position_embedding == "learned", "model.position_embedding='learned'"),
    "local_layers": (lambda c: c.attention.window > 0, "model.attention.window > 0"),
    "local_rope": (lambda c: c.rope.local_theta > 0, "model.rope.local_theta > 0"),
    "linear_rope": (lambda c: c.rope.factor != 1.0 and c.rope.scaling == "linear", "model.rope.scaling='linear'"),
    "untruncated_yarn": (lambda c: c.rope.factor != 1.0 and c.rope.scaling == "yarn" and not c.rope.truncate,
                         "model.rope.truncate=False"),
    "sinks": (lambda c: c.attention.sinks, "model.attention.sinks"),
    "attention_bias": (lambda c: c.attention.bias, "model.attention.bias"),
    "query_scale": (lambda c: c.attention.query_pre_attn_scalar > 0, "model.attention.query_pre_attn_scalar > 0"),
    "unit_offset_norms": (lambda c: c.norm_unit_offset, "model.norm_unit_offset"),
    "post_norms": (lambda c: c.post_norms, "model.post_norms"),
    "embed_scale": (lambda c: c.embed_scale, "model.embed_scale"),
    "geglu": (lambda c: c.activation == "geglu", "model.activation='geglu'"),
    "clamped_swiglu": (lambda c: c.activation == "clamped_swiglu", "model.activation='clamped_swiglu'"),
    "router_logit_bias": (lambda c: c.moe.num_experts > 0 and c.moe.router_logit_bias, "model.moe.router_logit_bias"),
    "expert_bias": (lambda c: c.moe.num_experts > 0 and c.moe.expert_bias, "model.moe.expert_bias"),
    "gated_deltanet": (lambda c: c.linear.every > 0, "model.linear.every > 0"),
    "output_gate": (lambda c: c.attention.output_gate, "model.attention.output_gate"),
    "partial_rope": (lambda c: c.rope.fraction != 1.0, "model.rope.fraction < 1"),
    "shared_gate": (lambda c: c.moe.num_experts > 0 and c.moe.shared_gate, "model.moe.shared_gate"),
    "chunked_attention": (lambda c: c.attention.chunk > 0, "model.attention.chunk > 0"),
    "nope_layers": (lambda c: c.attention.global_nope, "model.attention.global_nope"),
    "temperature_tuning": (lambda c: c.attention.temperature_floor > 0, "model.attention.temperature_floor > 0"),
    "qk_l2_norm": (lambda c: c.attention.qk_l2_norm, "model.attention.qk_l2_norm"),
    "input_scaled_experts": (lambda c: c.moe.num_experts > 0 and c.moe.scale_input, "model.moe.scale_input"),
    "no_balance_bias": (lambda c: c.moe.num_experts > 0 and c.moe.router == "sigmoid" and not c.moe.balance_bias,
                        "model.moe.balance_bias=False"),
}


def used(cfg: ModelConfig) -> set[str]:
    """The mechanisms ``cfg`` switches on."""
    return {name for name, (uses, _) in MECHANISMS.items() if uses(cfg)}


def field(name: str) -> str:
    """The field that switches the mechanism ``name`` on."""
    return MECHANISMS[name][1]
