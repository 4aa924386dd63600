"""Qwen3-235B-A22B (235B parameters, 22B active; 234B without embeddings): published dimensions; 128 experts of width 1536 in every block, top-8 renormalised, per-head query and key
RMSNorm."""

import ml_collections


def get_config():
    c = ml_collections.ConfigDict()
    c.model = dict(name="qwen3_235b_a22b", vocab_size=151936, embed_dim=4096, num_layers=94, num_heads=64, num_kv_heads=4,
                   head_dim=128, qk_norm=True, mlp_dim=1536, num_experts=128, experts_per_token=8, moe_every=1,
                   router_renormalize=True, norm_eps=1e-6, rope_theta=1_000_000.0, max_seq_len=40960,
                   tie_embeddings=False)
    c.execution = dict(dtype="bfloat16", remat="full")
    c.train = dict(steps=1000, global_batch_size=256, log_every=10, eval_batches=0, router_aux_loss=0.001)
    c.optimizer = dict(learning_rate=3e-4, warmup_steps=100, weight_decay=0.1)
    c.data = dict(source="synthetic", seq_len=4096)
    c.mesh = dict(data=1, fsdp=-1, tensor=1, sequence=1, expert=1)
    return c
