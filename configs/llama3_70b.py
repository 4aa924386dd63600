"""Llama-3 70B (70.55B parameters): published dimensions, bf16, FSDP with 8-way tensor parallelism in a node."""

import ml_collections


def get_config():
    c = ml_collections.ConfigDict()
    c.model = dict(family="llama", name="llama3_70b",
                   vocab_size=128256, embed_dim=8192, num_layers=80, mlp_dim=28672, norm_eps=1e-5,
                   max_seq_len=8192, tie_embeddings=False, attention=dict(num_heads=64, num_kv_heads=8, head_dim=128),
                   rope=dict(theta=500_000.0))
    c.execution = dict(dtype="bfloat16", remat="auto")
    c.train = dict(steps=1000, global_batch_size=256, log_every=10, eval_batches=0)
    c.optimizer = dict(learning_rate=1.5e-4, warmup_steps=200, weight_decay=0.1)
    c.data = dict(source="synthetic", seq_len=8192)
    c.mesh = dict(data=1, fsdp=-1, tensor=8, sequence=1, expert=1)
    return c
