"""A tiny Mixtral-style MoE (8 experts, top-2, every block) that learns Python's standard library source.

Same data as configs/default.py (prepared on first use). Trains on 2 CPU cores in a few minutes:
    python train.py --config=configs/mixtral_tiny.py --workdir=/tmp/mixtral_tiny
With several devices, --config.mesh.expert=N splits the experts N ways (N divides 8).
"""

import sys

import ml_collections


def get_config():
    c = ml_collections.ConfigDict()
    version = f"{sys.version_info.major}{sys.version_info.minor}"
    c.model = dict(family="mixtral", name="mixtral_tiny",
                   vocab_size=256, embed_dim=128, num_layers=4, mlp_dim=256, max_seq_len=1024,
                   tie_embeddings=True, attention=dict(num_heads=4, num_kv_heads=2), rope=dict(theta=10_000.0),
                   moe=dict(num_experts=8, experts_per_token=2))
    c.execution = dict(dtype="float32", moe_mode="dropless")
    c.train = dict(steps=300, seed=0, global_batch_size=16, log_every=20, eval_every=100, eval_batches=8,
                   router_aux_loss=0.01, router_z_loss=0.001)
    c.optimizer = dict(learning_rate=3e-3, warmup_steps=30, weight_decay=0.1, min_lr_ratio=0.1)
    c.data = dict(source="store", prepare="stdlib", path=f"~/.cache/jaxtron/stdlib-py{version}-byte", seq_len=128,
                  validation_fraction=0.05)
    c.mesh = dict(data=1, fsdp=-1, tensor=1, sequence=1, expert=1)
    return c
