"""Parameter and FLOP counts of the decoder-only transformer described by ``ModelConfig``.

Accounting (docs/layout.md, "Numbers are honest"): MODEL FLOPs are training FLOPs (forward + backward = 3x
forward, 2 FLOPs per multiply-add) of the matrix multiplies only, in the Megatron-LM form:

    attention per layer  6 * [h*(q + 2k) + q*s + q*h]     (q*s: QK^T and AV, causal half)
    MLP per layer        6 * h * f * e                    (e = 3 SwiGLU, 2 GELU)
    MoE per MoE layer    6 * h * f' * 3 * (k + S) + 6 * h * E
                         (f' the experts' width: the k routed experts a token visits and the S shared ones,
                         and the router)
    logits               6 * h * V

Multi-head latent attention (DeepSeek-V3) has its own projections and score sizes, with n heads, query and key
heads of c = head_dim + qk_rope_head_dim, values of v, ranks r_q (query) and r (key-value), rotary part p:

    projections          6 * [h*r_q + r_q*n*c  (or h*n*c without r_q)  +  h*(r + p) + r*n*(head_dim + v)  +  n*v*h]
    scores               6 * [n*c*s + n*v*s] / 2      (QK^T over c, AV over v; causal half)

so with the scores and the logits left out, the model FLOPs per token are 6 x the matrix parameters a token
uses (``param_count(active=True)`` less the embedding table, norms and the balancing bias).

A Gated DeltaNet block (``model.linear``) has projections in place of attention's and the gated delta rule in
place of the scores. With key heads of d_k, value heads of d_v (n_v of them) and chunks of C tokens, the rule's
chunked form multiplies per token and value head (``delta_rule_macs``)

    C*(2*d_k + d_v)  +  C*(d_k + d_v) + C^2/3  +  3*d_k*d_v
    (K K^T, Q K^T and the scores times the deltas within a chunk; the chunk system's inverse by doubling and its
    product with the values and keys; the state's three products)

Each multi-token prediction depth (``mtp_depth``) adds 6 * [2h*h + one block (MoE in an MoE model) + h*V].
A family with parameters or matmuls outside this form adds them (``Family.extra_params`` and ``extra_flops``).

Embedding lookups, norms, softmax and activations are not counted, nor is recompute. The attention term
counts the full causal row of ``seq_len`` keys for every token, also when a row packs several documents: the
segment mask hides keys across documents but does not shrink the count. A local layer counts only the band its
window computes (``attended_keys``): the kernels skip the rest (cuDNN's sliding window, the blockwise kernel's
skipped blocks). HARDWARE FLOPs add the forward
matmuls that the remat policy re-runs (``RECOMPUTED``); MFU uses model FLOPs, HFU hardware FLOPs.
"""

from __future__ import annotations

from jaxtron import families
from jaxtron.config.model import GATED
from jaxtron.config.schema import ExecutionConfig, ModelConfig, replace
from jaxtron.config.subsections import DELTA_CHUNK

# The matmuls of one training step, finer than the Megatron terms so that a remat policy can be described
# exactly. Each belongs to one term of ``flops_breakdown``.
MATMULS = {
    "attention_qkv": "attention_proj", "attention_out": "attention_proj",
    "scores_qk": "attention_scores", "scores_av": "attention_scores",
    "mlp_in": "mlp", "mlp_out": "mlp",  # (gate and) up projection; down projection
    "shared_in": "mlp", "shared_out": "mlp",  # the shared experts of MoE blocks: a dense SwiGLU
    # the routed experts' gate and up projections; their down projection
    "experts_in": "experts", "experts_out": "experts", "router": "router", "logits": "logits",
    "mtp": "mtp",  # the multi-token prediction modules: projection, block and logits of each depth
    "delta_rule": "attention_scores",  # Gated DeltaNet's chunked rule: its token mixing, as the scores are
}
TERMS = ("attention_proj", "attention_scores", "mlp", "experts", "router", "logits", "mtp")
_BLOCK = ("attention_qkv", "attention_out", "scores_qk", "scores_av", "delta_rule", "mlp_in", "shared_in", "experts_in",
          "router")

# The matmuls whose forward a remat policy runs a second time in the backward pass, per attention
# implementation. jax.checkpoint re-runs only what the backward pass needs and the policy did not save
# (jaxtron/models/stack.py, remat_policy), so:
# - the MLP's down projection is never re-run: only its input (and weight) is needed for its gradients,
#   and its output only feeds the residual sum. Nor is the experts' (models/experts.py weights their hidden
#   values ahead of it, so the router's gradient needs no expert output);
# - the logits are outside the rematerialised blocks;
# - 'save_dots' keeps the outputs of dots without batch dimensions: every projection and the router.
#   The score products (batched over heads) and the expert GEMMs (ragged_dot, or batched over experts in
#   capacity mode) are re-run; a cuDNN attention kernel is not a dot and is re-run too;
# - 'save_attention' keeps the attention output (and the cuDNN kernel's softmax statistics): the cuDNN
#   forward kernel is not re-run, but XLA attention's backward needs the probabilities, so QK^T is re-run
#   (AV is not: only its output was needed). The output projection is re-run for the MLP's input.
# The flash kernel's own recompute inside its backward pass is part of the kernel and not counted.
RECOMPUTED: dict[str, dict[str, tuple[str, ...]]] = {
    "none": {"xla": (), "cudnn": ()},
    "full": {"xla": _BLOCK, "cudnn": _BLOCK},
    "save_dots": {"xla": ("scores_qk", "scores_av", "delta_rule", "experts_in"),
                  "cudnn": ("scores_qk", "scores_av", "delta_rule", "experts_in")},
    "save_attention": {"xla": ("attention_qkv", "attention_out", "scores_qk", "mlp_in", "shared_in", "experts_in",
                               "router"),
                       "cudnn": ("attention_qkv", "attention_out", "mlp_in", "shared_in", "experts_in", "router")},
    "save_dots_attention": {"xla": ("scores_qk", "experts_in"), "cudnn": ("experts_in",)},
}


def _mlp_matrices(cfg: ModelConfig) -> int:
    return 3 if cfg.activation in GATED else 2


def linear_layers(cfg: ModelConfig) -> int:
    """Gated DeltaNet blocks of the model."""
    return sum(cfg.linear.is_linear(i) for i in range(cfg.num_layers))


def _delta_net_sizes(cfg: ModelConfig) -> tuple[int, int]:
    """(projection parameters before the rule: queries, keys, values, the output gate, beta and the decay step;
    after it: the output projection) of one Gated DeltaNet block."""
    lin, h = cfg.linear, cfg.embed_dim
    keys, values = lin.key_heads * lin.key_head_dim, lin.value_heads * lin.value_head_dim
    return h * (2 * keys + 2 * values + 2 * lin.value_heads), values * h


def delta_net_params(cfg: ModelConfig) -> int:
    """Parameters of one Gated DeltaNet block's token mixer: projections, the convolution, A_log, dt_bias and the
    output norm."""
    lin = cfg.linear
    before, after = _delta_net_sizes(cfg)
    conv = lin.conv_kernel * (2 * lin.key_heads * lin.key_head_dim + lin.value_heads * lin.value_head_dim)
    return before + after + conv + 2 * lin.value_heads + lin.value_head_dim


def delta_rule_macs(cfg: ModelConfig) -> float:
    """Multiply-adds per token of one block's chunked delta rule, over its value heads (module docstring)."""
    lin, c = cfg.linear, DELTA_CHUNK
    dk, dv = lin.key_head_dim, lin.value_head_dim
    return lin.value_heads * (c * (2 * dk + dv) + c * (dk + dv) + c * c / 3 + 3 * dk * dv)


def attention_params(cfg: ModelConfig) -> int:
    """Parameters of one block's attention: projections, and the norms inside it (Qwen3's per-head query and
    key norms; latent attention's norms of its low-rank query and of its key-value latent)."""
    before, after, q, _ = _attention_sizes(cfg)
    if cfg.latent_attention:
        return before + after + cfg.attention.q_lora_rank + cfg.attention.kv_lora_rank
    a = cfg.attention
    biases = q + 2 * a.num_kv_heads * cfg.resolved_head_dim + cfg.embed_dim if a.bias else 0
    return before + after + (2 * cfg.resolved_head_dim if a.qk_norm else 0) + biases + (a.num_heads if a.sinks else 0)


def param_count(cfg: ModelConfig, active: bool = False) -> int:
    """Exact number of parameters of the model (the biases it has, LayerNorm's, the sigmoid router's balancing
    bias and attention sinks count). ``active``: only those one token uses, i.e. the k routed experts it is sent to
    (plus the router and the shared experts) in each MoE block."""
    h = cfg.embed_dim
    norm = h if cfg.norm == "rmsnorm" else 2 * h  # scale (+ bias for LayerNorm)
    norms = (4 if cfg.post_norms else 2) * norm  # a block's
    attention = attention_params(cfg)
    mlp = _mlp_matrices(cfg) * h * cfg.mlp_dim
    f = cfg.resolved_expert_dim
    expert = 3 * h * f + ((2 * f + h) if cfg.moe.expert_bias else 0)
    experts = cfg.moe.experts_per_token if active else cfg.moe.num_experts
    balance = cfg.moe.router == "sigmoid" and cfg.moe.balance_bias
    router = h * cfg.moe.num_experts + (cfg.moe.num_experts if balance else 0) + \
        (cfg.moe.num_experts if cfg.moe.router_logit_bias else 0)
    moe = experts * expert + cfg.moe.shared_experts * 3 * h * f + router + (h if cfg.moe.shared_gate else 0)
    moe_layers, linear = cfg.num_moe_layers, linear_layers(cfg)
    total = cfg.num_layers * norms + (cfg.num_layers - linear) * attention + linear * delta_net_params(cfg)
    total += (cfg.num_layers - moe_layers) * mlp + moe_layers * moe
    # each MTP depth: two input norms, the projection, a block, a final norm (embedding and head are shared)
    total += cfg.mtp.depth * (3 * norm + 2 * h * h + norms + attention + (moe if cfg.moe.num_experts else mlp))
    total += cfg.vocab_size * h + norm  # token embedding, final norm
    if not cfg.tie_embeddings:
        total += cfg.vocab_size * h  # output head
    if cfg.position_embedding == "learned":
        total += cfg.max_seq_len * h
    return total + families.get(cfg.family).extra_params(cfg, active)  # what the family has beyond the general form


def _attention_sizes(cfg: ModelConfig) -> tuple[int, int, int, int]:
    """(projection parameters before the scores, after them, query-key width, value width) of one block's
    attention, the widths summed over heads."""
    h, n = cfg.embed_dim, cfg.attention.num_heads
    if cfg.latent_attention:
        a = cfg.attention
        qk, rank, v = cfg.qk_head_dim, a.kv_lora_rank, cfg.resolved_v_head_dim
        query = h * a.q_lora_rank + a.q_lora_rank * n * qk if a.q_lora_rank else h * n * qk
        return query + h * (rank + a.qk_rope_head_dim) + rank * n * (cfg.resolved_head_dim + v), n * v * h, \
            n * qk, n * v
    q = n * cfg.resolved_head_dim
    k = cfg.attention.num_kv_heads * cfg.resolved_head_dim
    gate = h * q if cfg.attention.output_gate else 0
    return h * (q + 2 * k) + gate, q * h, q, q


def matmul_breakdown(cfg: ModelConfig, seq_len: int, causal: bool = True) -> dict[str, float]:
    """Model training FLOPs per token of each kind of matmul in ``MATMULS``, summed over all layers."""
    h, s, L = cfg.embed_dim, seq_len, cfg.num_layers
    qkv, out, qk, v = _attention_sizes(cfg)
    keys = attended_keys(cfg, s, causal)  # summed over the layers
    dense, moe, linear = L - cfg.num_moe_layers, cfg.num_moe_layers, linear_layers(cfg)
    shared = cfg.moe.shared_experts * cfg.resolved_expert_dim
    linear_in, linear_out = _delta_net_sizes(cfg) if linear else (0, 0)
    out = {
        "attention_qkv": 6.0 * ((L - linear) * qkv + linear * linear_in),
        "attention_out": 6.0 * ((L - linear) * out + linear * linear_out),
        "delta_rule": 6.0 * linear * delta_rule_macs(cfg) if linear else 0.0,
        "scores_qk": 6.0 * qk * keys,
        "scores_av": 6.0 * v * keys,
        "mlp_in": 6.0 * dense * h * cfg.mlp_dim * (_mlp_matrices(cfg) - 1),
        "mlp_out": 6.0 * dense * h * cfg.mlp_dim,
        "shared_in": 6.0 * moe * h * shared * 2,
        "shared_out": 6.0 * moe * h * shared,
        "experts_in": 6.0 * moe * cfg.moe.experts_per_token * h * cfg.resolved_expert_dim * 2,
        "experts_out": 6.0 * moe * cfg.moe.experts_per_token * h * cfg.resolved_expert_dim,
        "router": 6.0 * moe * h * cfg.moe.num_experts,
        "logits": 6.0 * h * cfg.vocab_size,
        "mtp": 0.0,
    }
    if cfg.mtp.depth:  # one more block per depth, of the kind the MoE blocks are (or the dense ones)
        one = matmul_breakdown(replace(cfg, num_layers=1, moe=dict(first_dense_layers=0), mtp=dict(depth=0)),
                               seq_len, causal)
        out["mtp"] = cfg.mtp.depth * (sum(one.values()) + 6.0 * 2 * h * h)
    for name, value in families.get(cfg.family).extra_flops(cfg, seq_len).items():  # the family's own matmuls
        out[name] += value
    return out


def attended_keys(cfg: ModelConfig, seq_len: int, causal: bool = True) -> float:
    """The keys a query attends to, averaged over a row of ``seq_len`` and summed over the layers: half the row in
    a causal global layer (the whole row without causality); in a local layer of window W < seq_len, W - W^2 / 2s
    (the band of W keys, its first W queries seeing fewer); in a local layer of chunks C < seq_len, half of each
    chunk (the whole chunk without causality), the row's last chunk as long as what is left. A window or chunk no
    shorter than the row is a global layer. Gated DeltaNet blocks attend to no keys."""
    s, window, chunk = seq_len, cfg.attention.window, cfg.attention.chunk
    full = s / 2 if causal else s
    span = window or chunk
    local = sum(cfg.is_local_block(i) for i in range(cfg.num_layers)) if 0 < span < s else 0
    if chunk:
        whole, left = divmod(s, chunk)
        per_local = (whole * chunk * chunk + left * left) / s / (2 if causal else 1)
    else:
        per_local = window - window * window / (2 * s)
    return (cfg.num_layers - linear_layers(cfg) - local) * full + local * per_local


def _terms(matmuls: dict[str, float]) -> dict[str, float]:
    out = dict.fromkeys(TERMS, 0.0)
    for name, value in matmuls.items():
        out[MATMULS[name]] += value
    return out


def flops_breakdown(cfg: ModelConfig, seq_len: int, causal: bool = True) -> dict[str, float]:
    """Model training FLOPs per token split into 'attention_proj', 'attention_scores', 'mlp' (dense blocks),
    'experts' (the k experts a token visits in each MoE block), 'router' and 'logits'.

    All but the logits are summed over all layers.
    """
    return _terms(matmul_breakdown(cfg, seq_len, causal))


def flops_per_token(cfg: ModelConfig, seq_len: int, causal: bool = True) -> float:
    """Model FLOPs (forward + backward, no recompute) per trained token; the MFU numerator."""
    return sum(matmul_breakdown(cfg, seq_len, causal).values())


def recomputed(remat: str, attention: str = "xla") -> tuple[str, ...]:
    """The ``MATMULS`` whose forward pass ``execution.remat`` re-runs, with attention implementation 'xla' or
    'cudnn' (see ``RECOMPUTED``)."""
    if attention not in ("xla", "cudnn", "blockwise"):
        raise ValueError(f"attention implementation {attention!r} is not 'xla', 'cudnn' or 'blockwise'")
    # blockwise attention is a flash kernel written in XLA: remat treats it as the cuDNN kernel (a custom
    # gradient whose scores are recomputed inside its own backward pass)
    return RECOMPUTED[remat]["cudnn" if attention == "blockwise" else attention]


def _hardware_matmuls(cfg: ModelConfig, execution: ExecutionConfig, seq_len: int, causal: bool,
                      attention: str) -> dict[str, float]:
    model = matmul_breakdown(cfg, seq_len, causal)
    again = recomputed(execution.remat, attention)
    return {name: value * (4.0 / 3.0 if name in again else 1.0) for name, value in model.items()}


def hardware_flops_breakdown(cfg: ModelConfig, execution: ExecutionConfig, seq_len: int, causal: bool = True,
                             attention: str = "xla") -> dict[str, float]:
    """``flops_breakdown`` plus, per term, the forward FLOPs that ``execution.remat`` re-runs (a third of the
    training FLOPs of each recomputed matmul)."""
    return _terms(_hardware_matmuls(cfg, execution, seq_len, causal, attention))


def hardware_flops_per_token(cfg: ModelConfig, execution: ExecutionConfig, seq_len: int, causal: bool = True,
                             attention: str = "xla") -> float:
    """Model FLOPs plus the forward recompute implied by ``execution.remat``; the HFU numerator."""
    return sum(_hardware_matmuls(cfg, execution, seq_len, causal, attention).values())


def fp8_blocks(cfg: ModelConfig, execution: ExecutionConfig) -> tuple[int, int]:
    """(blocks whose projections run as FP8 matmuls, how many of them are dense) under ``execution.fp8``.

    The blocks between the first and the last ``fp8_skip_layers`` use FP8 (jaxtron/models/stack.py,
    ``layer_spans``), their MoE blocks' shared and routed experts too (``fp8_flops_per_token`` says how much of
    the routed ones).
    """
    if not execution.fp8:
        return 0, 0
    blocks = range(execution.fp8_skip_layers, cfg.num_layers - execution.fp8_skip_layers)
    return len(blocks), sum(not cfg.is_moe_block(i) for i in blocks)


def fp8_flops_per_token(cfg: ModelConfig, execution: ExecutionConfig, seq_len: int, hardware: bool = False,
                        causal: bool = True, attention: str = "xla") -> float:
    """The part of the model FLOPs (``hardware``: of the hardware FLOPs) done as FP8 matmuls: the attention
    projections of the FP8 blocks, the MLP of their dense ones and the shared experts of their MoE ones, forward
    and backward (the gradient matmuls are FP8 too, see jaxtron/ops/fp8.py), and their recompute; and their routed
    experts: all of them in capacity mode (batched FP8 GEMMs), the forward and its recompute in dropless mode (on
    Hopper the backward's grouped GEMMs multiply the FP8 values on bf16 tensor cores, ``ops/grouped_fp8.py``).
    Scores, router and logits stay 16-bit."""
    blocks, dense = fp8_blocks(cfg, execution)
    if not blocks:
        return 0.0
    model = matmul_breakdown(cfg, seq_len, causal)
    m = _hardware_matmuls(cfg, execution, seq_len, causal, attention) if hardware else model
    per_block = (m["attention_qkv"] + m["attention_out"]) / cfg.num_layers
    dense_layers, moe_layers = cfg.num_layers - cfg.num_moe_layers, cfg.num_moe_layers
    per_dense = (m["mlp_in"] + m["mlp_out"]) / dense_layers if dense_layers else 0.0
    per_moe = (m["shared_in"] + m["shared_out"]) / moe_layers if moe_layers else 0.0
    if moe_layers:
        routed = model["experts_in"] + model["experts_out"]
        experts, recompute = routed / moe_layers, (m["experts_in"] + m["experts_out"] - routed) / moe_layers
        per_moe += experts + recompute if execution.moe_mode == "capacity" else experts / 3 + recompute
    return blocks * per_block + dense * per_dense + (blocks - dense) * per_moe


def fp8_flop_share(cfg: ModelConfig, execution: ExecutionConfig, seq_len: int) -> float:
    """The share of the model FLOPs done as FP8 matmuls (``fp8_flops_per_token`` over ``flops_per_token``)."""
    return fp8_flops_per_token(cfg, execution, seq_len) / flops_per_token(cfg, seq_len)


def narayanan_flops_per_batch(batch: int, seq_len: int, layers: int, hidden: int, vocab: int,
                              recompute: bool) -> float:
    """FLOPs per iteration of Narayanan et al. 2021 (SC21), GPT with f = 4h, MHA, non-causal."""
    B, s, l, h, V = batch, seq_len, layers, hidden, vocab
    if recompute:
        return 96.0 * B * s * l * h**2 * (1 + s / (6 * h) + V / (16 * l * h))
    return 72.0 * B * s * l * h**2 * (1 + s / (6 * h) + V / (12 * l * h))


def narayanan_param_count(layers: int, hidden: int, vocab: int, seq_len: int) -> float:
    """Parameter count closed form of Narayanan et al. 2021 (biases, tied embedding, learned positions)."""
    l, h = layers, hidden
    return 12.0 * l * h**2 * (1 + 13 / (12 * h) + (vocab + seq_len) / (12 * l * h))
