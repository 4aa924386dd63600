"""The config.json keys every family reads and writes alike, both ways: the widths, the heads, the norm, the
context and the rotary positions, from the transformers 4.x (``rope_theta`` + ``rope_scaling``) and 5.x
(``rope_parameters``) forms; export writes the 4.x names, which 5.x still reads."""

from __future__ import annotations

from typing import Any

from jaxtron.config.model import ModelConfig
from jaxtron.families.family import FormatError

YARN_KEYS = ("beta_fast", "beta_slow", "mscale", "mscale_all_dim")  # the same names in model.rope


def get(hf: dict, key: str, default: Any = ...) -> Any:
    """config.json's ``key``; FormatError when a required key is missing."""
    if key in hf and hf[key] is not None:
        return hf[key]
    if default is ...:
        raise FormatError(f"config.json has no '{key}', which a {hf.get('model_type', 'Llama')} config needs.")
    return default


def rope(hf: dict) -> dict[str, Any]:
    """The ``model.rope`` group of a config.json."""
    params = dict(hf.get("rope_parameters") or {})
    theta = params.get("rope_theta", hf.get("rope_theta", 10_000.0))
    scaling = params if params else dict(hf.get("rope_scaling") or {})
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    out = {"theta": float(theta)}
    if kind == "default":
        return out
    if kind == "yarn":
        if scaling.get("attention_factor") is not None:
            raise FormatError("config.json sets YaRN's 'attention_factor', which jaxtron does not implement (it "
                              "derives the attention factor from mscale).")
        out.update(scaling="yarn", factor=float(scaling["factor"]), truncate=bool(scaling.get("truncate", True)),
                   original_max_len=int(scaling.get("original_max_position_embeddings")
                                        or get(hf, "max_position_embeddings")),
                   **{key: float(scaling[key]) for key in YARN_KEYS if scaling.get(key)})
        return out
    if kind != "llama3":
        raise FormatError(f"config.json asks for RoPE scaling of type '{kind}', which jaxtron does not implement "
                          "(it supports none, 'llama3' and 'yarn').")
    out.update(factor=float(scaling["factor"]), low_freq_factor=float(scaling["low_freq_factor"]),
               high_freq_factor=float(scaling["high_freq_factor"]),
               original_max_len=int(scaling["original_max_position_embeddings"]))
    return out


def core_fields(hf: dict, own: tuple[str, ...] = ()) -> dict[str, Any]:
    """The ModelConfig fields of the keys every family shares; FormatError for what the family does not build
    (biases, another activation, a sliding window shorter than the context) unless it reads that key itself
    (``own``: of 'hidden_act', 'attention_bias', 'sliding_window')."""
    for key, ok in (("hidden_act", "silu"), ("attention_bias", False), ("mlp_bias", False)):
        if key not in own and hf.get(key, ok) != ok:
            raise FormatError(f"config.json sets {key}={hf[key]!r}; jaxtron's {hf.get('model_type', 'Llama')} "
                              f"needs {key}={ok!r}.")
    window = hf.get("sliding_window") if hf.get("use_sliding_window", True) else None  # Qwen3 names it off
    if "sliding_window" not in own and window is not None and window < get(hf, "max_position_embeddings"):
        raise FormatError(f"config.json sets sliding_window={window}; a {hf.get('model_type', 'Llama')} model of "
                          "jaxtron has no sliding-window attention.")
    heads = get(hf, "num_attention_heads")
    head_dim = get(hf, "head_dim", 0)
    attention = dict(num_heads=heads, num_kv_heads=get(hf, "num_key_value_heads", heads),
                     head_dim=0 if head_dim == get(hf, "hidden_size") // heads else head_dim)
    return dict(vocab_size=get(hf, "vocab_size"), embed_dim=get(hf, "hidden_size"),
                num_layers=get(hf, "num_hidden_layers"), mlp_dim=get(hf, "intermediate_size"),
                norm_eps=float(get(hf, "rms_norm_eps", 1e-6)), max_seq_len=get(hf, "max_position_embeddings"),
                tie_embeddings=bool(hf.get("tie_word_embeddings", False)), activation="swiglu", norm="rmsnorm",
                position_embedding="rope", attention=attention, rope=rope(hf))


def core_hf(cfg: ModelConfig, family: str) -> dict[str, Any]:
    """config.json's keys that every family writes, for a model of ``family`` (its model type)."""
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
                              **{key: getattr(cfg.rope, key) for key in YARN_KEYS if getattr(cfg.rope, key)},
                              **({} if cfg.rope.truncate else {"truncate": False})}
    elif cfg.rope.factor != 1.0 and cfg.rope.scaling == "linear":
        hf["rope_scaling"] = {"rope_type": "linear", "factor": cfg.rope.factor}
    elif cfg.rope.factor != 1.0:
        hf["rope_scaling"] = {"rope_type": "llama3", "factor": cfg.rope.factor,
                              "low_freq_factor": cfg.rope.low_freq_factor,
                              "high_freq_factor": cfg.rope.high_freq_factor,
                              "original_max_position_embeddings": cfg.rope.original_max_len}
    return hf


def router_loss_fields(hf: dict) -> dict[str, float]:
    """The train fields of a softmax-routed MoE family's config.json: its load-balancing coefficient."""
    return {"router_aux_loss": float(hf.get("router_aux_loss_coef", 0.0)), "router_z_loss": 0.0}


def last_of_every(marked: list[bool]) -> int | None:
    """k where the marked layers are the last of every k (0: none is marked); None for another pattern."""
    first = next((i for i, m in enumerate(marked) if m), None)
    every = 0 if first is None else first + 1
    return every if list(marked) == [bool(every) and (i + 1) % every == 0 for i in range(len(marked))] else None


def local_layers(hf: dict) -> dict[str, int]:
    """``model.attention``'s window fields from config.json's ``sliding_window`` and ``layer_types`` (or
    ``sliding_window_pattern``): each run of local layers ends in a global one. FormatError for another pattern."""
    layers = get(hf, "num_hidden_layers")
    every = hf.get("sliding_window_pattern")
    types = hf.get("layer_types") or (
        ["full_attention" if every and (i + 1) % every == 0 else "sliding_attention" for i in range(layers)])
    if hf.get("sliding_window") is None or "sliding_attention" not in types:
        return {"window": 0, "global_every": 0}
    every = last_of_every([kind == "full_attention" for kind in types])
    if every is None or any(kind not in ("full_attention", "sliding_attention") for kind in types):
        raise FormatError(f"config.json's layer_types ({types[:8]}...) is not runs of local layers each ended by a "
                          "global one, the pattern jaxtron's model.attention.global_every describes.")
    return {"window": int(hf["sliding_window"]), "global_every": every}


def layer_types(cfg: ModelConfig) -> list[str]:
    """config.json's ``layer_types`` of a model with local layers."""
    return ["sliding_attention" if cfg.is_local_block(i) else "full_attention" for i in range(cfg.num_layers)]
