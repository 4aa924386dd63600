"""Llama-3.2 1B (1.24B parameters, tied embeddings): published dimensions with Llama-3.1 RoPE scaling (32x)."""

import ml_collections


def get_config():
    c = ml_collections.ConfigDict()
    c.model = dict(family="llama", name="llama3_1b",
                   vocab_size=128256, embed_dim=2048, num_layers=16, mlp_dim=8192, norm_eps=1e-5,
                   max_seq_len=131072, tie_embeddings=True, attention=dict(num_heads=32, num_kv_heads=8, head_dim=64),
                   rope=dict(theta=500_000.0, factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                             original_max_len=8192))
    c.execution = dict(dtype="bfloat16", remat="auto")
    c.train = dict(steps=1000, global_batch_size=256, log_every=10, eval_batches=0)
    c.optimizer = dict(learning_rate=3e-4, warmup_steps=100, weight_decay=0.1)
    c.data = dict(source="synthetic", seq_len=8192)
    c.mesh = dict(data=1, fsdp=-1, tensor=1, sequence=1, expert=1)
    return c
