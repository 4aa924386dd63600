"""Parameter and FLOP counts of the decoder-only transformer described by ``ModelConfig``.

Accounting (DESIGN.md "Numbers are honest"): MODEL FLOPs are training FLOPs (forward + backward = 3x
forward, 2 FLOPs per multiply-add) of the matrix multiplies only, in the Megatron-LM form:

    attention per layer  6 * [h*(q + 2k) + q*s + q*h]     (q*s: QK^T and AV, causal half)
    MLP per layer        6 * h * f * e                    (e = 3 SwiGLU, 2 GELU)
    MoE per MoE layer    6 * h * f * 3 * k + 6 * h * E    (the k experts a token visits, and the router)
    logits               6 * h * V

Embedding lookups, norms, softmax and activations are not counted, nor is recompute. HARDWARE FLOPs
add the forward passes that the remat policy re-runs; MFU uses model FLOPs, HFU hardware FLOPs.
"""

from __future__ import annotations

from jaxtron.config import ModelConfig


def _mlp_matrices(cfg: ModelConfig) -> int:
    return 3 if cfg.activation == "swiglu" else 2


def param_count(cfg: ModelConfig, active: bool = False) -> int:
    """Exact number of parameters of the model (no biases except LayerNorm's). ``active``: only those one token
    uses, i.e. the k experts it is routed to (plus the router) in each MoE block."""
    h, f = cfg.embed_dim, cfg.mlp_dim
    q = cfg.num_heads * cfg.resolved_head_dim
    k = cfg.num_kv_heads * cfg.resolved_head_dim
    norm = h if cfg.norm == "rmsnorm" else 2 * h  # scale (+ bias for LayerNorm)
    attention = h * q + 2 * h * k + q * h  # wq, wk, wv, wo
    mlp = _mlp_matrices(cfg) * h * f
    experts = cfg.experts_per_token if active else cfg.num_experts
    moe = experts * mlp + h * cfg.num_experts  # experts and router
    moe_layers = cfg.num_moe_layers
    total = (cfg.num_layers - moe_layers) * (2 * norm + attention + mlp) + moe_layers * (2 * norm + attention + moe)
    total += cfg.vocab_size * h + norm  # token embedding, final norm
    if not cfg.tie_embeddings:
        total += cfg.vocab_size * h  # output head
    if cfg.position_embedding == "learned":
        total += cfg.max_seq_len * h
    return total


def flops_breakdown(cfg: ModelConfig, seq_len: int, causal: bool = True) -> dict[str, float]:
    """Model training FLOPs per token split into 'attention_proj', 'attention_scores', 'mlp' (dense blocks),
    'experts' (the k experts a token visits in each MoE block), 'router' and 'logits'.

    All but the logits are summed over all layers.
    """
    h, s, L = cfg.embed_dim, seq_len, cfg.num_layers
    q = cfg.num_heads * cfg.resolved_head_dim
    k = cfg.num_kv_heads * cfg.resolved_head_dim
    scores = q * s if causal else 2 * q * s  # QK^T + AV; causal attention touches half the keys
    moe = cfg.num_moe_layers
    mlp = 6.0 * h * cfg.mlp_dim * _mlp_matrices(cfg)  # one MLP or one expert
    return {
        "attention_proj": 6.0 * L * (h * (q + 2 * k) + q * h),
        "attention_scores": 6.0 * L * scores,
        "mlp": (L - moe) * mlp,
        "experts": moe * cfg.experts_per_token * mlp,
        "router": 6.0 * moe * h * cfg.num_experts,
        "logits": 6.0 * h * cfg.vocab_size,
    }


def flops_per_token(cfg: ModelConfig, seq_len: int, causal: bool = True) -> float:
    """Model FLOPs (forward + backward, no recompute) per trained token; the MFU numerator."""
    return sum(flops_breakdown(cfg, seq_len, causal).values())


def hardware_flops_per_token(cfg: ModelConfig, seq_len: int, causal: bool = True) -> float:
    """Model FLOPs plus the forward recompute implied by ``cfg.remat``; the HFU numerator.

    'full' re-runs every layer's forward once (+1/3 of the layer FLOPs; the logits are outside the
    scanned layers and not recomputed). 'save_dots' keeps the outputs of weight matmuls without batch
    dimensions and re-runs the rest: the attention-score matmuls (QK^T, AV) and the expert GEMMs (grouped
    or batched over experts); a forward is 1/3 of their training FLOPs.
    """
    terms = flops_breakdown(cfg, seq_len, causal)
    total = sum(terms.values())
    if cfg.remat == "full":
        total += (total - terms["logits"]) / 3.0
    elif cfg.remat == "save_dots":
        total += (terms["attention_scores"] + terms["experts"]) / 3.0
    return total


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
