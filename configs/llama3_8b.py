"""Llama-3 8B (8.03B parameters): published dimensions, bf16 compute, FSDP over all devices.

Data comes from the synthetic source until a tokenized store is given (data.source/data.path).
"""

import ml_collections


def get_config():
    c = ml_collections.ConfigDict()
    c.model = dict(family="llama", name="llama3_8b",
                   vocab_size=128256, embed_dim=4096, num_layers=32, mlp_dim=14336, norm_eps=1e-5,
                   max_seq_len=8192, tie_embeddings=False, attention=dict(num_heads=32, num_kv_heads=8, head_dim=128),
                   rope=dict(theta=500_000.0))
    c.execution = dict(dtype="bfloat16", remat="auto")
    c.train = dict(steps=1000, global_batch_size=64, log_every=10, eval_batches=0)
    c.optimizer = dict(learning_rate=3e-4, warmup_steps=100, weight_decay=0.1)
    c.data = dict(source="synthetic", seq_len=8192)
    c.mesh = dict(data=1, fsdp=-1, tensor=1, sequence=1, expert=1)
    return c
