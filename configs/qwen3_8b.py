"""Qwen3-8B (8.19B parameters, 6.95B without embeddings): published dimensions; per-head query and key RMSNorm, head size 128 whatever the width."""

import ml_collections


def get_config():
    c = ml_collections.ConfigDict()
    c.model = dict(name="qwen3_8b", vocab_size=151936, embed_dim=4096, num_layers=36, num_heads=32, num_kv_heads=8,
                   head_dim=128, qk_norm=True, mlp_dim=12288, norm_eps=1e-6, rope_theta=1_000_000.0, max_seq_len=40960,
                   tie_embeddings=False)
    c.execution = dict(dtype="bfloat16", remat="full")
    c.train = dict(steps=1000, global_batch_size=256, log_every=10, eval_batches=0)
    c.optimizer = dict(learning_rate=3e-4, warmup_steps=100, weight_decay=0.1)
    c.data = dict(source="synthetic", seq_len=4096)
    c.mesh = dict(data=1, fsdp=-1, tensor=1, sequence=1, expert=1)
    return c
