"""Llama (2, 3, 3.1, 3.2), Qwen3 (dense and MoE), Mixtral and DeepSeek-V3 in Hugging Face form: config.json <->
ModelConfig, and tensor names (DeepSeek-V3's own parts in ``jaxtron.interop.hf.deepseek``). Which family a model
or a config.json is, and the entry points callers use, are in ``jaxtron.interop.hf.registry``.

Hugging Face stores a projection as [out, in] and jaxtron as [in, ...out] with heads split out, so every
projection is a transpose and a reshape; the rotary layout is the same (rotate-half) and needs no
permutation. Layers are stacked in jaxtron: ``layers`` holds the dense blocks and ``moe_layers`` the MoE
ones, so HF layer i is entry i of whichever stack it belongs to (every block is MoE in Mixtral). Qwen3 is Llama
with each head's queries and keys RMS-normalised before RoPE (``model.attention.qk_norm``); Qwen3-MoE adds experts every
``decoder_sparse_step`` blocks (``model.moe.every``), routed like Mixtral's (softmax, top-k, renormalised when
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

_YARN_KEYS = ("beta_fast", "beta_slow", "mscale", "mscale_all_dim")  # the same names in model.rope


def _get(hf: dict, key: str, default: Any = ...) -> Any:
    if key in hf and hf[key] is not None:
        return hf[key]
    if default is ...:
        raise FormatError(f"config.json has no '{key}', which a {hf.get('model_type', 'Llama')} config needs.")
    return default


def _rope(hf: dict) -> dict[str, Any]:
    """The ``model.rope`` group from transformers 4.x (``rope_theta`` + ``rope_scaling``) or 5.x
    (``rope_parameters``)."""
    params = dict(hf.get("rope_parameters") or {})
    theta = params.get("rope_theta", hf.get("rope_theta", 10_000.0))
    scaling = params if params else dict(hf.get("rope_scaling") or {})
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    out = {"theta": float(theta)}
    if kind == "default":
        return out
    if kind == "yarn":
        unknown = sorted(k for k in ("attention_factor", "truncate") if scaling.get(k) not in (None, True))
        if unknown:
            raise FormatError(f"config.json sets YaRN's '{unknown[0]}', which jaxtron does not implement (it derives "
                              "the attention factor from mscale and always rounds the ramp's ends).")
        out.update(scaling="yarn", factor=float(scaling["factor"]),
                   original_max_len=int(scaling.get("original_max_position_embeddings")
                                        or _get(hf, "max_position_embeddings")),
                   **{key: float(scaling[key]) for key in _YARN_KEYS if scaling.get(key)})
        return out
    if kind != "llama3":
        raise FormatError(f"config.json asks for RoPE scaling of type '{kind}', which jaxtron does not implement "
                          "(it supports none, 'llama3' and 'yarn').")
    out.update(factor=float(scaling["factor"]), low_freq_factor=float(scaling["low_freq_factor"]),
               high_freq_factor=float(scaling["high_freq_factor"]),
               original_max_len=int(scaling["original_max_position_embeddings"]))
    return out


def model_config(hf: dict, family: str, name: str = "", tensor_names: Any = ()) -> ModelConfig:
    """The jaxtron ModelConfig of a Hugging Face config.json (as a dict) of ``family`` (its model type);
    FormatError for what cannot map. ``tensor_names``: see ``registry.model_config``."""
    for key, ok in (("hidden_act", "silu"), ("attention_bias", False), ("mlp_bias", False)):
        if hf.get(key, ok) != ok:
            raise FormatError(f"config.json sets {key}={hf[key]!r}; jaxtron's Llama needs {key}={ok!r}.")
    window = hf.get("sliding_window") if hf.get("use_sliding_window", True) else None  # Qwen3 names it off
    if window is not None and window < _get(hf, "max_position_embeddings"):
        raise FormatError(f"config.json sets sliding_window={window}; jaxtron has no sliding-window attention.")
    heads = _get(hf, "num_attention_heads")
    attention = dict(num_heads=heads, num_kv_heads=_get(hf, "num_key_value_heads", heads),
                     head_dim=_get(hf, "head_dim", 0), qk_norm=family.startswith("qwen3"))
    if attention["head_dim"] == _get(hf, "hidden_size") // heads:
        attention["head_dim"] = 0
    groups = {"attention": attention, "rope": _rope(hf)}
    if family == "mixtral":
        groups["moe"] = dict(num_experts=_get(hf, "num_local_experts"),
                             experts_per_token=_get(hf, "num_experts_per_tok"), router_renormalize=True, every=1)
    if family == "qwen3_moe":
        groups["moe"] = _qwen3_moe(hf)
    if family == "deepseek_v3":
        for group, values in deepseek.model_fields(hf, _get, tensor_names).items():
            groups[group] = {**groups.get(group, {}), **values}
    return ModelConfig(
        name=name or hf.get("_name_or_path", "") or family, vocab_size=_get(hf, "vocab_size"),
        embed_dim=_get(hf, "hidden_size"), num_layers=_get(hf, "num_hidden_layers"),
        mlp_dim=_get(hf, "intermediate_size"), norm_eps=float(_get(hf, "rms_norm_eps", 1e-6)),
        max_seq_len=_get(hf, "max_position_embeddings"), tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        activation="swiglu", norm="rmsnorm", position_embedding="rope", **groups)


def _qwen3_moe(hf: dict) -> dict[str, Any]:
    """Qwen3-MoE's ``model.moe`` group: experts of width ``moe_intermediate_size`` every ``decoder_sparse_step``
    blocks, dense blocks of width ``intermediate_size`` between them."""
    step, dense_only = int(hf.get("decoder_sparse_step", 1)), list(hf.get("mlp_only_layers") or [])
    if dense_only:
        raise FormatError(f"config.json sets mlp_only_layers={dense_only}; jaxtron places dense blocks only by "
                          "decoder_sparse_step.")
    experts = hf.get("num_experts") or _get(hf, "num_local_experts")  # transformers 4.x and 5.x names
    return dict(num_experts=experts, experts_per_token=_get(hf, "num_experts_per_tok"),
                expert_dim=_get(hf, "moe_intermediate_size"), router_renormalize=bool(hf.get("norm_topk_prob", False)),
                every=step)


def train_fields(hf: dict) -> dict[str, float]:
    """The training config's fields that a Hugging Face config.json sets: Mixtral's router loss coefficients."""
    if "n_routed_experts" in hf:  # DeepSeek-V3 balances by its router bias, no loss coefficient in config.json
        return {"router_aux_loss": 0.0, "router_z_loss": 0.0}
    if "num_local_experts" not in hf and "num_experts" not in hf:
        return {}
    return {"router_aux_loss": float(hf.get("router_aux_loss_coef", 0.0)), "router_z_loss": 0.0}


def hf_config(cfg: ModelConfig, family: str, router_aux_loss: float = 0.0) -> dict[str, Any]:
    """config.json's fields, but "architectures", for a jaxtron ModelConfig of ``family`` (see
    ``registry.hf_config``)."""
    moe = cfg.moe.num_experts > 0
    if moe and cfg.moe.every != 1 and not cfg.attention.qk_norm and not cfg.latent_attention:
        raise FormatError(f"model.moe.every={cfg.moe.every} has no Mixtral equivalent (every block is MoE there).")
    if cfg.activation != "swiglu" or cfg.norm != "rmsnorm" or cfg.position_embedding != "rope":
        raise FormatError("only Llama-style models (SwiGLU, RMSNorm, RoPE) can be exported to Hugging Face.")
    hf: dict[str, Any] = {
        "model_type": family, "vocab_size": cfg.vocab_size, "hidden_size": cfg.embed_dim,
        "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.attention.num_heads,
        "num_key_value_heads": cfg.attention.num_kv_heads, "head_dim": cfg.resolved_head_dim,
        "intermediate_size": cfg.mlp_dim, "rms_norm_eps": cfg.norm_eps, "max_position_embeddings": cfg.max_seq_len,
        "tie_word_embeddings": cfg.tie_embeddings, "hidden_act": "silu", "rope_theta": cfg.rope.theta,
        "rope_scaling": None, "attention_bias": False, "attention_dropout": 0.0, "initializer_range": cfg.init_std,
        "torch_dtype": "float32", "use_cache": True,
    }
    if cfg.rope.factor != 1.0 and cfg.rope.scaling == "yarn":
        hf["rope_scaling"] = {"rope_type": "yarn", "factor": cfg.rope.factor,
                              "original_max_position_embeddings": cfg.rope.original_max_len,
                              **{key: getattr(cfg.rope, key) for key in _YARN_KEYS if getattr(cfg.rope, key)}}
    elif cfg.rope.factor != 1.0:
        hf["rope_scaling"] = {"rope_type": "llama3", "factor": cfg.rope.factor,
                              "low_freq_factor": cfg.rope.low_freq_factor,
                              "high_freq_factor": cfg.rope.high_freq_factor,
                              "original_max_position_embeddings": cfg.rope.original_max_len}
    if family == "deepseek_v3":
        hf.update(deepseek.hf_fields(cfg))
    elif family == "qwen3_moe":
        hf.update(num_experts=cfg.moe.num_experts, num_experts_per_tok=cfg.moe.experts_per_token,
                  moe_intermediate_size=cfg.resolved_expert_dim, decoder_sparse_step=cfg.moe.every, mlp_only_layers=[],
                  norm_topk_prob=cfg.moe.router_renormalize, router_aux_loss_coef=router_aux_loss,
                  output_router_logits=False, use_sliding_window=False, sliding_window=None)
    elif moe:
        if not cfg.moe.router_renormalize:
            raise FormatError("model.moe.router_renormalize=False has no Mixtral equivalent (Mixtral renormalises).")
        hf.update(num_local_experts=cfg.moe.num_experts, num_experts_per_tok=cfg.moe.experts_per_token,
                  router_aux_loss_coef=router_aux_loss, output_router_logits=False, sliding_window=None)
    elif cfg.attention.qk_norm:
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


def _t(x: np.ndarray) -> np.ndarray:
    return x.T  # a view: the caller copies once, into its destination


def tensors(cfg: ModelConfig, family: str, hf: dict | None = None) -> Iterator[Tensor]:
    """Every tensor of the Hugging Face checkpoint of ``cfg`` as ``family``, in file order (see
    ``registry.tensors``)."""
    d = cfg.embed_dim
    same = deepseek.SAME
    yield Tensor("model.embed_tokens.weight", (cfg.vocab_size, d), "embedding", (), *same)
    seen = {"layers": 0, "moe_layers": 0}  # blocks of each stack so far: a block's index in its stack
    for i in range(cfg.num_layers):
        moe = cfg.is_moe_block(i)
        stack = "moe_layers" if moe else "layers"
        j = seen[stack]
        seen[stack] += 1
        yield from _block_tensors(cfg, family, f"model.layers.{i}.", stack, j, moe, hf)
    yield Tensor("model.norm.weight", (d,), "final_norm.scale", (), *same)
    if not cfg.tie_embeddings:
        yield Tensor("lm_head.weight", (cfg.vocab_size, d), "head", (), _t, _t)
    for k in range(cfg.mtp.depth):  # DeepSeek-V3's multi-token prediction modules, as the layers after the last
        pre = f"model.layers.{cfg.num_layers + k}."
        yield from deepseek.mtp_tensors(cfg, pre, k, Tensor)
        yield from _block_tensors(cfg, family, pre, "mtp.block", k, cfg.moe.num_experts > 0, hf)


def _block_tensors(cfg: ModelConfig, family: str, pre: str, stack: str, j: int, moe: bool,
                   hf: dict | None) -> Iterator[Tensor]:
    """The tensors of one block (HF prefix ``pre``), entry ``j`` of the jaxtron stack ``stack``."""
    n, g = cfg.attention.num_heads, cfg.attention.num_kv_heads
    d, h, f = cfg.embed_dim, cfg.resolved_head_dim, cfg.mlp_dim
    same = deepseek.SAME

    def heads_in(count):  # [count*h, d] -> [d, count, h] (views, no copy)
        return lambda x: x.T.reshape(d, count, h), lambda x: _t(x.reshape(d, count * h))

    yield Tensor(pre + "input_layernorm.weight", (d,), f"{stack}.attn_norm.scale", (j,), *same)
    if cfg.latent_attention:
        yield from deepseek.attention_tensors(cfg, pre, stack, j, Tensor, bool((hf or {}).get("rope_interleave",
                                                                                             True)))
    else:
        for proj, param, count in (("q", "wq", n), ("k", "wk", g), ("v", "wv", g)):
            yield Tensor(pre + f"self_attn.{proj}_proj.weight", (count * h, d), f"{stack}.attn.{param}.weight", (j,),
                         *heads_in(count))
        yield Tensor(pre + "self_attn.o_proj.weight", (d, n * h), f"{stack}.attn.wo.weight", (j,),
                     lambda x: x.T.reshape(n, h, d), lambda x: _t(x.reshape(n * h, d)))
    if cfg.attention.qk_norm:
        yield Tensor(pre + "self_attn.q_norm.weight", (h,), f"{stack}.attn.q_norm.scale", (j,), *same)
        yield Tensor(pre + "self_attn.k_norm.weight", (h,), f"{stack}.attn.k_norm.scale", (j,), *same)
    yield Tensor(pre + "post_attention_layernorm.weight", (d,), f"{stack}.mlp_norm.scale", (j,), *same)
    if moe:  # Mixtral names its experts w1 (gate), w3 (up), w2 (down); Qwen3-MoE and DeepSeek-V3 as a Llama MLP
        mixtral = family == "mixtral"
        where = pre + ("block_sparse_moe." if mixtral else "mlp.")
        names = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
        fe = cfg.resolved_expert_dim
        yield Tensor(where + "gate.weight", (cfg.moe.num_experts, d), f"{stack}.mlp.router", (j,), _t, _t)
        if family == "deepseek_v3":
            yield from deepseek.moe_extras(cfg, pre, stack, j, Tensor)
        for e in range(cfg.moe.num_experts):
            for name, param, shape in zip(names, ("wi_gate", "wi_up", "wo"), ((fe, d), (fe, d), (d, fe)), strict=True):
                yield Tensor(where + f"experts.{e}.{name}.weight", shape, f"{stack}.mlp.{param}", (j, e), _t, _t)
    else:
        yield Tensor(pre + "mlp.gate_proj.weight", (f, d), f"{stack}.mlp.wi_gate.weight", (j,), _t, _t)
        yield Tensor(pre + "mlp.up_proj.weight", (f, d), f"{stack}.mlp.wi_up.weight", (j,), _t, _t)
        yield Tensor(pre + "mlp.down_proj.weight", (d, f), f"{stack}.mlp.wo.weight", (j,), _t, _t)