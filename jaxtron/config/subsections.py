"""The subsections of the model config (``model.rope``, ``model.attention``, ``model.linear``, ``model.moe``,
``model.mtp``): the
architecture's fields that only some families use, each subsection a frozen dataclass that checks itself.
``jaxtron.config.model`` gathers them into ``ModelConfig``."""

from __future__ import annotations

import dataclasses

from jaxtron.config.checks import _check, _choice, _non_negative, _positive


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    """Rotary position embeddings (``model.position_embedding='rope'``) and their stretching for long contexts;
    the names follow the ``rope_scaling`` entries of Hugging Face's config.json."""

    theta: float = 500_000.0
    # how a factor > 1 stretches the frequencies: llama3 (Llama-3.1) | yarn (DeepSeek-V3, gpt-oss) | linear (every
    # frequency divided by the factor: Gemma 3's global layers)
    scaling: str = "llama3"
    factor: float = 1.0  # 1.0: no scaling
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    original_max_len: int = 8192  # the context the frequencies were trained for
    beta_fast: float = 32.0  # yarn: rotations per original context below which frequencies are kept
    beta_slow: float = 1.0  # yarn: rotations above which they are divided by the factor (a ramp between)
    mscale: float = 0.0  # yarn: the "mscale" of config.json (0: not given)
    mscale_all_dim: float = 0.0  # yarn: "mscale_all_dim" (0: not given); latent attention also scales the softmax
    truncate: bool = True  # yarn: the ramp's ends rounded to whole dimensions (gpt-oss does not round them)
    # the local layers' base (model.attention.window), which rotate without scaling (Gemma 3's rope_local_base_freq);
    # 0: they rotate as the global layers do
    local_theta: float = 0.0
    # the share of each head's dimensions that rotate, the first ones (partial_rotary_factor: Qwen3.5's 0.25)
    fraction: float = 1.0

    def __post_init__(self):
        _check(0 < self.fraction <= 1, "model.rope.fraction", f"({self.fraction}) must lie in (0, 1]",
               "give the share of each head's dimensions that rotate, e.g. 0.25")
        for name in ("theta", "factor", "low_freq_factor", "original_max_len", "beta_fast", "beta_slow"):
            _positive(getattr(self, name), f"model.rope.{name}")
        _check(self.high_freq_factor >= self.low_freq_factor, "model.rope.high_freq_factor",
               f"({self.high_freq_factor}) must not be below model.rope.low_freq_factor ({self.low_freq_factor})",
               "raise it or lower model.rope.low_freq_factor")
        _choice(self.scaling, "model.rope.scaling", ("llama3", "yarn", "linear"))
        for name in ("mscale", "mscale_all_dim", "local_theta"):
            _non_negative(getattr(self, name), f"model.rope.{name}")


@dataclasses.dataclass(frozen=True)
class AttentionConfig:
    """The heads: grouped-query attention (Llama, Qwen3), or multi-head latent attention (DeepSeek-V3) when
    ``kv_lora_rank`` > 0: keys and values come from one compressed latent, each head's query and key are
    ``head_dim`` (not rotated) plus ``qk_rope_head_dim`` (rotated; the key's part is one per token, shared by the
    heads) wide, and values ``v_head_dim`` wide.

    Local and global layers (Gemma 3, gpt-oss): with ``window`` > 0 a block attends to the ``window`` latest keys
    up to its own position, except the last of every ``global_every`` blocks, which sees every earlier key. With
    ``chunk`` > 0 (Llama 4) a local block sees the earlier keys of its own chunk of ``chunk`` positions."""

    num_heads: int = 8
    num_kv_heads: int = 4
    head_dim: int = 0  # 0 means embed_dim // num_heads
    qk_norm: bool = False  # RMSNorm over each head's queries and keys before RoPE (Qwen3)
    q_lora_rank: int = 0  # latent: rank of the queries' low-rank projection (0: one full-rank projection)
    kv_lora_rank: int = 0  # latent: rank of the keys' and values' compressed latent (0: grouped-query attention)
    qk_rope_head_dim: int = 64  # latent: the rotated part of each head's query and key
    v_head_dim: int = 0  # latent: each head's value size (0 means head_dim)
    window: int = 0  # keys a local layer sees, its own position's included (0: every layer is global)
    global_every: int = 0  # with a window: the last of every this many blocks is global (0: none is)
    sinks: bool = False  # a learned logit per head beside the keys, whose value is zero (gpt-oss)
    bias: bool = False  # biases on the query, key, value and output projections (gpt-oss)
    # the softmax scale is this to the power -1/2 (Gemma's query_pre_attn_scalar); 0: the query's own size
    query_pre_attn_scalar: float = 0.0
    # the output multiplied by sigmoid of a gate projected from the block's input, per head and dimension, before
    # the output projection (Qwen3-Next, Qwen3.5)
    output_gate: bool = False
    # local layers attend within aligned chunks of this many positions of their document, not a sliding window
    # (Llama 4's attention_chunk_size); 0: none
    chunk: int = 0
    global_nope: bool = False  # the global layers have no rotary positions (Llama 4's NoPE layers)
    # the NoPE layers' queries scaled by 1 + temperature_scale * ln(1 + floor((position + 1) / temperature_floor))
    # (Llama 4's attn_temperature_tuning, floor_scale and attn_scale); 0: no scaling
    temperature_floor: int = 0
    temperature_scale: float = 0.1
    # the rotated layers' queries and keys RMS-normalised without a weight, after RoPE (Llama 4's use_qk_norm, which
    # transformers calls an L2 norm)
    qk_l2_norm: bool = False

    def __post_init__(self):
        _positive(self.num_heads, "model.attention.num_heads")
        _positive(self.num_kv_heads, "model.attention.num_kv_heads")
        for name in ("head_dim", "q_lora_rank", "kv_lora_rank", "v_head_dim", "window", "global_every",
                     "query_pre_attn_scalar", "chunk", "temperature_floor", "temperature_scale"):
            _non_negative(getattr(self, name), f"model.attention.{name}")
        _check(not self.global_every or self.window or self.chunk, "model.attention.global_every",
               f"({self.global_every}) places global layers among local ones, and model.attention.window and "
               "chunk are 0", "set model.attention.window or chunk for the local layers, or global_every to 0")
        _check(not (self.window and self.chunk), "model.attention.chunk",
               f"({self.chunk}) and model.attention.window ({self.window}) are both set; a local layer is one or the "
               "other", "set one of them to 0")
        _check(not self.temperature_floor or self.global_nope, "model.attention.temperature_floor",
               f"({self.temperature_floor}) scales the NoPE layers' queries, and model.attention.global_nope is off",
               "set model.attention.global_nope, or temperature_floor to 0")
        _check(not self.global_nope or self.global_every, "model.attention.global_nope",
               "is set, and model.attention.global_every places no global layers",
               "set model.attention.global_every, or global_nope to False")
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
            for name in ("window", "sinks", "bias", "query_pre_attn_scalar", "output_gate", "chunk", "global_nope",
                         "qk_l2_norm"):
                _check(not getattr(self, name), f"model.attention.{name}",
                       "is set, which latent attention (model.attention.kv_lora_rank > 0) does not implement",
                       f"leave model.attention.{name} at its default")

    @property
    def latent(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def period(self) -> int:
        """Blocks in one repeat of the local/global pattern (1 without global layers among local ones)."""
        return self.global_every if self.local and self.global_every else 1

    @property
    def local(self) -> bool:
        """Whether some layers are local: a sliding window or chunks."""
        return bool(self.window or self.chunk)

    def is_local(self, i: int) -> bool:
        """Whether block i attends only within its window or chunk."""
        return self.local and not (self.global_every and (i + 1) % self.global_every == 0)

    def rotates(self, local: bool) -> bool:
        """Whether a local (or global) layer's queries and keys rotate: all but the NoPE layers."""
        return local or not self.global_nope


# tokens per chunk of the gated delta rule's chunked form (ops/delta_rule.py), as Qwen3.5 trains: 64 x 64 matrices
DELTA_CHUNK = 64


@dataclasses.dataclass(frozen=True)
class LinearAttentionConfig:
    """Gated DeltaNet blocks among full-attention ones (Qwen3-Next, Qwen3.5; ``jaxtron/models/delta_net.py``). With
    ``every`` > 0 the last of every ``every`` blocks attends fully and the others are Gated DeltaNet. Names follow
    config.json's ``linear_*`` keys."""

    every: int = 0  # full_attention_interval (0: no Gated DeltaNet blocks)
    key_heads: int = 16  # linear_num_key_heads: query and key heads
    value_heads: int = 32  # linear_num_value_heads: each key head serves value_heads / key_heads of them
    key_head_dim: int = 128
    value_head_dim: int = 128
    conv_kernel: int = 4  # the causal convolution's width over the queries, keys and values

    def __post_init__(self):
        _non_negative(self.every, "model.linear.every")
        if not self.every:
            return
        _check(self.every >= 2, "model.linear.every", f"({self.every}) leaves no Gated DeltaNet block",
               "use 2 or more (Qwen3.5: 4), or 0 for none")
        for name in ("key_heads", "value_heads", "key_head_dim", "value_head_dim", "conv_kernel"):
            _positive(getattr(self, name), f"model.linear.{name}")
        _check(self.value_heads % self.key_heads == 0, "model.linear.key_heads",
               f"({self.key_heads}) must divide model.linear.value_heads ({self.value_heads})",
               "choose a divisor of the value heads")

    @property
    def period(self) -> int:
        """Blocks in one repeat of the pattern (1 without Gated DeltaNet blocks)."""
        return self.every or 1

    def is_linear(self, i: int) -> bool:
        """Whether block i is a Gated DeltaNet block."""
        return bool(self.every) and (i + 1) % self.every != 0


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    """Mixture of experts (``jaxtron/models/moe.py``); ``num_experts`` = 0 is a dense model."""

    num_experts: int = 0  # routed experts per MoE block, each a SwiGLU of width expert_dim
    experts_per_token: int = 2  # top-k: experts each token is sent to
    expert_dim: int = 0  # each expert's intermediate width (0: model.mlp_dim, the dense blocks' width)
    shared_experts: int = 0  # experts every token visits (DeepSeek): one dense SwiGLU of shared_experts*expert_dim
    shared_gate: bool = False  # the shared experts' output scaled by sigmoid(x . w), w learned (Qwen3-Next, Qwen3.5)
    first_dense_layers: int = 0  # the first this many blocks are dense (DeepSeek's first_k_dense_replace)
    every: int = 1  # after those, every this many blocks the last one is MoE (1: all); the others are dense
    router: str = "softmax"  # softmax (Mixtral, Qwen3) | sigmoid (DeepSeek-V3: sigmoid scores, a balancing bias)
    router_renormalize: bool = True  # rescale the top-k router weights of a token to sum to 1 (Mixtral)
    router_groups: int = 1  # sigmoid: the experts form this many groups (n_group) ...
    router_top_groups: int = 1  # ... and a token's experts come from the best this many of them (topk_group)
    router_scale: float = 1.0  # the routed experts' weights are multiplied by this (routed_scaling_factor)
    router_logit_bias: bool = False  # a learned bias on the router's logits (gpt-oss)
    # sigmoid: the balancing bias on the scores that choose the experts (DeepSeek-V3's e_score_correction_bias); off:
    # the experts are chosen by score alone (Llama 4)
    balance_bias: bool = True
    # the router weight scales each expert's input, not its output (Llama 4); a SwiGLU is not linear in its input
    scale_input: bool = False
    expert_bias: bool = False  # biases on each expert's gate, up and down projections (gpt-oss)

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
        _check(not self.shared_gate or self.shared_experts, "model.moe.shared_gate",
               "gates the shared experts, and model.moe.shared_experts is 0", "set one of them")
        _non_negative(self.first_dense_layers, "model.moe.first_dense_layers")
        _check(not self.first_dense_layers or self.every == 1, "model.moe.first_dense_layers",
               f"({self.first_dense_layers}) needs model.moe.every=1 (dense blocks first, then only MoE ones), "
               f"not {self.every}", "set model.moe.every=1")
        _choice(self.router, "model.moe.router", ("softmax", "sigmoid"))
        _check(self.balance_bias or self.router == "sigmoid", "model.moe.balance_bias",
               "is off, and only the sigmoid router has the bias", "leave it on, or set model.moe.router='sigmoid'")
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
