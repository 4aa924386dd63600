"""Llama (2, 3, 3.1, 3.2), Qwen3 (dense and MoE), Mixtral and DeepSeek-V3 in Hugging Face form: config.json <->
ModelConfig, and tensor names (DeepSeek-V3's own parts in ``jaxtron.interop.hf.deepseek``).

Hugging Face stores a projection as [out, in] and jaxtron as [in, ...out] with heads split out, so every
projection is a transpose and a reshape; the rotary layout is the same (rotate-half) and needs no
permutation. Layers are stacked in jaxtron: ``layers`` holds the dense blocks and ``moe_layers`` the MoE
ones, so HF layer i is entry i of whichever stack it belongs to (every block is MoE in Mixtral). Qwen3 is Llama
with each head's queries and keys RMS-normalised before RoPE (``model.qk_norm``); Qwen3-MoE adds experts every
``decoder_sparse_step`` blocks (``model.moe_every``), routed like Mixtral's (softmax, top-k, renormalised when
``norm_topk_prob``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from jaxtron.config.schema import ModelConfig
from jaxtron.interop.hf import deepseek
from jaxtron.interop.hf.safetensors import FormatError

ARCHITECTURES = {"LlamaForCausalLM": "llama", "Qwen3ForCausalLM": "qwen3", "Qwen3MoeForCausalLM": "qwen3_moe",
                 "MixtralForCausalLM": "mixtral", "DeepseekV3ForCausalLM": "deepseek_v3"}
_YARN_KEYS = {"beta_fast": "rope_beta_fast", "beta_slow": "rope_beta_slow", "mscale": "rope_mscale",
              "mscale_all_dim": "rope_mscale_all_dim"}


def _get(hf: dict, key: str, default: Any = ...) -> Any:
    if key in hf and hf[key] is not None:
        return hf[key]
    if default is ...:
        raise FormatError(f"config.json has no '{key}', which a {hf.get('model_type', 'Llama')} config needs.")
    return default


def _rope(hf: dict) -> dict[str, Any]:
    """RoPE fields from transformers 4.x (``rope_theta`` + ``rope_scaling``) or 5.x (``rope_parameters``)."""
    params = dict(hf.get("rope_parameters") or {})
    theta = params.get("rope_theta", hf.get("rope_theta", 10_000.0))
    scaling = params if params else dict(hf.get("rope_scaling") or {})
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    out = {"rope_theta": float(theta)}
    if kind == "default":
        return out
    if kind == "yarn":
        unknown = sorted(k for k in ("attention_factor", "truncate") if scaling.get(k) not in (None, True))
        if unknown:
            raise FormatError(f"config.json sets YaRN's '{unknown[0]}', which jaxtron does not implement (it derives "
                              "the attention factor from mscale and always rounds the ramp's ends).")
        out.update(rope_scaling="yarn", rope_scaling_factor=float(scaling["factor"]),
                   rope_original_max_len=int(scaling.get("original_max_position_embeddings")
                                             or _get(hf, "max_position_embeddings")),
                   **{field: float(scaling[key]) for key, field in _YARN_KEYS.items() if scaling.get(key)})
        return out
    if kind != "llama3":
        raise FormatError(f"config.json asks for RoPE scaling of type '{kind}', which jaxtron does not implement "
                          "(it supports none, 'llama3' and 'yarn').")
    out.update(rope_scaling_factor=float(scaling["factor"]), rope_low_freq_factor=float(scaling["low_freq_factor"]),
               rope_high_freq_factor=float(scaling["high_freq_factor"]),
               rope_original_max_len=int(scaling["original_max_position_embeddings"]))
    return out


def model_config(hf: dict, name: str = "", tensor_names: Any = ()) -> ModelConfig:
    """The jaxtron ModelConfig of a Hugging Face config.json (as a dict); FormatError for what cannot map.
    ``tensor_names``: the checkpoint's, which decide whether DeepSeek-V3's multi-token prediction modules come
    along (config.json may announce modules the weights do not have)."""
    arch = (hf.get("architectures") or [None])[0]
    family = ARCHITECTURES.get(arch) or {v: v for v in ARCHITECTURES.values()}.get(hf.get("model_type"))
    if family is None:
        raise FormatError(f"config.json describes architecture {arch or hf.get('model_type')!r}; jaxtron converts "
                          f"{', '.join(ARCHITECTURES)}.")
    for key, ok in (("hidden_act", "silu"), ("attention_bias", False), ("mlp_bias", False)):
        if hf.get(key, ok) != ok:
            raise FormatError(f"config.json sets {key}={hf[key]!r}; jaxtron's Llama needs {key}={ok!r}.")
    window = hf.get("sliding_window") if hf.get("use_sliding_window", True) else None  # Qwen3 names it off
    if window is not None and window < _get(hf, "max_position_embeddings"):
        raise FormatError(f"config.json sets sliding_window={window}; jaxtron has no sliding-window attention.")
    heads = _get(hf, "num_attention_heads")
    fields = dict(
        name=name or hf.get("_name_or_path", "") or family, vocab_size=_get(hf, "vocab_size"),
        embed_dim=_get(hf, "hidden_size"), num_layers=_get(hf, "num_hidden_layers"), num_heads=heads,
        num_kv_heads=_get(hf, "num_key_value_heads", heads), head_dim=_get(hf, "head_dim", 0),
        mlp_dim=_get(hf, "intermediate_size"), norm_eps=float(_get(hf, "rms_norm_eps", 1e-6)),
        max_seq_len=_get(hf, "max_position_embeddings"), tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        activation="swiglu", norm="rmsnorm", position_embedding="rope", qk_norm=family.startswith("qwen3"),
        **_rope(hf))
    if fields["head_dim"] == fields["embed_dim"] // heads:
        fields["head_dim"] = 0
    if family == "mixtral":
        fields.update(num_experts=_get(hf, "num_local_experts"), experts_per_token=_get(hf, "num_experts_per_tok"),
                      router_renormalize=True, moe_every=1)
    if family == "qwen3_moe":
        fields.update(_qwen3_moe(hf))
    if family == "deepseek_v3":
        fields.update(deepseek.model_fields(hf, _get, tensor_names))
    return ModelConfig(**fields)


def _qwen3_moe(hf: dict) -> dict[str, Any]:
    """Qwen3-MoE's expert fields: experts of width ``moe_intermediate_size`` every ``decoder_sparse_step``
    blocks, dense blocks of width ``intermediate_size`` between them."""
    step, dense_only = int(hf.get("decoder_sparse_step", 1)), list(hf.get("mlp_only_layers") or [])
    if dense_only:
        raise FormatError(f"config.json sets mlp_only_layers={dense_only}; jaxtron places dense blocks only by "
                          "decoder_sparse_step.")
    experts = hf.get("num_experts") or _get(hf, "num_local_experts")  # transformers 4.x and 5.x names
    return dict(num_experts=experts, experts_per_token=_get(hf, "num_experts_per_tok"),
                expert_dim=_get(hf, "moe_intermediate_size"), router_renormalize=bool(hf.get("norm_topk_prob", False)),
                moe_every=step)


def train_fields(hf: dict) -> dict[str, float]:
    """The training config's fields that a Hugging Face config.json sets: Mixtral's router loss coefficients."""
    if "n_routed_experts" in hf:  # DeepSeek-V3 balances by its router bias, no loss coefficient in config.json
        return {"router_aux_loss": 0.0, "router_z_loss": 0.0}
    if "num_local_experts" not in hf and "num_experts" not in hf:
        return {}
    return {"router_aux_loss": float(hf.get("router_aux_loss_coef", 0.0)), "router_z_loss": 0.0}


def hf_config(cfg: ModelConfig, router_aux_loss: float = 0.0) -> dict[str, Any]:
    """config.json (transformers 4.x field names, which 5.x still reads) for a jaxtron ModelConfig trained with
    the load-balancing coefficient ``router_aux_loss`` (``train.router_aux_loss``; Mixtral only)."""
    moe = cfg.num_experts > 0
    if moe and cfg.moe_every != 1 and not cfg.qk_norm and not cfg.latent_attention:
        raise FormatError(f"model.moe_every={cfg.moe_every} has no Mixtral equivalent (every block is MoE there).")
    if cfg.activation != "swiglu" or cfg.norm != "rmsnorm" or cfg.position_embedding != "rope":
        raise FormatError("only Llama-style models (SwiGLU, RMSNorm, RoPE) can be exported to Hugging Face.")
    family = _family(cfg)
    hf: dict[str, Any] = {
        "architectures": [{v: k for k, v in ARCHITECTURES.items()}[family]],
        "model_type": family, "vocab_size": cfg.vocab_size, "hidden_size": cfg.embed_dim,
        "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.resolved_head_dim,
        "intermediate_size": cfg.mlp_dim, "rms_norm_eps": cfg.norm_eps, "max_position_embeddings": cfg.max_seq_len,
        "tie_word_embeddings": cfg.tie_embeddings, "hidden_act": "silu", "rope_theta": cfg.rope_theta,
        "rope_scaling": None, "attention_bias": False, "attention_dropout": 0.0, "initializer_range": cfg.init_std,
        "torch_dtype": "float32", "use_cache": True,
    }
    if cfg.rope_scaling_factor != 1.0 and cfg.rope_scaling == "yarn":
        hf["rope_scaling"] = {"rope_type": "yarn", "factor": cfg.rope_scaling_factor,
                              "original_max_position_embeddings": cfg.rope_original_max_len,
                              **{key: getattr(cfg, field) for key, field in _YARN_KEYS.items() if getattr(cfg, field)}}
    elif cfg.rope_scaling_factor != 1.0:
        hf["rope_scaling"] = {"rope_type": "llama3", "factor": cfg.rope_scaling_factor,
                              "low_freq_factor": cfg.rope_low_freq_factor,
                              "high_freq_factor": cfg.rope_high_freq_factor,
                              "original_max_position_embeddings": cfg.rope_original_max_len}
    if family == "deepseek_v3":
        hf.update(deepseek.hf_fields(cfg))
    elif family == "qwen3_moe":
        hf.update(num_experts=cfg.num_experts, num_experts_per_tok=cfg.experts_per_token,
                  moe_intermediate_size=cfg.resolved_expert_dim, decoder_sparse_step=cfg.moe_every, mlp_only_layers=[],
                  norm_topk_prob=cfg.router_renormalize, router_aux_loss_coef=router_aux_loss,
                  output_router_logits=False, use_sliding_window=False, sliding_window=None)
    elif moe:
        if not cfg.router_renormalize:
            raise FormatError("model.router_renormalize=False has no Mixtral equivalent (Mixtral renormalises).")
        hf.update(num_local_experts=cfg.num_experts, num_experts_per_tok=cfg.experts_per_token,
                  router_aux_loss_coef=router_aux_loss, output_router_logits=False, sliding_window=None)
    elif cfg.qk_norm:
        hf.update(use_sliding_window=False, sliding_window=None)
    else:
        hf["mlp_bias"] = False
    return hf


@dataclasses.dataclass(frozen=True)
class Tensor:
    """One Hugging Face tensor and where it goes: ``param`` (a dotted jaxtron path), ``index`` (the position
    in the stacked parameter, a tuple), and the functions between the two layouts."""

    hf_name: str
    shape: tuple[int, ...]  # in the Hugging Face file
    param: str
    index: tuple[int, ...]
    to_jaxtron: Callable[[np.ndarray], np.ndarray]
    to_hf: Callable[[np.ndarray], np.ndarray]
    copy: bool = False  # a second copy of a parameter another tensor fills (DeepSeek's MTP embedding and head)


def _family(cfg: ModelConfig) -> str:
    """The Hugging Face family of a jaxtron model: DeepSeek-V3 with latent attention, Qwen3 when it normalises
    queries and keys."""
    if cfg.latent_attention:
        return "deepseek_v3"
    if cfg.qk_norm:
        return "qwen3_moe" if cfg.num_experts else "qwen3"
    return "mixtral" if cfg.num_experts else "llama"


def _t(x: np.ndarray) -> np.ndarray:
    return x.T  # a view: the caller copies once, into its destination


def tensors(cfg: ModelConfig, hf: dict | None = None) -> Iterator[Tensor]:
    """Every tensor of the Hugging Face checkpoint of ``cfg``, in file order (``hf``: the config.json read, for
    DeepSeek-V3's ``rope_interleave``; an export writes interleaved rotary rows)."""
    d = cfg.embed_dim
    same = deepseek.SAME
    yield Tensor("model.embed_tokens.weight", (cfg.vocab_size, d), "embedding", (), *same)
    seen = {"layers": 0, "moe_layers": 0}  # blocks of each stack so far: a block's index in its stack
    for i in range(cfg.num_layers):
        moe = cfg.is_moe_block(i)
        stack = "moe_layers" if moe else "layers"
        j = seen[stack]
        seen[stack] += 1
        yield from _block_tensors(cfg, f"model.layers.{i}.", stack, j, moe, hf)
    yield Tensor("model.norm.weight", (d,), "final_norm.scale", (), *same)
    if not cfg.tie_embeddings:
        yield Tensor("lm_head.weight", (cfg.vocab_size, d), "head", (), _t, _t)
    for k in range(cfg.mtp_depth):  # DeepSeek-V3's multi-token prediction modules, as the layers after the last
        pre = f"model.layers.{cfg.num_layers + k}."
        yield from deepseek.mtp_tensors(cfg, pre, k, Tensor)
        yield from _block_tensors(cfg, pre, "mtp.block", k, cfg.num_experts > 0, hf)


def _block_tensors(cfg: ModelConfig, pre: str, stack: str, j: int, moe: bool, hf: dict | None) -> Iterator[Tensor]:
    """The tensors of one block (HF prefix ``pre``), entry ``j`` of the jaxtron stack ``stack``."""
    d, n, g, h, f = cfg.embed_dim, cfg.num_heads, cfg.num_kv_heads, cfg.resolved_head_dim, cfg.mlp_dim
    family = _family(cfg)
    same = deepseek.SAME

    def heads_in(count):  # [count*h, d] -> [d, count, h] (views, no copy)
        return lambda x: x.T.reshape(d, count, h), lambda x: _t(x.reshape(d, count * h))

    yield Tensor(pre + "input_layernorm.weight", (d,), f"{stack}.attn_norm.scale", (j,), *same)
    if cfg.latent_attention:
        yield from deepseek.attention_tensors(cfg, pre, stack, j, Tensor, bool((hf or {}).get("rope_interleave",
                                                                                             True)))
    else:
        for proj, param, count in (("q", "wq", n), ("k", "wk", g), ("v", "wv", g)):
            yield Tensor(pre + f"self_attn.{proj}_proj.weight", (count * h, d), f"{stack}.attn.{param}", (j,),
                         *heads_in(count))
        yield Tensor(pre + "self_attn.o_proj.weight", (d, n * h), f"{stack}.attn.wo", (j,),
                     lambda x: x.T.reshape(n, h, d), lambda x: _t(x.reshape(n * h, d)))
    if cfg.qk_norm:
        yield Tensor(pre + "self_attn.q_norm.weight", (h,), f"{stack}.attn.q_norm.scale", (j,), *same)
        yield Tensor(pre + "self_attn.k_norm.weight", (h,), f"{stack}.attn.k_norm.scale", (j,), *same)
    yield Tensor(pre + "post_attention_layernorm.weight", (d,), f"{stack}.mlp_norm.scale", (j,), *same)
    if moe:  # Mixtral names its experts w1 (gate), w3 (up), w2 (down); Qwen3-MoE and DeepSeek-V3 as a Llama MLP
        mixtral = family == "mixtral"
        where = pre + ("block_sparse_moe." if mixtral else "mlp.")
        names = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
        fe = cfg.resolved_expert_dim
        yield Tensor(where + "gate.weight", (cfg.num_experts, d), f"{stack}.mlp.router", (j,), _t, _t)
        if family == "deepseek_v3":
            yield from deepseek.moe_extras(cfg, pre, stack, j, Tensor)
        for e in range(cfg.num_experts):
            for name, param, shape in zip(names, ("wi_gate", "wi_up", "wo"), ((fe, d), (fe, d), (d, fe))):
                yield Tensor(where + f"experts.{e}.{name}.weight", shape, f"{stack}.mlp.{param}", (j, e), _t, _t)
    else:
        yield Tensor(pre + "mlp.gate_proj.weight", (f, d), f"{stack}.mlp.wi_gate", (j,), _t, _t)
        yield Tensor(pre + "mlp.up_proj.weight", (f, d), f"{stack}.mlp.wi_up", (j,), _t, _t)
        yield Tensor(pre + "mlp.down_proj.weight", (d, f), f"{stack}.mlp.wo", (j,), _t, _t)