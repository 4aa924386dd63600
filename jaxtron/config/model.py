"""The model's sections of the config: the architecture (``ModelConfig``, what a checkpoint's parameters belong
to) and how it runs (``ExecutionConfig``). ``jaxtron.config.schema`` gathers them with the other sections."""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxtron.config.checks import _check, _choice, _non_negative, _positive


DTYPES = ("float32", "bfloat16")  # float16 would need loss scaling, which bfloat16 does not


def _not_architecture(default: Any) -> Any:
    """A model field that does not define the function the trained parameters compute (a label, the
    initialisation): a checkpoint resumes under another value."""
    return dataclasses.field(default=default, metadata={"architecture": False})


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """The architecture of a decoder-only transformer (Llama-3 family by default); how it runs is in
    ``ExecutionConfig``."""

    name: str = _not_architecture("llama")
    vocab_size: int = 256
    embed_dim: int = 256
    num_layers: int = 4
    num_heads: int = 8
    num_kv_heads: int = 4
    head_dim: int = 0  # 0 means embed_dim // num_heads
    qk_norm: bool = False  # RMSNorm over each head's queries and keys before RoPE (Qwen3)
    mlp_dim: int = 768
    activation: str = "swiglu"  # swiglu (gated, 3 matrices) | gelu (plain, 2 matrices)
    norm: str = "rmsnorm"  # rmsnorm | layernorm
    norm_eps: float = 1e-5
    position_embedding: str = "rope"  # rope | learned
    max_seq_len: int = 8192  # positions the model supports (size of learned position table)
    rope_theta: float = 500_000.0
    rope_scaling_factor: float = 1.0  # Llama-3.1 frequency scaling; 1.0 disables it
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_len: int = 8192
    tie_embeddings: bool = False
    init_std: float = _not_architecture(0.02)
    # mixture of experts (jaxtron/models/moe.py); num_experts = 0 is a dense model
    num_experts: int = 0  # experts per MoE block, each a SwiGLU of width mlp_dim
    experts_per_token: int = 2  # top-k: experts each token is sent to
    moe_every: int = 1  # every this many blocks, the last one is MoE (1: all); the others keep the dense MLP
    router_renormalize: bool = True  # rescale the top-k router weights of a token to sum to 1 (Mixtral)

    def __post_init__(self):
        for name in ("vocab_size", "embed_dim", "num_layers", "num_heads", "num_kv_heads", "mlp_dim",
                     "max_seq_len", "rope_original_max_len"):
            _positive(getattr(self, name), f"model.{name}")
        _non_negative(self.head_dim, "model.head_dim")
        for name in ("norm_eps", "rope_theta", "init_std", "rope_scaling_factor", "rope_low_freq_factor"):
            _positive(getattr(self, name), f"model.{name}")
        _check(self.rope_high_freq_factor > self.rope_low_freq_factor, "model.rope_high_freq_factor",
               f"({self.rope_high_freq_factor}) must exceed model.rope_low_freq_factor ({self.rope_low_freq_factor})",
               "raise it or lower model.rope_low_freq_factor")
        _check(self.num_heads % self.num_kv_heads == 0, "model.num_kv_heads",
               f"({self.num_kv_heads}) must divide model.num_heads ({self.num_heads}) for grouped-query attention",
               "choose a divisor of model.num_heads")
        _check(self.head_dim > 0 or self.embed_dim % self.num_heads == 0, "model.head_dim",
               f"is 0 (derived) but model.embed_dim ({self.embed_dim}) is not divisible by model.num_heads "
               f"({self.num_heads})", "set model.head_dim explicitly")
        _choice(self.activation, "model.activation", ("swiglu", "gelu"))
        _choice(self.norm, "model.norm", ("rmsnorm", "layernorm"))
        _choice(self.position_embedding, "model.position_embedding", ("rope", "learned"))
        _non_negative(self.num_experts, "model.num_experts")
        if self.num_experts:
            self._check_moe()

    def _check_moe(self) -> None:
        _check(self.activation == "swiglu", "model.activation", f"is {self.activation!r} but experts are SwiGLU",
               "set model.activation='swiglu' or model.num_experts=0")
        _check(1 <= self.experts_per_token <= self.num_experts, "model.experts_per_token",
               f"({self.experts_per_token}) must lie between 1 and model.num_experts ({self.num_experts})",
               "choose a top-k in that range")
        _positive(self.moe_every, "model.moe_every")
        _check(self.num_layers % self.moe_every == 0, "model.moe_every",
               f"({self.moe_every}) must divide model.num_layers ({self.num_layers})", "choose a divisor of it")

    @classmethod
    def architecture_fields(cls) -> tuple[str, ...]:
        """The fields a checkpoint's parameters belong to: all but a label and the initialisation."""
        return tuple(f.name for f in dataclasses.fields(cls) if f.metadata.get("architecture", True))

    @property
    def period(self) -> int:
        """Blocks in one period of the scanned stack: ``moe_every`` for an MoE model, else 1."""
        return self.moe_every if self.num_experts else 1

    @property
    def num_moe_layers(self) -> int:
        return self.num_layers // self.moe_every if self.num_experts else 0

    @property
    def resolved_head_dim(self) -> int:
        return self.head_dim or self.embed_dim // self.num_heads


REMAT_POLICIES = ("none", "full", "save_dots", "save_attention", "save_dots_attention")


@dataclasses.dataclass(frozen=True)
class ExecutionConfig:
    """How the model runs: none of these changes its parameters, so a checkpoint restores under any of them."""

    dtype: str = "float32"  # compute dtype; parameters are always float32
    remat: str = "none"  # none | full | save_dots | save_attention | save_dots_attention
    attention: str = "auto"  # auto | xla | cudnn
    attention_max_segments: int = 64  # cuDNN: most documents a packed row may hold (a batch with more is refused)
    fp8: bool = False  # FP8 matmuls (current scaling) in every projection of the blocks; see jaxtron/ops/fp8.py
    fp8_skip_layers: int = 0  # with fp8: the first and the last this many blocks keep 16-bit matmuls
    moe_mode: str = "dropless"  # dropless (grouped GEMM over all routed tokens) | capacity (per-row expert capacity)
    capacity_factor: float = 1.25  # capacity mode: slots per expert and row = ceil(factor * length * k / experts)

    def __post_init__(self):
        _choice(self.dtype, "execution.dtype", DTYPES)
        _choice(self.remat, "execution.remat", REMAT_POLICIES)
        _choice(self.attention, "execution.attention", ("auto", "xla", "cudnn", "blockwise"))
        _positive(self.attention_max_segments, "execution.attention_max_segments")
        _non_negative(self.fp8_skip_layers, "execution.fp8_skip_layers")
        _choice(self.moe_mode, "execution.moe_mode", ("dropless", "capacity"))
        _positive(self.capacity_factor, "execution.capacity_factor")
