"""Llama-3.1 405B (405.85B parameters): published dimensions with Llama-3.1 RoPE frequency scaling."""

import ml_collections


def get_config():
    c = ml_collections.ConfigDict()
    c.model = dict(family="llama", name="llama3_405b",
                   vocab_size=128256, embed_dim=16384, num_layers=126, mlp_dim=53248,
                   norm_eps=1e-5, max_seq_len=131072, tie_embeddings=False,
                   attention=dict(num_heads=128, num_kv_heads=8, head_dim=128),
                   rope=dict(theta=500_000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                             original_max_len=8192))
    c.execution = dict(dtype="bfloat16", remat="auto")
    c.train = dict(steps=1000, global_batch_size=1024, log_every=10, eval_batches=0)
    c.optimizer = dict(learning_rate=8e-5, warmup_steps=500, weight_decay=0.1)
    c.data = dict(source="synthetic", seq_len=8192)
    c.mesh = dict(data=1, fsdp=-1, tensor=8, sequence=1, expert=1)
    return c
