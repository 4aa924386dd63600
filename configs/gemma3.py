"""Gemma 3, text, at its published sizes: ``--config=configs/gemma3.py:SIZE`` with SIZE one of ``SIZES``, and
``:tiny``, a byte-level model that learns Python's standard library on a CPU.

Five local layers (a sliding window, RoPE base 10k) to every global one (base 1M, stretched 8 times linearly from
4B up), per-head query and key norms, norms before and after attention and the MLP (scale 1 + weight), a GeGLU with
tanh GELU, embeddings scaled by sqrt(width), a tied head and the 262k vocabulary. The sizes' dimensions are the
published config.json's (google/gemma-3-*; docs/references.md).
"""

import sys

import ml_collections

# size: (width, layers, heads, kv heads, head size, MLP width, window, vocabulary, query_pre_attn_scalar, RoPE
# stretch of the global layers, context)
SIZES = {
    "1b": (1152, 26, 4, 1, 256, 6912, 512, 262144, 256, 1.0, 32768),
    "4b": (2560, 34, 8, 4, 256, 10240, 1024, 262208, 256, 8.0, 131072),
    "12b": (3840, 48, 16, 8, 256, 15360, 1024, 262208, 256, 8.0, 131072),
    "27b": (5376, 62, 32, 16, 128, 21504, 1024, 262208, 168, 8.0, 131072),
}
GEMMA3 = dict(family="gemma3", activation="geglu", norm_unit_offset=True, post_norms=True, embed_scale=True,
              norm_eps=1e-6, tie_embeddings=True)


def _tiny():
    """Seven byte-level blocks (a local lead block, then two periods of local, local, global) with a window of 32
    of the 128 tokens a row holds: every mechanism of the family at CPU scale."""
    c = ml_collections.ConfigDict()
    version = f"{sys.version_info.major}{sys.version_info.minor}"
    c.model = dict(GEMMA3, name="gemma3_tiny", vocab_size=256, embed_dim=128, num_layers=7, mlp_dim=384,
                   max_seq_len=1024, rope=dict(theta=100_000.0, local_theta=10_000.0, scaling="linear", factor=2.0),
                   attention=dict(num_heads=4, num_kv_heads=2, head_dim=32, qk_norm=True, window=32, global_every=3,
                                  query_pre_attn_scalar=32))
    c.execution = dict(dtype="float32")
    c.train = dict(steps=300, seed=0, global_batch_size=16, log_every=20, eval_every=100, eval_batches=8)
    c.optimizer = dict(learning_rate=3e-3, warmup_steps=30, weight_decay=0.1, min_lr_ratio=0.1)
    c.data = dict(source="store", prepare="stdlib", path=f"~/.cache/jaxtron/stdlib-py{version}-byte", seq_len=128,
                  validation_fraction=0.05)
    c.mesh = dict(data=1, fsdp=-1, tensor=1, sequence=1, expert=1)
    return c


def get_config(size: str = "4b"):
    if size == "tiny":
        return _tiny()
    if size not in SIZES:
        raise ValueError(f"unknown Gemma 3 size {size!r}, not one of tiny, {', '.join(SIZES)}")
    width, layers, heads, kv_heads, head, mlp, window, vocab, scalar, stretch, context = SIZES[size]
    rope = dict(theta=1_000_000.0, local_theta=10_000.0)
    if stretch != 1.0:
        rope.update(scaling="linear", factor=stretch)
    c = ml_collections.ConfigDict()
    c.model = dict(GEMMA3, name=f"gemma3_{size}", vocab_size=vocab, embed_dim=width, num_layers=layers,
                   mlp_dim=mlp, max_seq_len=context, rope=rope,
                   attention=dict(num_heads=heads, num_kv_heads=kv_heads, head_dim=head, qk_norm=True, window=window,
                                  global_every=6, query_pre_attn_scalar=float(scalar)))
    c.train = dict(steps=1000, global_batch_size=256, log_every=10, eval_batches=0)
    c.execution = dict(dtype="bfloat16", remat="auto")
    c.optimizer = dict(learning_rate=3e-4, warmup_steps=100, weight_decay=0.1)
    c.data = dict(source="synthetic", seq_len=8192)
    c.mesh = dict(data=1, fsdp=-1, tensor=1, sequence=1, expert=1)
    return c
