"""gpt-oss at its published sizes: ``--config=configs/gpt_oss.py:SIZE`` with SIZE ``20b`` or ``120b``, and
``:tiny``, a byte-level model that learns Python's standard library on a CPU.

Blocks alternate a 128-token sliding window and global attention, each head with a learned sink, biases on q, k,
v and o, YaRN RoPE (32 times 4k, the ramp unrounded); every block has experts (32 or 128, top-4, softmax over the
chosen) with a router bias, expert biases and the clamped SwiGLU. The dimensions are the published config.json's
(openai/gpt-oss-*; docs/references.md).
"""

import sys

import ml_collections

SIZES = {"20b": (24, 32), "120b": (36, 128)}  # size: (layers, experts)
GPT_OSS = dict(family="gpt_oss", activation="clamped_swiglu", swiglu_limit=7.0, norm_eps=1e-5, tie_embeddings=False)


def _tiny():
    """Four byte-level blocks alternating a window of 32 (of the 128 tokens a row holds) and global attention, 8
    experts top-2: every mechanism of the family at CPU scale."""
    c = ml_collections.ConfigDict()
    version = f"{sys.version_info.major}{sys.version_info.minor}"
    c.model = dict(GPT_OSS, name="gpt_oss_tiny", vocab_size=256, embed_dim=128, num_layers=4, mlp_dim=128,
                   max_seq_len=1024, tie_embeddings=True,
                   rope=dict(theta=10_000.0, scaling="yarn", factor=4.0, original_max_len=256, truncate=False),
                   attention=dict(num_heads=4, num_kv_heads=2, head_dim=32, window=32, global_every=2, sinks=True,
                                  bias=True),
                   moe=dict(num_experts=8, experts_per_token=2, router_logit_bias=True, expert_bias=True))
    c.execution = dict(dtype="float32", moe_mode="dropless")
    c.train = dict(steps=300, seed=0, global_batch_size=16, log_every=20, eval_every=100, eval_batches=8,
                   router_aux_loss=0.01)
    c.optimizer = dict(learning_rate=3e-3, warmup_steps=30, weight_decay=0.1, min_lr_ratio=0.1)
    c.data = dict(source="store", prepare="stdlib", path=f"~/.cache/jaxtron/stdlib-py{version}-byte", seq_len=128,
                  validation_fraction=0.05)
    c.mesh = dict(data=1, fsdp=-1, tensor=1, sequence=1, expert=1)
    return c


def get_config(size: str = "20b"):
    if size == "tiny":
        return _tiny()
    if size not in SIZES:
        raise ValueError(f"unknown gpt-oss size {size!r}, not one of tiny, {', '.join(SIZES)}")
    layers, experts = SIZES[size]
    c = ml_collections.ConfigDict()
    c.model = dict(GPT_OSS, name=f"gpt_oss_{size}", vocab_size=201088, embed_dim=2880, num_layers=layers,
                   mlp_dim=2880, max_seq_len=131072,
                   rope=dict(theta=150_000.0, scaling="yarn", factor=32.0, original_max_len=4096, beta_fast=32.0,
                             beta_slow=1.0, truncate=False),
                   attention=dict(num_heads=64, num_kv_heads=8, head_dim=64, window=128, global_every=2, sinks=True,
                                  bias=True),
                   moe=dict(num_experts=experts, experts_per_token=4, every=1, router_renormalize=True,
                            router_logit_bias=True, expert_bias=True))
    c.train = dict(steps=1000, global_batch_size=256, log_every=10, eval_batches=0, router_aux_loss=0.9)
    c.execution = dict(dtype="bfloat16", remat="auto")
    c.optimizer = dict(learning_rate=3e-4, warmup_steps=100, weight_decay=0.1)
    c.data = dict(source="synthetic", seq_len=8192)
    c.mesh = dict(data=1, fsdp=-1, tensor=1, sequence=1, expert=1)
    return c
