"""Small configs shared by the tests."""

from __future__ import annotations

import dataclasses

from jaxtron.config.schema import (Config, DataConfig, ExecutionConfig, MeshConfig, ModelConfig, OptimizerConfig,
                                   TrainConfig)

MESHES = {
    "data8": dict(data=8, fsdp=1),
    "fsdp8": dict(data=1, fsdp=8),
    "data2_fsdp2_tensor2": dict(data=2, fsdp=2, tensor=2),
    "fsdp2_sequence2_tensor2": dict(data=1, fsdp=2, sequence=2, tensor=2),
    "fsdp4_expert2": dict(data=1, fsdp=4, expert=2),
}


def tiny_config(mesh: dict | None = None, **sections) -> Config:
    """A 2-layer GQA model on synthetic tokens, computing in float32; every dimension divides 8. ``sections``:
    fields to replace, per section (``model=dict(num_layers=3)``, ``execution=dict(remat="full")``)."""
    model = ModelConfig(name="test", vocab_size=256, embed_dim=64, num_layers=2, num_heads=4, num_kv_heads=2,
                        mlp_dim=128, max_seq_len=64, rope_theta=10_000.0)
    execution = ExecutionConfig(dtype="float32")
    train = TrainConfig(steps=3, seed=0, global_batch_size=8, log_every=1, eval_batches=0)
    optimizer = OptimizerConfig(learning_rate=1e-2, warmup_steps=1)
    data = DataConfig(source="synthetic", seq_len=32)
    cfg = Config(model=model, execution=execution, mesh=MeshConfig(**(mesh or dict(fsdp=1))), train=train,
                 optimizer=optimizer, data=data)
    return dataclasses.replace(cfg, **{k: dataclasses.replace(getattr(cfg, k), **v) for k, v in sections.items()})


def largest_float_array(hlo: str) -> int:
    """Elements of the largest floating-point array anywhere in an HLO module's text, fusion bodies included
    (byte buffers such as GEMM workspaces are not counted)."""
    import math
    import re

    shapes = re.findall(r"\b(?:bf16|f16|f32|f64|f8e\w+)\[([0-9,]*)\]", hlo)
    return max((math.prod(int(d) for d in s.split(",") if d) for s in shapes), default=0)
