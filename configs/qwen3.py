"""Qwen3, dense and MoE, at its published sizes: ``--config=configs/qwen3.py:SIZE`` with SIZE one of ``SIZES``.

Every size has per-head query and key RMSNorm before RoPE and heads of 128 whatever the width; the MoE sizes
have 128 experts in every block, top-8 renormalised (``norm_topk_prob``), with their router loss coefficient.
"""

import ml_collections

# size: (embed_dim, num_layers, num_heads, num_kv_heads, mlp_dim (the experts' width for MoE), experts, tied)
SIZES = {
    "0.6b": (1024, 28, 16, 8, 3072, 0, True),
    "8b": (4096, 36, 32, 8, 12288, 0, False),
    "32b": (5120, 64, 64, 8, 25600, 0, False),
    "30b-a3b": (2048, 48, 32, 4, 768, 128, False),
    "235b-a22b": (4096, 94, 64, 4, 1536, 128, False),
}


def get_config(size: str = "8b"):
    if size not in SIZES:
        raise ValueError(f"unknown Qwen3 size {size!r}, not one of {', '.join(SIZES)}")
    embed, layers, heads, kv_heads, width, experts, tied = SIZES[size]
    c = ml_collections.ConfigDict()
    c.model = dict(family="qwen3_moe" if experts else "qwen3", name=f"qwen3_{size}",
                   vocab_size=151936, embed_dim=embed, num_layers=layers, mlp_dim=width,
                   norm_eps=1e-6, max_seq_len=40960, tie_embeddings=tied, rope=dict(theta=1_000_000.0),
                   attention=dict(num_heads=heads, num_kv_heads=kv_heads, head_dim=128, qk_norm=True))
    c.train = dict(steps=1000, global_batch_size=256, log_every=10, eval_batches=0)
    if experts:
        c.model.moe = dict(num_experts=experts, experts_per_token=8, every=1, router_renormalize=True)
        c.train.router_aux_loss = 0.001
    c.execution = dict(dtype="bfloat16", remat="auto")
    c.optimizer = dict(learning_rate=3e-4, warmup_steps=100, weight_decay=0.1)
    c.data = dict(source="synthetic", seq_len=4096)
    c.mesh = dict(data=1, fsdp=-1, tensor=1, sequence=1, expert=1)
    return c
