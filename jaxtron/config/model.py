"""The model's sections of the config: the architecture (``ModelConfig``, what a checkpoint's parameters belong
to) and how it runs (``ExecutionConfig``). ``jaxtron.config.schema`` gathers them with the other sections.

The architecture's fields that only some families use sit in subsections: ``rope`` (rotary positions and their scaling
for long contexts), ``attention`` (heads, per-head norms, DeepSeek's latent attention), ``moe`` (experts and their
router) and ``mtp`` (multi-token prediction). A config file of the flat layout (``model.rope_theta``,
``model.num_experts``, ...) still loads, with a warning naming each field's new place (``jaxtron.config.loader``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from jaxtron.config.checks import ConfigError, _check, _choice, _non_negative, _positive

COMPUTE_DTYPES = ("float32", "bfloat16")  # float16 would need loss scaling, which bfloat16 does not
# 'auto': the fastest policy whose step fits the device by the planner's estimate (jaxtron/planning/remat.py)
REMAT_CHOICES = ("none", "full", "save_dots", "save_attention", "save_dots_attention", "auto")


def _not_architecture(default: Any) -> Any:
    """A model field that does not define the function the trained parameters compute (a label, the
    initialisation): a checkpoint resumes under another value."""
    return dataclasses.field(default=default, metadata={"architecture": False})


def replace(obj: Any, **changes: Any) -> Any:
    """``dataclasses.replace`` that merges: a change given as a mapping to a field holding a dataclass (a model's
    subsection) changes only the fields it names, ``replace(model, moe=dict(num_experts=8))``."""
    for name, value in changes.items():
        current = getattr(obj, name)
        if isinstance(value, Mapping) and dataclasses.is_dataclass(current):
            changes[name] = replace(current, **value)
    return dataclasses.replace(obj, **changes)


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    """Rotary position embeddings (``model.position_embedding='rope'``) and their stretching for long contexts;
    the names follow the ``rope_scaling`` entries of Hugging Face's config.json."""

    theta: float = 500_000.0
    scaling: str = "llama3"  # how a factor > 1 stretches the frequencies: llama3 (Llama-3.1) | yarn (DeepSeek-V3)
    factor: float = 1.0  # 1.0: no scaling
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    original_max_len: int = 8192  # the context the frequencies were trained for
    beta_fast: float = 32.0  # yarn: rotations per original context below which frequencies are kept
    beta_slow: float = 1.0  # yarn: rotations above which they are divided by the factor (a ramp between)
    mscale: float = 0.0  # yarn: the "mscale" of config.json (0: not given)
    mscale_all_dim: float = 0.0  # yarn: "mscale_all_dim" (0: not given); latent attention also scales the softmax

    def __post_init__(self):
        for name in ("theta", "factor", "low_freq_factor", "original_max_len", "beta_fast", "beta_slow"):
            _positive(getattr(self, name), f"model.rope.{name}")
        _check(self.high_freq_factor > self.low_freq_factor, "model.rope.high_freq_factor",
               f"({self.high_freq_factor}) must exceed model.rope.low_freq_factor ({self.low_freq_factor})",
               "raise it or lower model.rope.low_freq_factor")
        _choice(self.scaling, "model.rope.scaling", ("llama3", "yarn"))
        for name in ("mscale", "mscale_all_dim"):
            _non_negative(getattr(self, name), f"model.rope.{name}")


@dataclasses.dataclass(frozen=True)
class AttentionConfig:
    """The heads: grouped-query attention (Llama, Qwen3), or multi-head latent attention (DeepSeek-V3) when
    ``kv_lora_rank`` > 0: keys and values come from one compressed latent, each head's query and key are
    ``head_dim`` (not rotated) plus ``qk_rope_head_dim`` (rotated; the key's part is one per token, shared by the
    heads) wide, and values ``v_head_dim`` wide."""

    num_heads: int = 8
    num_kv_heads: int = 4
    head_dim: int = 0  # 0 means embed_dim // num_heads
    qk_norm: bool = False  # RMSNorm over each head's queries and keys before RoPE (Qwen3)
    q_lora_rank: int = 0  # latent: rank of the queries' low-rank projection (0: one full-rank projection)
    kv_lora_rank: int = 0  # latent: rank of the keys' and values' compressed latent (0: grouped-query attention)
    qk_rope_head_dim: int = 64  # latent: the rotated part of each head's query and key
    v_head_dim: int = 0  # latent: each head's value size (0 means head_dim)

    def __post_init__(self):
        _positive(self.num_heads, "model.attention.num_heads")
        _positive(self.num_kv_heads, "model.attention.num_kv_heads")
        for name in ("head_dim", "q_lora_rank", "kv_lora_rank", "v_head_dim"):
            _non_negative(getattr(self, name), f"model.attention.{name}")
        _check(self.num_heads % self.num_kv_heads == 0, "model.attention.num_kv_heads",
               f"({self.num_kv_heads}) must divide model.attention.num_heads ({self.num_heads}) for grouped-query "
               "attention", "choose a divisor of model.attention.num_heads")
        if self.kv_lora_rank:
            _positive(self.qk_rope_head_dim, "model.attention.qk_rope_head_dim")
            _check(self.qk_rope_head_dim % 2 == 0, "model.attention.qk_rope_head_dim",
                   f"({self.qk_rope_head_dim}) must be even (rotary pairs)", "choose an even size")
            _check(self.num_kv_heads == self.num_heads, "model.attention.num_kv_heads",
                   f"({self.num_kv_heads}) must equal model.attention.num_heads ({self.num_heads}) with latent "
                   "attention (model.attention.kv_lora_rank > 0), whose keys and values have one head per query "
                   "head", f"set model.attention.num_kv_heads={self.num_heads}")

    @property
    def latent(self) -> bool:
        return self.kv_lora_rank > 0


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    """Mixture of experts (``jaxtron/models/moe.py``); ``num_experts`` = 0 is a dense model."""

    num_experts: int = 0  # routed experts per MoE block, each a SwiGLU of width expert_dim
    experts_per_token: int = 2  # top-k: experts each token is sent to
    expert_dim: int = 0  # each expert's intermediate width (0: model.mlp_dim, the dense blocks' width)
    shared_experts: int = 0  # experts every token visits (DeepSeek): one dense SwiGLU of shared_experts*expert_dim
    first_dense_layers: int = 0  # the first this many blocks are dense (DeepSeek's first_k_dense_replace)
    every: int = 1  # after those, every this many blocks the last one is MoE (1: all); the others are dense
    router: str = "softmax"  # softmax (Mixtral, Qwen3) | sigmoid (DeepSeek-V3: sigmoid scores, a balancing bias)
    router_renormalize: bool = True  # rescale the top-k router weights of a token to sum to 1 (Mixtral)
    router_groups: int = 1  # sigmoid: the experts form this many groups (n_group) ...
    router_top_groups: int = 1  # ... and a token's experts come from the best this many of them (topk_group)
    router_scale: float = 1.0  # the routed experts' weights are multiplied by this (routed_scaling_factor)

    def __post_init__(self):
        _non_negative(self.num_experts, "model.moe.num_experts")
        if not self.num_experts:
            return
        _check(1 <= self.experts_per_token <= self.num_experts, "model.moe.experts_per_token",
               f"({self.experts_per_token}) must lie between 1 and model.moe.num_experts ({self.num_experts})",
               "choose a top-k in that range")
        _positive(self.every, "model.moe.every")
        _non_negative(self.expert_dim, "model.moe.expert_dim")
        _non_negative(self.shared_experts, "model.moe.shared_experts")
        _non_negative(self.first_dense_layers, "model.moe.first_dense_layers")
        _check(not self.first_dense_layers or self.every == 1, "model.moe.first_dense_layers",
               f"({self.first_dense_layers}) needs model.moe.every=1 (dense blocks first, then only MoE ones), "
               f"not {self.every}", "set model.moe.every=1")
        _choice(self.router, "model.moe.router", ("softmax", "sigmoid"))
        _positive(self.router_scale, "model.moe.router_scale")
        _positive(self.router_groups, "model.moe.router_groups")
        _check(self.num_experts % self.router_groups == 0, "model.moe.router_groups",
               f"({self.router_groups}) must divide model.moe.num_experts ({self.num_experts})",
               "choose a divisor of it")
        _check(1 <= self.router_top_groups <= self.router_groups, "model.moe.router_top_groups",
               f"({self.router_top_groups}) must lie between 1 and model.moe.router_groups ({self.router_groups})",
               "choose a count in that range")
        _check(self.router == "sigmoid" or self.router_groups == 1, "model.moe.router_groups",
               f"({self.router_groups}) needs model.moe.router='sigmoid' (group-limited routing is DeepSeek's)",
               "set model.moe.router='sigmoid' or model.moe.router_groups=1")
        per_router_group = self.num_experts // self.router_groups
        _check(self.router_groups == 1 or per_router_group >= 2, "model.moe.router_groups",
               f"({self.router_groups}) leaves {per_router_group} expert per group; a group's score is its best two",
               "use fewer groups")
        _check(self.experts_per_token <= self.router_top_groups * per_router_group, "model.moe.experts_per_token",
               f"({self.experts_per_token}) exceeds the {self.router_top_groups * per_router_group} experts of the "
               f"model.moe.router_top_groups={self.router_top_groups} groups a token may use",
               "raise model.moe.router_top_groups or lower the top-k")


@dataclasses.dataclass(frozen=True)
class MTPConfig:
    """Multi-token prediction (DeepSeek-V3): module k (1..depth) predicts the token k + 1 ahead from the previous
    depth's hidden states and the embedding of the token k ahead, through one more block."""

    depth: int = 0

    def __post_init__(self):
        _non_negative(self.depth, "model.mtp.depth")


# the subsections of ModelConfig: field name -> its dataclass
SUBSECTIONS = {"rope": RopeConfig, "attention": AttentionConfig, "moe": MoEConfig, "mtp": MTPConfig}


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """The architecture of a decoder-only transformer (Llama-3 family by default); how it runs is in
    ``ExecutionConfig``."""

    name: str = _not_architecture("llama")
    # the family (jaxtron/families/): its Hugging Face form, what its counts add; a label of the parameters, which
    # the mechanism fields below define
    family: str = _not_architecture("llama")
    vocab_size: int = 256
    embed_dim: int = 256
    num_layers: int = 4
    mlp_dim: int = 768
    activation: str = "swiglu"  # swiglu (gated, 3 matrices) | gelu (plain, 2 matrices)
    norm: str = "rmsnorm"  # rmsnorm | layernorm
    norm_eps: float = 1e-5
    position_embedding: str = "rope"  # rope | learned
    max_seq_len: int = 8192  # positions the model supports (size of learned position table)
    tie_embeddings: bool = False
    init_std: float = _not_architecture(0.02)
    rope: RopeConfig = dataclasses.field(default_factory=RopeConfig)
    attention: AttentionConfig = dataclasses.field(default_factory=AttentionConfig)
    moe: MoEConfig = dataclasses.field(default_factory=MoEConfig)
    mtp: MTPConfig = dataclasses.field(default_factory=MTPConfig)

    def __post_init__(self):
        for name, cls in SUBSECTIONS.items():  # a subsection may be given as a mapping of its fields
            value = getattr(self, name)
            if isinstance(value, Mapping):
                object.__setattr__(self, name, cls(**value))
            elif not isinstance(value, cls):
                raise ConfigError(f"config field 'model.{name}' must hold fields, not {value!r}; give it as "
                                  f"a dict of the fields of {cls.__name__}.")
        _check(bool(self.family.strip()), "model.family", "is empty", "name the model's family, e.g. 'llama'")
        for name in ("vocab_size", "embed_dim", "num_layers", "mlp_dim", "max_seq_len", "norm_eps", "init_std"):
            _positive(getattr(self, name), f"model.{name}")
        _choice(self.activation, "model.activation", ("swiglu", "gelu"))
        _choice(self.norm, "model.norm", ("rmsnorm", "layernorm"))
        _choice(self.position_embedding, "model.position_embedding", ("rope", "learned"))
        a = self.attention
        _check(a.head_dim > 0 or self.embed_dim % a.num_heads == 0, "model.attention.head_dim",
               f"is 0 (derived) but model.embed_dim ({self.embed_dim}) is not divisible by model.attention.num_heads "
               f"({a.num_heads})", "set model.attention.head_dim explicitly")
        _check(not a.latent or (self.position_embedding == "rope" and not a.qk_norm), "model.attention.kv_lora_rank",
               "> 0 (latent attention) needs model.position_embedding='rope' and model.attention.qk_norm=False",
               "set those or model.attention.kv_lora_rank=0")
        if self.moe.num_experts:
            m = self.moe
            _check(self.activation == "swiglu", "model.activation", f"is {self.activation!r} but experts are SwiGLU",
                   "set model.activation='swiglu' or model.moe.num_experts=0")
            _check(m.first_dense_layers < self.num_layers, "model.moe.first_dense_layers",
                   f"({m.first_dense_layers}) must lie between 0 and model.num_layers - 1 ({self.num_layers - 1})",
                   "leave at least one MoE block")
            _check(self.num_layers % m.every == 0, "model.moe.every",
                   f"({m.every}) must divide model.num_layers ({self.num_layers})", "choose a divisor of it")

    @classmethod
    def architecture_fields(cls) -> tuple[str, ...]:
        """The dotted paths (``embed_dim``, ``rope.theta``, ...) of the fields a checkpoint's parameters belong
        to: all but a label and the initialisation."""
        paths = []
        for f in dataclasses.fields(cls):
            if f.name in SUBSECTIONS:
                paths += [f"{f.name}.{g.name}" for g in dataclasses.fields(SUBSECTIONS[f.name])]
            elif f.metadata.get("architecture", True):
                paths.append(f.name)
        return tuple(paths)

    @property
    def period(self) -> int:
        """Blocks in one period of the scanned stack: ``moe.every`` for an MoE model, else 1."""
        return self.moe.every if self.moe.num_experts else 1

    @property
    def prefix_layers(self) -> int:
        """The dense blocks before the MoE ones (``moe.first_dense_layers`` of an MoE model): a stack of their own,
        run before the scanned periods (and before a pipeline schedule, on every stage)."""
        return self.moe.first_dense_layers if self.moe.num_experts else 0

    @property
    def stack_periods(self) -> int:
        """Periods of the scanned stack that a pipeline schedule runs: the blocks after the prefix."""
        return (self.num_layers - self.prefix_layers) // self.period

    @property
    def num_moe_layers(self) -> int:
        return (self.num_layers - self.prefix_layers) // self.moe.every if self.moe.num_experts else 0

    def is_moe_block(self, i: int) -> bool:
        """Whether block i is MoE: after the ``moe.first_dense_layers``, the last of every ``moe.every`` blocks."""
        j = i - self.moe.first_dense_layers
        return bool(self.moe.num_experts) and j >= 0 and (j + 1) % self.moe.every == 0

    @property
    def resolved_expert_dim(self) -> int:
        return self.moe.expert_dim or self.mlp_dim

    @property
    def latent_attention(self) -> bool:
        return self.attention.latent

    @property
    def resolved_head_dim(self) -> int:
        return self.attention.head_dim or self.embed_dim // self.attention.num_heads

    @property
    def resolved_v_head_dim(self) -> int:
        return self.attention.v_head_dim or self.resolved_head_dim

    @property
    def qk_head_dim(self) -> int:
        """Each head's query and key size: head_dim, plus the rotary part with latent attention."""
        return self.resolved_head_dim + (self.attention.qk_rope_head_dim if self.latent_attention else 0)


def older_family(cfg: ModelConfig) -> str:
    """The family a model config written before ``model.family`` is, by the rule export used then: latent
    attention is DeepSeek-V3, per-head norms Qwen3 (with experts Qwen3-MoE), experts alone Mixtral, GPT-3's blocks
    GPT-3, the rest Llama. Only for such configs (``jaxtron.config.loader``); a family is named, never guessed."""
    if cfg.latent_attention:
        return "deepseek_v3"
    if cfg.attention.qk_norm:
        return "qwen3_moe" if cfg.moe.num_experts else "qwen3"
    if cfg.moe.num_experts:
        return "mixtral"
    if (cfg.activation, cfg.norm, cfg.position_embedding) != ("swiglu", "rmsnorm", "rope"):
        return "gpt3"
    return "llama"


@dataclasses.dataclass(frozen=True)
class ExecutionConfig:
    """How the model runs: none of these changes its parameters, so a checkpoint restores under any of them."""

    dtype: str = "float32"  # compute dtype; parameters are always float32
    remat: str = "none"  # none | full | save_dots | save_attention | save_dots_attention | auto
    attention: str = "auto"  # auto | xla | cudnn | blockwise (see jaxtron/ops/attention.py)
    # the layers run by a loop (compile time independent of depth) or, False, in line: no stacking of the saved
    # activations into per-layer buffers (copies a loop needs), for more compile time and memory (docs/model.md)
    scan_layers: bool = True
    attention_max_segments: int = 64  # cuDNN: most documents a packed row may hold (a batch with more is refused)
    fp8: bool = False  # FP8 matmuls (current scaling) in every projection of the blocks; see jaxtron/ops/fp8.py
    fp8_skip_layers: int = 0  # with fp8: the first and the last this many blocks keep 16-bit matmuls
    moe_mode: str = "dropless"  # dropless (grouped GEMM over all routed tokens) | capacity (per-row expert capacity)
    capacity_factor: float = 1.25  # capacity mode: slots per expert and row = ceil(factor * length * k / experts)
    expert_gemm: str = "auto"  # dropless mode's grouped GEMM: auto | xla | tokamax (see jaxtron/ops/grouped.py)
    moe_exchange: str = "auto"  # dropless mode's all-to-all: auto | padded | ragged (see jaxtron/ops/exchange.py)
    # dropless with expert parallelism: each device's receive buffer holds this many times its own routed rows
    # (rows past it are dropped and counted); 0 sizes it for the worst case, every peer's rows, and drops nothing
    moe_receive_factor: float = 0.0
    # each device's tokens run through the experts in this many chunks, so that one chunk's exchanges may run beside
    # another's expert GEMMs (models/moe.py; what XLA's scheduler makes of it: benchmarks/moe_overlap.md)
    moe_chunks: int = 1
    # dropless, experts split over nodes: this many expert shards share a node (NVLink). Each token crosses once to
    # each node that holds one of its experts, to the device at its own place there, which hands its rows on to the
    # experts within the node and sends their weighted sum back as one row (two hops, as DeepSeek-V3 dispatches;
    # models/experts.py). 0, or every expert shard, sends each assignment straight to its expert's device
    moe_node_shards: int = 0
    # what XLA's latency-hiding scheduler weighs a GPU program whose experts are split with: 'budget', the costs of a
    # first compile's kernels and collectives (jaxtron/metrics/schedule.py), then compiled again; 'xla', its own guesses
    moe_schedule: str = "budget"

    def __post_init__(self):
        _choice(self.dtype, "execution.dtype", COMPUTE_DTYPES)
        _choice(self.remat, "execution.remat", REMAT_CHOICES)
        _choice(self.attention, "execution.attention", ("auto", "xla", "cudnn", "blockwise"))
        _positive(self.attention_max_segments, "execution.attention_max_segments")
        _non_negative(self.fp8_skip_layers, "execution.fp8_skip_layers")
        _choice(self.moe_mode, "execution.moe_mode", ("dropless", "capacity"))
        _positive(self.capacity_factor, "execution.capacity_factor")
        _choice(self.expert_gemm, "execution.expert_gemm", ("auto", "xla", "tokamax"))
        _choice(self.moe_exchange, "execution.moe_exchange", ("auto", "padded", "ragged"))
        _non_negative(self.moe_receive_factor, "execution.moe_receive_factor")
        _positive(self.moe_chunks, "execution.moe_chunks")
        _non_negative(self.moe_node_shards, "execution.moe_node_shards")
        _choice(self.moe_schedule, "execution.moe_schedule", ("budget", "xla"))
        _check(not (self.moe_node_shards and self.moe_mode == "capacity"), "execution.moe_node_shards",
               f"({self.moe_node_shards}) sends dropless rows once per node, and execution.moe_mode is 'capacity'",
               "set it to 0, or use execution.moe_mode='dropless'")
        _check(not (self.moe_node_shards and self.moe_exchange == "padded"), "execution.moe_node_shards",
               f"({self.moe_node_shards}) sends each node only its rows, which the ragged exchange does, and "
               "execution.moe_exchange is 'padded'", "set execution.moe_exchange to 'auto' or 'ragged'")
        _check(not (self.moe_receive_factor and self.moe_exchange == "padded"), "execution.moe_receive_factor",
               f"({self.moe_receive_factor}) sizes the ragged exchange's receive buffers, and "
               "execution.moe_exchange is 'padded'", "set execution.moe_exchange to 'auto' or 'ragged'")


# the flat layout's model fields -> their place in the subsections (old dotted path under 'model' -> new one)
FLAT_MODEL_FIELDS = {
    **{f"rope_{name}": f"rope.{name}" for name in (
        "theta", "low_freq_factor", "high_freq_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim")},
    "rope_scaling": "rope.scaling", "rope_scaling_factor": "rope.factor",
    "rope_original_max_len": "rope.original_max_len",
    **{name: f"attention.{name}" for name in (
        "num_heads", "num_kv_heads", "head_dim", "qk_norm", "q_lora_rank", "kv_lora_rank", "qk_rope_head_dim",
        "v_head_dim")},
    **{name: f"moe.{name}" for name in (
        "num_experts", "experts_per_token", "expert_dim", "shared_experts", "first_dense_layers", "router",
        "router_renormalize", "router_groups", "router_top_groups", "router_scale")},
    "moe_every": "moe.every", "mtp_depth": "mtp.depth",
}
