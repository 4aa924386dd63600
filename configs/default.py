"""The main job: a tiny Llama-style byte-level model that learns Python's standard library source.

The first run tokenizes the library's .py files into a token store under ~/.cache/jaxtron (a few
seconds); later runs reuse it. Runs on 2 CPU cores in a few minutes: python train.py
"""

import sys

import ml_collections


def get_config():
    c = ml_collections.ConfigDict()
    version = f"{sys.version_info.major}{sys.version_info.minor}"
    c.model = dict(family="llama", name="tiny",
                   vocab_size=256, embed_dim=192, num_layers=4, mlp_dim=512, max_seq_len=1024,
                   tie_embeddings=True, attention=dict(num_heads=6, num_kv_heads=2), rope=dict(theta=10_000.0))
    c.execution = dict(dtype="float32")
    c.train = dict(steps=300, seed=0, global_batch_size=16, log_every=20, eval_every=100, eval_batches=8)
    c.optimizer = dict(learning_rate=3e-3, warmup_steps=30, weight_decay=0.1, min_lr_ratio=0.1)
    c.data = dict(source="store", prepare="stdlib", path=f"~/.cache/jaxtron/stdlib-py{version}-byte", seq_len=128,
                  validation_fraction=0.05)
    c.mesh = dict(data=1, fsdp=-1, tensor=1, sequence=1, expert=1)
    return c
