"""The model's sections of the config: the architecture (``ModelConfig``, what a checkpoint's parameters belong
to) and how it runs (``ExecutionConfig``). ``jaxtron.config.schema`` gathers them with the other sections."""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxtron.config.checks import _check, _choice, _non_negative, _positive

COMPUTE_DTYPES = ("float32", "bfloat16")  # float16 would need loss scaling, which bfloat16 does not


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
    rope_scaling: str = "llama3"  # how a rope_scaling_factor > 1 stretches the frequencies: llama3 | yarn
    rope_beta_fast: float = 32.0  # yarn: rotations per original context below which frequencies are kept
    rope_beta_slow: float = 1.0  # yarn: rotations above which they are divided by the factor (a ramp between)
    rope_mscale: float = 0.0  # yarn: the "mscale" of config.json (0: not given)
    rope_mscale_all_dim: float = 0.0  # yarn: "mscale_all_dim" (0: not given); MLA also scales the softmax by it
    # multi-head latent attention (DeepSeek-V3) when kv_lora_rank > 0: keys and values come from one compressed
    # latent, each head's query and key are head_dim (not rotated) plus qk_rope_head_dim (rotated; the key's part
    # is one per token, shared by the heads) wide, and values v_head_dim wide
    q_lora_rank: int = 0  # rank of the queries' low-rank projection (0: one full-rank projection)
    kv_lora_rank: int = 0  # rank of the keys' and values' compressed latent (0: grouped-query attention)
    qk_rope_head_dim: int = 64
    v_head_dim: int = 0  # 0 means head_dim
    tie_embeddings: bool = False
    init_std: float = _not_architecture(0.02)
    # mixture of experts (jaxtron/models/moe.py); num_experts = 0 is a dense model
    num_experts: int = 0  # routed experts per MoE block, each a SwiGLU of width expert_dim
    experts_per_token: int = 2  # top-k: experts each token is sent to
    expert_dim: int = 0  # each expert's intermediate width (0: mlp_dim, the dense blocks' width)
    shared_experts: int = 0  # experts every token visits (DeepSeek): one dense SwiGLU of shared_experts*expert_dim
    first_dense_layers: int = 0  # the first this many blocks are dense (DeepSeek's first_k_dense_replace)
    moe_every: int = 1  # after those, every this many blocks the last one is MoE (1: all); the others are dense
    router: str = "softmax"  # softmax (Mixtral, Qwen3) | sigmoid (DeepSeek-V3: sigmoid scores, a balancing bias)
    router_renormalize: bool = True  # rescale the top-k router weights of a token to sum to 1 (Mixtral)
    router_groups: int = 1  # sigmoid: the experts form this many groups (n_group) ...
    router_top_groups: int = 1  # ... and a token's experts come from the best this many of them (topk_group)
    router_scale: float = 1.0  # the routed experts' weights are multiplied by this (routed_scaling_factor)
    # multi-token prediction (DeepSeek-V3): module k (1..mtp_depth) predicts the token k + 1 ahead from the
    # previous depth's hidden states and the embedding of the token k ahead, through one more block
    mtp_depth: int = 0

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
        _choice(self.rope_scaling, "model.rope_scaling", ("llama3", "yarn"))
        for name in ("rope_beta_fast", "rope_beta_slow"):
            _positive(getattr(self, name), f"model.{name}")
        for name in ("q_lora_rank", "kv_lora_rank", "v_head_dim", "rope_mscale", "rope_mscale_all_dim", "mtp_depth"):
            _non_negative(getattr(self, name), f"model.{name}")
        if self.kv_lora_rank:
            self._check_mla()
        _non_negative(self.num_experts, "model.num_experts")
        if self.num_experts:
            self._check_moe()

    def _check_mla(self) -> None:
        _positive(self.qk_rope_head_dim, "model.qk_rope_head_dim")
        _check(self.qk_rope_head_dim % 2 == 0, "model.qk_rope_head_dim", f"({self.qk_rope_head_dim}) must be even "
               "(rotary pairs)", "choose an even size")
        _check(self.num_kv_heads == self.num_heads, "model.num_kv_heads",
               f"({self.num_kv_heads}) must equal model.num_heads ({self.num_heads}) with latent attention "
               "(model.kv_lora_rank > 0), whose keys and values have one head per query head",
               f"set model.num_kv_heads={self.num_heads}")
        _check(self.position_embedding == "rope" and not self.qk_norm, "model.kv_lora_rank",
               "> 0 (latent attention) needs model.position_embedding='rope' and model.qk_norm=False",
               "set those or model.kv_lora_rank=0")

    def _check_moe(self) -> None:
        _check(self.activation == "swiglu", "model.activation", f"is {self.activation!r} but experts are SwiGLU",
               "set model.activation='swiglu' or model.num_experts=0")
        _check(1 <= self.experts_per_token <= self.num_experts, "model.experts_per_token",
               f"({self.experts_per_token}) must lie between 1 and model.num_experts ({self.num_experts})",
               "choose a top-k in that range")
        _positive(self.moe_every, "model.moe_every")
        _non_negative(self.expert_dim, "model.expert_dim")
        _non_negative(self.shared_experts, "model.shared_experts")
        _check(0 <= self.first_dense_layers < self.num_layers, "model.first_dense_layers",
               f"({self.first_dense_layers}) must lie between 0 and model.num_layers - 1 ({self.num_layers - 1})",
               "leave at least one MoE block")
        _check(not self.first_dense_layers or self.moe_every == 1, "model.first_dense_layers",
               f"({self.first_dense_layers}) needs model.moe_every=1 (dense blocks first, then only MoE ones), "
               f"not {self.moe_every}", "set model.moe_every=1")
        _check(self.num_layers % self.moe_every == 0, "model.moe_every",
               f"({self.moe_every}) must divide model.num_layers ({self.num_layers})", "choose a divisor of it")
        _choice(self.router, "model.router", ("softmax", "sigmoid"))
        _positive(self.router_scale, "model.router_scale")
        _positive(self.router_groups, "model.router_groups")
        _check(self.num_experts % self.router_groups == 0, "model.router_groups",
               f"({self.router_groups}) must divide model.num_experts ({self.num_experts})", "choose a divisor of it")
        _check(1 <= self.router_top_groups <= self.router_groups, "model.router_top_groups",
               f"({self.router_top_groups}) must lie between 1 and model.router_groups ({self.router_groups})",
               "choose a count in that range")
        _check(self.router == "sigmoid" or self.router_groups == 1, "model.router_groups",
               f"({self.router_groups}) needs model.router='sigmoid' (group-limited routing is DeepSeek's)",
               "set model.router='sigmoid' or model.router_groups=1")
        per_group = self.num_experts // self.router_groups
        _check(self.router_groups == 1 or per_group >= 2, "model.router_groups",
               f"({self.router_groups}) leaves {per_group} expert per group; a group's score is its best two",
               "use fewer groups")
        _check(self.experts_per_token <= self.router_top_groups * per_group, "model.experts_per_token",
               f"({self.experts_per_token}) exceeds the {self.router_top_groups * per_group} experts of the "
               f"model.router_top_groups={self.router_top_groups} groups a token may use",
               "raise model.router_top_groups or lower the top-k")

    @classmethod
    def architecture_fields(cls) -> tuple[str, ...]:
        """The fields a checkpoint's parameters belong to: all but a label and the initialisation."""
        return tuple(f.name for f in dataclasses.fields(cls) if f.metadata.get("architecture", True))

    @property
    def period(self) -> int:
        """Blocks in one period of the scanned stack: ``moe_every`` for an MoE model, else 1."""
        return self.moe_every if self.num_experts else 1

    @property
    def prefix_layers(self) -> int:
        """The dense blocks before the MoE ones (``first_dense_layers`` of an MoE model): a stack of their own,
        run before the scanned periods (and before a pipeline schedule, on every stage)."""
        return self.first_dense_layers if self.num_experts else 0

    @property
    def stack_periods(self) -> int:
        """Periods of the scanned stack that a pipeline schedule runs: the blocks after the prefix."""
        return (self.num_layers - self.prefix_layers) // self.period

    @property
    def num_moe_layers(self) -> int:
        return (self.num_layers - self.prefix_layers) // self.moe_every if self.num_experts else 0

    def is_moe_block(self, i: int) -> bool:
        """Whether block i is MoE: after the ``first_dense_layers``, the last of every ``moe_every`` blocks."""
        j = i - self.first_dense_layers
        return bool(self.num_experts) and j >= 0 and (j + 1) % self.moe_every == 0

    @property
    def resolved_expert_dim(self) -> int:
        return self.expert_dim or self.mlp_dim

    @property
    def latent_attention(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def resolved_v_head_dim(self) -> int:
        return self.v_head_dim or self.resolved_head_dim

    @property
    def qk_head_dim(self) -> int:
        """Each head's query and key size: head_dim, plus the rotary part with latent attention."""
        return self.resolved_head_dim + (self.qk_rope_head_dim if self.latent_attention else 0)

    @property
    def resolved_head_dim(self) -> int:
        return self.head_dim or self.embed_dim // self.num_heads


REMAT_CHOICES = ("none", "full", "save_dots", "save_attention", "save_dots_attention")


@dataclasses.dataclass(frozen=True)
class ExecutionConfig:
    """How the model runs: none of these changes its parameters, so a checkpoint restores under any of them."""

    dtype: str = "float32"  # compute dtype; parameters are always float32
    remat: str = "none"  # none | full | save_dots | save_attention | save_dots_attention
    attention: str = "auto"  # auto | xla | cudnn | blockwise (see jaxtron/ops/attention.py)
    attention_max_segments: int = 64  # cuDNN: most documents a packed row may hold (a batch with more is refused)
    fp8: bool = False  # FP8 matmuls (current scaling) in every projection of the blocks; see jaxtron/ops/fp8.py
    fp8_skip_layers: int = 0  # with fp8: the first and the last this many blocks keep 16-bit matmuls
    moe_mode: str = "dropless"  # dropless (grouped GEMM over all routed tokens) | capacity (per-row expert capacity)
    capacity_factor: float = 1.25  # capacity mode: slots per expert and row = ceil(factor * length * k / experts)

    def __post_init__(self):
        _choice(self.dtype, "execution.dtype", COMPUTE_DTYPES)
        _choice(self.remat, "execution.remat", REMAT_CHOICES)
        _choice(self.attention, "execution.attention", ("auto", "xla", "cudnn", "blockwise"))
        _positive(self.attention_max_segments, "execution.attention_max_segments")
        _non_negative(self.fp8_skip_layers, "execution.fp8_skip_layers")
        _choice(self.moe_mode, "execution.moe_mode", ("dropless", "capacity"))
        _positive(self.capacity_factor, "execution.capacity_factor")
