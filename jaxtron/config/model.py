"""The model's sections of the config: the architecture (``ModelConfig``, what a checkpoint's parameters belong
to) and how it runs (``ExecutionConfig``). ``jaxtron.config.schema`` gathers them with the other sections.

The architecture's fields that only some families use sit in subsections: ``rope`` (rotary positions and their scaling
for long contexts), ``attention`` (heads, per-head norms, DeepSeek's latent attention), ``moe`` (experts and their
router) and ``mtp`` (multi-token prediction). A config file of the flat layout (``model.rope_theta``,
``model.num_experts``, ...) still loads, with a warning naming each field's new place (``jaxtron.config.loader``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any, NamedTuple

from jaxtron.config.checks import ConfigError, _check, _choice, _non_negative, _positive
from jaxtron.config.subsections import AttentionConfig, LinearAttentionConfig, MoEConfig, MTPConfig, RopeConfig

COMPUTE_DTYPES = ("float32", "bfloat16")  # float16 would need loss scaling, which bfloat16 does not
# 'auto': the fastest policy whose step fits the device by the planner's estimate (jaxtron/planning/remat.py)
GATED = ("swiglu", "geglu", "clamped_swiglu")  # the activations with a gate projection (3 matrices)
REMAT_CHOICES = ("none", "full", "save_dots", "save_attention", "save_dots_attention", "auto")
FP8_RECIPES = ("tensorwise", "blockwise", "mxfp8", "nvfp4")  # execution.fp8_recipe


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


# the subsections of ModelConfig: field name -> its dataclass
SUBSECTIONS = {"rope": RopeConfig, "attention": AttentionConfig, "linear": LinearAttentionConfig, "moe": MoEConfig,
               "mtp": MTPConfig}

# the stacks that hold the blocks of each kind, in the order of BlockKind.stack: dense and MoE blocks with attention,
# then dense and MoE blocks with Gated DeltaNet
STACKS = ("layers", "moe_layers", "linear_layers", "linear_moe_layers")


class BlockKind(NamedTuple):
    """What a block is: MoE or dense, local (windowed) attention or not, Gated DeltaNet or attention."""

    moe: bool
    local: bool
    linear: bool = False

    @property
    def stack(self) -> int:
        """Its stack's index in ``STACKS``: blocks of one kind have parameters of one shape."""
        return int(self.moe) + 2 * int(self.linear)


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
    # swiglu (gated, 3 matrices) | geglu (gated by tanh-approximated GELU: Gemma) | clamped_swiglu (gpt-oss: the gate
    # clamped above and the up projection both sides at swiglu_limit, (up + 1) * gate * sigmoid(swiglu_alpha * gate))
    # | gelu (plain, 2 matrices)
    activation: str = "swiglu"
    swiglu_limit: float = 7.0  # clamped_swiglu's clamp
    swiglu_alpha: float = 1.702  # clamped_swiglu's sigmoid gain
    norm: str = "rmsnorm"  # rmsnorm | layernorm
    norm_unit_offset: bool = False  # RMSNorm scales by 1 + its weight, which starts at 0 (Gemma)
    post_norms: bool = False  # norms on the attention's and the MLP's outputs before the residual sums (Gemma 2, 3)
    embed_scale: bool = False  # the embeddings multiplied by sqrt(embed_dim) (Gemma)
    norm_eps: float = 1e-5
    position_embedding: str = "rope"  # rope | learned
    max_seq_len: int = 8192  # positions the model supports (size of learned position table)
    tie_embeddings: bool = False
    init_std: float = _not_architecture(0.02)
    rope: RopeConfig = dataclasses.field(default_factory=RopeConfig)
    attention: AttentionConfig = dataclasses.field(default_factory=AttentionConfig)
    linear: LinearAttentionConfig = dataclasses.field(default_factory=LinearAttentionConfig)
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
        _choice(self.activation, "model.activation", GATED + ("gelu",))
        _positive(self.swiglu_limit, "model.swiglu_limit")
        _positive(self.swiglu_alpha, "model.swiglu_alpha")
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
            _check(self.activation in ("swiglu", "clamped_swiglu"), "model.activation",
                   f"is {self.activation!r} but experts are SwiGLU", "set model.activation='swiglu' or "
                   "'clamped_swiglu', or model.moe.num_experts=0")
            _check(m.first_dense_layers < self.num_layers, "model.moe.first_dense_layers",
                   f"({m.first_dense_layers}) must lie between 0 and model.num_layers - 1 ({self.num_layers - 1})",
                   "leave at least one MoE block")
            _check(self.num_layers % m.every == 0, "model.moe.every",
                   f"({m.every}) must divide model.num_layers ({self.num_layers})", "choose a divisor of it")
            _check(self.num_layers % a.period == 0, "model.attention.global_every",
                   f"({a.global_every}) must divide model.num_layers ({self.num_layers}) in a model with experts",
                   "choose a divisor of it")
            _check(a.period == 1 or not m.first_dense_layers, "model.attention.global_every",
                   f"({a.global_every}) places global layers, and model.moe.first_dense_layers is "
                   f"{m.first_dense_layers}", "set one of them to 0")
        _check(not a.latent or not self.rope.local_theta, "model.rope.local_theta",
               "is set, which latent attention does not implement", "set it to 0")
        _check(not self.rope.local_theta or a.local, "model.rope.local_theta",
               f"({self.rope.local_theta}) is the local layers' base, and model.attention.window is 0",
               "set model.attention.window, or model.rope.local_theta to 0")
        _check(not self.norm_unit_offset or self.norm == "rmsnorm", "model.norm_unit_offset",
               f"is set, and model.norm is {self.norm!r}", "set model.norm='rmsnorm' or model.norm_unit_offset=False")
        self._check_linear()

    def _check_linear(self) -> None:
        """Gated DeltaNet blocks (``model.linear.every``): the pattern fills the model, no other pattern or prefix."""
        every = self.linear.every
        if not every:
            return
        _check(self.num_layers % every == 0, "model.linear.every",
               f"({every}) must divide model.num_layers ({self.num_layers})", "choose a divisor of it")
        for name, value in (("attention.window", self.attention.window), ("attention.chunk", self.attention.chunk),
                            ("attention.kv_lora_rank",
                            self.attention.kv_lora_rank), ("moe.first_dense_layers", self.moe.first_dense_layers),
                            ("mtp.depth", self.mtp.depth)):
            _check(not value, f"model.{name}", f"({value}) is set with Gated DeltaNet blocks (model.linear.every), "
                   "which jaxtron does not combine", f"set model.{name} to 0 or model.linear.every to 0")

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
        """Blocks in one period of the scanned stack: the least common multiple of ``moe.every`` (an MoE model)
        and the local/global pattern's length (``attention.global_every``)."""
        return math.lcm(self.moe.every if self.moe.num_experts else 1, self.attention.period, self.linear.period)

    @property
    def prefix_layers(self) -> int:
        """The blocks run before the scanned periods (and before a pipeline schedule, on every stage): the dense
        blocks before the MoE ones (``moe.first_dense_layers`` of an MoE model), or in a dense model the blocks
        the local/global pattern's periods leave over (Gemma 3 1B's 26 = 2 + 4 x 6), which are local."""
        if self.moe.num_experts:
            return self.moe.first_dense_layers
        return self.num_layers % self.period

    @property
    def lead_stack(self) -> bool:
        """Whether the prefix blocks are a stack of their own (``lead_layers``): in a dense model. An MoE model's
        prefix is its dense stack (``layers``), whose blocks all precede the MoE ones."""
        return bool(self.prefix_layers) and not self.moe.num_experts

    def period_blocks(self) -> tuple[BlockKind, ...]:
        """Each block of a period in order, as its kind."""
        return tuple(self.block_kind(self.prefix_layers + j) for j in range(self.period))

    def block_kind(self, i: int) -> BlockKind:
        return BlockKind(self.is_moe_block(i), self.attention.is_local(i), self.linear.is_linear(i))

    def is_local_block(self, i: int) -> bool:
        """Whether block i attends only within ``attention.window`` or ``attention.chunk``."""
        return self.attention.is_local(i)

    def stack_blocks(self, stack: int) -> int:
        """How many blocks the stack ``STACKS[stack]`` holds (a dense model's lead stack apart)."""
        lead = self.prefix_layers if self.lead_stack else 0
        return sum(self.block_kind(i).stack == stack for i in range(lead, self.num_layers))

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
    fp8: bool = False  # low-precision matmuls in every projection of the blocks, by ``fp8_recipe``
    # with fp8, how the operands are scaled: tensorwise (one current scale a tensor, ops/fp8.py), blockwise
    # (DeepSeek-V3's 1 x 128 tiles and 128 x 128 weight blocks on Hopper; ops/blockwise_fp8.py), mxfp8 (32-element
    # blocks with power-of-two scales, Blackwell's block-scaled GEMMs; ops/block_scaled.py), nvfp4 (4-bit
    # elements in 16-element blocks, Blackwell only; ops/nvfp4.py)
    fp8_recipe: str = "tensorwise"
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
    # with a tensor group: each block's projections run in this many chunks of the rows, so that one chunk's
    # gathers and reduce-scatters run beside another's GEMMs (models/tensor_chunks.py); 1 runs them whole. Off
    # until a GPU times it: on the H100 target the blocks' collectives go from 51% (gathers) and 13% hidden to 84%
    tensor_chunks: int = 1

    def __post_init__(self):
        _choice(self.dtype, "execution.dtype", COMPUTE_DTYPES)
        _choice(self.remat, "execution.remat", REMAT_CHOICES)
        _choice(self.attention, "execution.attention", ("auto", "xla", "cudnn", "blockwise"))
        _positive(self.attention_max_segments, "execution.attention_max_segments")
        _choice(self.fp8_recipe, "execution.fp8_recipe", FP8_RECIPES)
        _non_negative(self.fp8_skip_layers, "execution.fp8_skip_layers")
        _choice(self.moe_mode, "execution.moe_mode", ("dropless", "capacity"))
        _positive(self.capacity_factor, "execution.capacity_factor")
        _choice(self.expert_gemm, "execution.expert_gemm", ("auto", "xla", "tokamax"))
        _choice(self.moe_exchange, "execution.moe_exchange", ("auto", "padded", "ragged"))
        _non_negative(self.moe_receive_factor, "execution.moe_receive_factor")
        _positive(self.moe_chunks, "execution.moe_chunks")
        _positive(self.tensor_chunks, "execution.tensor_chunks")
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
