"""A tiny DeepSeek-V3-style model that learns Python's standard library source: latent attention, one dense
block then three MoE blocks of 16 routed experts (4 groups, a token's top-2 from its best 2 groups) plus a shared
expert, the sigmoid router balanced by its bias (no balance loss).

Same data as configs/default.py (prepared on first use). Trains on 2 CPU cores in a few minutes:
    python train.py --config=configs/deepseek_tiny.py --workdir=/tmp/deepseek_tiny
"""

import sys

import ml_collections


def get_config():
    c = ml_collections.ConfigDict()
    version = f"{sys.version_info.major}{sys.version_info.minor}"
    c.model = dict(family="deepseek_v3", name="deepseek_tiny",
                   vocab_size=256, embed_dim=128, num_layers=4, mlp_dim=384, max_seq_len=1024,
                   tie_embeddings=True, rope=dict(theta=10_000.0),
                   attention=dict(num_heads=4, num_kv_heads=4, head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
                                  q_lora_rank=64, kv_lora_rank=32),
                   moe=dict(num_experts=16, experts_per_token=2, expert_dim=64, shared_experts=1, first_dense_layers=1,
                            router="sigmoid", router_groups=4, router_top_groups=2, router_scale=1.0,
                            router_renormalize=True))
    c.execution = dict(dtype="float32", moe_mode="dropless")
    c.train = dict(steps=300, seed=0, global_batch_size=16, log_every=20, eval_every=100, eval_batches=8,
                   router_aux_loss=0.0, router_z_loss=0.0, router_bias_rate=0.001)
    c.optimizer = dict(learning_rate=3e-3, warmup_steps=30, weight_decay=0.1, min_lr_ratio=0.1)
    c.data = dict(source="store", prepare="stdlib", path=f"~/.cache/jaxtron/stdlib-py{version}-byte", seq_len=128,
                  validation_fraction=0.05)
    c.mesh = dict(data=1, fsdp=-1, tensor=1, sequence=1, expert=1)
    return c
