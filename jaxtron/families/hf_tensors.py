"""The tensors of a checkpoint in Llama's layout, which Qwen3, Mixtral and DeepSeek-V3 share, by mechanism: each
as a ``Tensor`` with its Hugging Face name and shape, its jaxtron parameter path and the two functions between.

Hugging Face stores a projection as [out, in] and jaxtron as [in, ...out] with heads split out, so every projection
is a transpose and a reshape, written as views; the rotary layout is the same (rotate-half). Layers are stacked in
jaxtron: ``layers`` holds the dense blocks and ``moe_layers`` the MoE ones (``ModelConfig.is_moe_block``), so HF
layer i is entry j of whichever stack it belongs to. What a family names otherwise (Mixtral's experts) is a
``Names``; what it adds (DeepSeek-V3's latent attention, its MoE extras and prediction modules) are ``Parts``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator

import numpy as np

from jaxtron.config.model import STACKS, ModelConfig
from jaxtron.families.family import Tensor

SAME = (lambda x: x, lambda x: x)  # (to jaxtron, to Hugging Face) of a tensor stored alike in both
TRANSPOSE = (lambda x: x.T, lambda x: x.T)  # of a matrix, [out, in] there and [in, out] here (views)


@dataclasses.dataclass(frozen=True)
class Names:
    """How a family names its MoE block's tensors."""

    moe: str = "mlp."  # the MoE block's prefix within a layer
    experts: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")  # gate, up, down


# (config, HF layer prefix, jaxtron stack, entry, hf config.json or None) -> tensors
BlockPart = Callable[[ModelConfig, str, str, int, "dict | None"], Iterator[Tensor]]


@dataclasses.dataclass(frozen=True)
class Parts:
    """What a family puts in place of, or beside, the Llama layout's parts."""

    attention: BlockPart | None = None  # instead of grouped-query attention's q, k, v, o
    linear: BlockPart | None = None  # a Gated DeltaNet block's token mixer (model.linear), in place of attention
    moe_extras: BlockPart | None = None  # after the router: a balancing bias, shared experts
    after: Callable[[ModelConfig, dict | None], Iterator[Tensor]] | None = None  # after the output head


def tensors(cfg: ModelConfig, hf: dict | None = None, names: Names = Names(), parts: Parts = Parts()
            ) -> Iterator[Tensor]:
    """Every tensor of the checkpoint of ``cfg``, in file order."""
    d = cfg.embed_dim
    yield Tensor("model.embed_tokens.weight", (cfg.vocab_size, d), "embedding", (), *SAME)
    seen = dict.fromkeys((*STACKS, "lead_layers"), 0)  # blocks of each stack so far: a block's index in it
    for i in range(cfg.num_layers):
        kind = cfg.block_kind(i)
        stack = "lead_layers" if cfg.lead_stack and i < cfg.prefix_layers else STACKS[kind.stack]
        j = seen[stack]
        seen[stack] += 1
        yield from block(cfg, f"model.layers.{i}.", stack, j, kind.moe, hf, names, parts, kind.linear)
    yield Tensor("model.norm.weight", (d,), "final_norm.scale", (), *SAME)
    if not cfg.tie_embeddings:
        yield Tensor("lm_head.weight", (cfg.vocab_size, d), "head", (), *TRANSPOSE)
    if parts.after is not None:
        yield from parts.after(cfg, hf)


def block(cfg: ModelConfig, pre: str, stack: str, j: int, moe: bool, hf: dict | None, names: Names = Names(),
          parts: Parts = Parts(), linear: bool = False) -> Iterator[Tensor]:
    """The tensors of one block (HF prefix ``pre``), entry ``j`` of the jaxtron stack ``stack``; ``linear``: a
    Gated DeltaNet block. With post-norms (Gemma) ``post_attention_layernorm`` is the attention's post-norm and
    ``pre_feedforward_layernorm`` the MLP's input norm; otherwise the former is the MLP's input norm (Llama)."""
    d, h = cfg.embed_dim, cfg.resolved_head_dim
    yield Tensor(pre + "input_layernorm.weight", (d,), f"{stack}.attn_norm.scale", (j,), *SAME)
    if linear:
        yield from parts.linear(cfg, pre, stack, j, hf)
    else:
        yield from (parts.attention or attention)(cfg, pre, stack, j, hf)
    if cfg.attention.qk_norm and not linear:
        yield Tensor(pre + "self_attn.q_norm.weight", (h,), f"{stack}.attn.q_norm.scale", (j,), *SAME)
        yield Tensor(pre + "self_attn.k_norm.weight", (h,), f"{stack}.attn.k_norm.scale", (j,), *SAME)
    if cfg.post_norms:
        for hf_name, name in (("post_attention_layernorm", "attn_post_norm"), ("pre_feedforward_layernorm",
                                                                               "mlp_norm"),
                              ("post_feedforward_layernorm", "mlp_post_norm")):
            yield Tensor(pre + f"{hf_name}.weight", (d,), f"{stack}.{name}.scale", (j,), *SAME)
    else:
        yield Tensor(pre + "post_attention_layernorm.weight", (d,), f"{stack}.mlp_norm.scale", (j,), *SAME)
    if moe:
        yield from experts(cfg, pre, stack, j, hf, names, parts)
    else:
        yield from mlp(pre + "mlp.", f"{stack}.mlp.", cfg.mlp_dim, d, j)


def attention(cfg: ModelConfig, pre: str, stack: str, j: int, hf: dict | None) -> Iterator[Tensor]:
    """Grouped-query attention's q, k, v and o projections."""
    n, g, d, h = cfg.attention.num_heads, cfg.attention.num_kv_heads, cfg.embed_dim, cfg.resolved_head_dim

    def heads_in(count):  # [count*h, d] <-> [d, count, h]
        return lambda x: x.T.reshape(d, count, h), lambda x: x.reshape(d, count * h).T

    for proj, param, count in (("q", "wq", n), ("k", "wk", g), ("v", "wv", g)):
        yield Tensor(pre + f"self_attn.{proj}_proj.weight", (count * h, d), f"{stack}.attn.{param}.weight", (j,),
                     *heads_in(count))
        if cfg.attention.bias:
            yield Tensor(pre + f"self_attn.{proj}_proj.bias", (count * h,), f"{stack}.attn.{param}.bias", (j,),
                         lambda x, c=count: x.reshape(c, h), lambda x, c=count: x.reshape(c * h))
    yield Tensor(pre + "self_attn.o_proj.weight", (d, n * h), f"{stack}.attn.wo.weight", (j,),
                 lambda x: x.T.reshape(n, h, d), lambda x: x.reshape(n * h, d).T)
    if cfg.attention.bias:
        yield Tensor(pre + "self_attn.o_proj.bias", (d,), f"{stack}.attn.wo.bias", (j,), *SAME)
    if cfg.attention.sinks:
        yield Tensor(pre + "self_attn.sinks", (n,), f"{stack}.attn.sinks", (j,), *SAME)


def mlp(hf_pre: str, pre: str, width: int, d: int, j: int) -> Iterator[Tensor]:
    """A SwiGLU's gate, up and down projections (a dense block's, or shared experts')."""
    for hf_name, name, shape in (("gate_proj", "wi_gate", (width, d)), ("up_proj", "wi_up", (width, d)),
                                 ("down_proj", "wo", (d, width))):
        yield Tensor(hf_pre + f"{hf_name}.weight", shape, pre + f"{name}.weight", (j,), *TRANSPOSE)


def experts(cfg: ModelConfig, pre: str, stack: str, j: int, hf: dict | None, names: Names,
            parts: Parts) -> Iterator[Tensor]:
    """An MoE block: the router, the family's extras, then every routed expert's three matrices."""
    d, fe, where = cfg.embed_dim, cfg.resolved_expert_dim, pre + names.moe
    yield Tensor(where + "gate.weight", (cfg.moe.num_experts, d), f"{stack}.mlp.router", (j,), *TRANSPOSE)
    if parts.moe_extras is not None:
        yield from parts.moe_extras(cfg, pre, stack, j, hf)
    for e in range(cfg.moe.num_experts):
        for name, param, shape in zip(names.experts, ("wi_gate", "wi_up", "wo"), ((fe, d), (fe, d), (d, fe)),
                                      strict=True):
            yield Tensor(where + f"experts.{e}.{name}.weight", shape, f"{stack}.mlp.{param}", (j, e), *TRANSPOSE)


def halves(size: int, start: int) -> np.ndarray:
    """Index that puts the interleaved rotary pairs of dims start..start+size-1 in rotate-half order."""
    rotary = start + np.concatenate([np.arange(0, size, 2), np.arange(1, size, 2)])
    return np.concatenate([np.arange(start), rotary])
