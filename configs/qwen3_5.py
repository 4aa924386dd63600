"""Qwen3.5, text, dense and MoE, at its published sizes: ``--config=configs/qwen3_5.py:SIZE`` with SIZE one of
``SIZES``, and ``:tiny`` and ``:tiny_moe``, byte-level models that learn Python's standard library on a CPU.

Three Gated DeltaNet blocks to every full-attention one. The attention has an output gate, per-head query and
key norms, heads of 256 and RoPE on a quarter of each head (base 10M). The DeltaNet blocks have 16 key heads of
128 and value heads of 128. Norms scale by 1 + weight. The MoE sizes put 8 (397B: 10) of 256 or 512 experts and
one shared expert, gated by a sigmoid, in every block. The sizes' dimensions are the published config.json's
``text_config`` (Qwen/Qwen3.5-*; docs/references.md). The published multi-token prediction layer is not modelled.
"""

import sys

import ml_collections

# size: (width, layers, heads, kv heads, linear value heads, MLP width (dense) or expert width (MoE), experts,
# routed experts a token, tied embeddings)
SIZES = {
    "0.8b": (1024, 24, 8, 2, 16, 3584, 0, 0, True),
    "2b": (2048, 24, 8, 2, 16, 6144, 0, 0, True),
    "4b": (2560, 32, 16, 4, 32, 9216, 0, 0, True),
    "9b": (4096, 32, 16, 4, 32, 12288, 0, 0, False),
    "27b": (5120, 64, 24, 4, 48, 17408, 0, 0, False),
    "35b-a3b": (2048, 40, 16, 2, 32, 512, 256, 8, False),
    "122b-a10b": (3072, 48, 32, 2, 64, 1024, 256, 8, False),
    "397b-a17b": (4096, 60, 32, 2, 64, 1024, 512, 10, False),
}
QWEN3_5 = dict(norm_unit_offset=True, norm_eps=1e-6)


def _model(name: str, width: int, layers: int, heads: int, kv_heads: int, value_heads: int, mlp: int,
           experts: int, top_k: int, tied: bool, vocab: int, head: int, linear_head: int, key_heads: int) -> dict:
    model = dict(QWEN3_5, family="qwen3_5_moe" if experts else "qwen3_5", name=name, vocab_size=vocab,
                 embed_dim=width, num_layers=layers, mlp_dim=mlp, tie_embeddings=tied,
                 rope=dict(theta=10_000_000.0, fraction=0.25),
                 attention=dict(num_heads=heads, num_kv_heads=kv_heads, head_dim=head, qk_norm=True, output_gate=True),
                 linear=dict(every=4, key_heads=key_heads, value_heads=value_heads, key_head_dim=linear_head,
                             value_head_dim=linear_head, conv_kernel=4))
    if experts:
        model["moe"] = dict(num_experts=experts, experts_per_token=top_k, expert_dim=mlp, shared_experts=1,
                            shared_gate=True, router_renormalize=True)
    return model


def _tiny(moe: bool):
    """Eight byte-level blocks (two periods of three Gated DeltaNet blocks and an attention one) on rows of 128
    tokens, two chunks of the rule: every mechanism of the family at CPU scale."""
    c = ml_collections.ConfigDict()
    version = f"{sys.version_info.major}{sys.version_info.minor}"
    c.model = _model("qwen3_5_tiny_moe" if moe else "qwen3_5_tiny", 128, 8, 4, 2, 4, 96 if moe else 384,
                     8 if moe else 0, 2, False, 256, 32, 32, 2)
    c.model.max_seq_len = 1024
    c.execution = dict(dtype="float32")
    c.train = dict(steps=300, seed=0, global_batch_size=16, log_every=20, eval_every=100, eval_batches=8)
    if moe:
        c.train.router_aux_loss = 0.001
    c.optimizer = dict(learning_rate=3e-3, warmup_steps=30, weight_decay=0.1, min_lr_ratio=0.1)
    c.data = dict(source="store", prepare="stdlib", path=f"~/.cache/jaxtron/stdlib-py{version}-byte", seq_len=128,
                  validation_fraction=0.05)
    c.mesh = dict(data=1, fsdp=-1, tensor=1, sequence=1, expert=1)
    return c


def get_config(size: str = "9b"):
    if size in ("tiny", "tiny_moe"):
        return _tiny(size == "tiny_moe")
    if size not in SIZES:
        raise ValueError(f"unknown Qwen3.5 size {size!r}, not one of tiny, tiny_moe, {', '.join(SIZES)}")
    c = ml_collections.ConfigDict()
    c.model = _model(f"qwen3_5_{size}", *SIZES[size], vocab=248320, head=256, linear_head=128, key_heads=16)
    c.model.max_seq_len = 262144
    c.train = dict(steps=1000, global_batch_size=256, log_every=10, eval_batches=0)
    if SIZES[size][6]:
        c.train.router_aux_loss = 0.001
    c.execution = dict(dtype="bfloat16", remat="auto")
    c.optimizer = dict(learning_rate=3e-4, warmup_steps=100, weight_decay=0.1)
    c.data = dict(source="synthetic", seq_len=8192)
    c.mesh = dict(data=1, fsdp=-1, tensor=1, sequence=1, expert=1)
    return c
