"""Mixtral 8x22B (140.6B parameters, 39B active): published dimensions, 8 SwiGLU experts, top-2 routing.

Experts are split over an expert axis of 8 (inside a node) and everything else over fsdp: use a
multiple of 8 GPUs (at least 64 H100/H200 of 80+ GB hold the float32 weights and AdamW state).
Data comes from the synthetic source until a tokenized store is given (data.source/data.path).
"""

import ml_collections


def get_config():
    c = ml_collections.ConfigDict()
    c.model = dict(family="mixtral", name="mixtral_8x22b",
                   vocab_size=32768, embed_dim=6144, num_layers=56, mlp_dim=16384, norm_eps=1e-5,
                   max_seq_len=65536, tie_embeddings=False, attention=dict(num_heads=48, num_kv_heads=8, head_dim=128),
                   rope=dict(theta=1_000_000.0), moe=dict(num_experts=8, experts_per_token=2, router_renormalize=True))
    # 4 token chunks: on the H100 target, with the experts split over 8 GPUs, the exchanges' kernels hide 55% of their
    # time at the network's bandwidth against 32% with one chunk, for a lower peak (benchmarks/moe_overlap.md)
    c.execution = dict(dtype="bfloat16", remat="auto", moe_mode="dropless", moe_chunks=4)
    c.train = dict(steps=1000, global_batch_size=256, log_every=10, eval_batches=0, router_aux_loss=0.001,
                   router_z_loss=0.001)
    c.optimizer = dict(learning_rate=1e-4, warmup_steps=100, weight_decay=0.1)
    c.data = dict(source="synthetic", seq_len=4096)
    c.mesh = dict(data=1, fsdp=-1, tensor=1, sequence=1, expert=8)
    return c
