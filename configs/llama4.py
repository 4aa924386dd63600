"""Llama 4, text, at its published sizes: ``--config=configs/llama4.py:SIZE`` with SIZE ``scout`` (17B-16E) or
``maverick`` (17B-128E), and ``:tiny``, a byte-level model that learns Python's standard library on a CPU.

Three layers of chunked attention with RoPE to every global one without RoPE, whose queries grow with the log of
the position. Top-1 experts of a sigmoid router scale their input, beside a shared expert: in every block (Scout) or
every second one, dense blocks between (Maverick). Scout also normalises the rotated queries and keys and stretches
RoPE by Llama-3.1's bands. The dimensions are the published config.json's ``text_config`` (docs/references.md).
"""

import sys

import ml_collections

# size: (experts, MoE every, query and key norms, RoPE stretch, context)
SIZES = {
    "scout": (16, 1, True, 16.0, 10485760),
    "maverick": (128, 2, False, 1.0, 1048576),
}


def _model(name: str, experts: int, every: int, qk_norm: bool, stretch: float, context: int, **dims) -> dict:
    rope = dict(theta=500_000.0)
    if stretch != 1.0:
        rope.update(scaling="llama3", factor=stretch, low_freq_factor=1.0, high_freq_factor=1.0,
                    original_max_len=8192)
    model = dict(family="llama4", name=name, vocab_size=202048, embed_dim=5120, num_layers=48, mlp_dim=16384,
                 norm_eps=1e-5, max_seq_len=context, tie_embeddings=False, rope=rope,
                 attention=dict(num_heads=40, num_kv_heads=8, head_dim=128, chunk=8192, global_every=4,
                                global_nope=True, temperature_floor=8192, temperature_scale=0.1, qk_l2_norm=qk_norm),
                 moe=dict(num_experts=experts, experts_per_token=1, expert_dim=8192, shared_experts=1, every=every,
                          router="sigmoid", router_renormalize=False, balance_bias=False, scale_input=True))
    for key, value in dims.items():  # the tiny size's own widths
        if isinstance(value, dict):
            model[key].update(value)
        else:
            model[key] = value
    return model


def _tiny():
    """Eight byte-level blocks (two periods of three chunked blocks and a global one) with chunks of 32 of the 128
    tokens a row holds, the temperature changing every 16 positions, 8 experts top-1 and a shared one in every
    second block: every mechanism of the family at CPU scale."""
    c = ml_collections.ConfigDict()
    version = f"{sys.version_info.major}{sys.version_info.minor}"
    c.model = _model("llama4_tiny", 8, 2, True, 1.0, 1024, vocab_size=256, embed_dim=128, num_layers=8, mlp_dim=384,
                     attention=dict(num_heads=4, num_kv_heads=2, head_dim=32, chunk=32, temperature_floor=16),
                     moe=dict(expert_dim=96))
    c.execution = dict(dtype="float32")
    c.train = dict(steps=300, seed=0, global_batch_size=16, log_every=20, eval_every=100, eval_batches=8,
                   router_aux_loss=0.001)
    c.optimizer = dict(learning_rate=3e-3, warmup_steps=30, weight_decay=0.1, min_lr_ratio=0.1)
    c.data = dict(source="store", prepare="stdlib", path=f"~/.cache/jaxtron/stdlib-py{version}-byte", seq_len=128,
                  validation_fraction=0.05)
    c.mesh = dict(data=1, fsdp=-1, tensor=1, sequence=1, expert=1)
    return c


def get_config(size: str = "scout"):
    if size == "tiny":
        return _tiny()
    if size not in SIZES:
        raise ValueError(f"unknown Llama 4 size {size!r}, not one of tiny, {', '.join(SIZES)}")
    c = ml_collections.ConfigDict()
    c.model = _model(f"llama4_{size}", *SIZES[size])
    c.train = dict(steps=1000, global_batch_size=256, log_every=10, eval_batches=0, router_aux_loss=0.001)
    c.execution = dict(dtype="bfloat16", remat="auto")
    c.optimizer = dict(learning_rate=3e-4, warmup_steps=100, weight_decay=0.1)
    c.data = dict(source="synthetic", seq_len=8192)
    c.mesh = dict(data=1, fsdp=-1, tensor=1, sequence=1, expert=1)
    return c
