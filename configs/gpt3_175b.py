"""GPT-3 175B: 96 layers, hidden 12288, 96 heads, GELU MLP of 4h, LayerNorm, learned positions, s=2048.

Vocabulary 50257 padded to 50304; embeddings tied. Biases of the original are left out (0.1% of parameters).
"""

import ml_collections


def get_config():
    c = ml_collections.ConfigDict()
    c.model = dict(family="gpt3", name="gpt3_175b",
                   vocab_size=50304, embed_dim=12288, num_layers=96, mlp_dim=49152, activation="gelu",
                   norm="layernorm", position_embedding="learned", max_seq_len=2048, tie_embeddings=True,
                   attention=dict(num_heads=96, num_kv_heads=96, head_dim=128))
    c.execution = dict(dtype="bfloat16", remat="auto")
    c.train = dict(steps=1000, global_batch_size=1536, log_every=10, eval_batches=0)
    c.optimizer = dict(learning_rate=6e-5, warmup_steps=375, weight_decay=0.1)
    c.data = dict(source="synthetic", seq_len=2048)
    c.mesh = dict(data=1, fsdp=-1, tensor=8, sequence=1, expert=1)
    return c
