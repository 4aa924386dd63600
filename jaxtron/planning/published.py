"""Published training runs the planner's time model is calibrated on and checked against.

KempnerForge's MFU scaling report (KempnerInstitute/KempnerForge, benchmarks/mfu_scaling/mfu_scaling_2026-04-05.md):
14 runs of Llama-3-shaped models on 1 to 32 H200s in nodes of 4 (NVLink inside a node, InfiniBand between), a
PyTorch FSDP2 stack with torch.compile, bf16, full activation checkpointing, sequence 4096. Each data-parallel
rank takes 4 rows per microbatch (70B: 2) over 2 microbatches (13B and 70B: 4); tokens/s is measured, the step
time and the token count per step agree with it. The models: "7B" is Llama-3 8B; "13B" is Llama-3 with width 5120,
40 layers, 40 query and 8 key-value heads and an MLP of 17920 (its 14.84B parameters); "70B" is Llama-3 70B.

A run is ``fit`` when the calibration fits the time model's constants on it (``benchmarks/plan_calibration.py``);
the others are the check: the planner's tokens/s for their own layouts, which it was not fitted on.
"""

from __future__ import annotations

import dataclasses
import os

from jaxtron.config.loader import load_config
from jaxtron.config.schema import MESH_AXES, Config

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
KEMPNERFORGE = "KempnerForge MFU scaling report, 2026-04-05"
_MODELS = {  # name -> (config, model overrides)
    "7B": ("llama3_8b", ()),
    "13B": ("llama3_8b", (("model.embed_dim", "5120"), ("model.num_layers", "40"),
                          ("model.attention.num_heads", "40"), ("model.attention.num_kv_heads", "8"),
                          ("model.mlp_dim", "17920"))),
    "70B": ("llama3_70b", ()),
}
_ROWS = {"7B": (4, 2), "13B": (4, 4), "70B": (2, 4)}  # (rows per data-parallel rank and microbatch, microbatches)


@dataclasses.dataclass(frozen=True)
class Run:
    number: int  # the report's row
    model: str  # '7B', '13B' or '70B'
    mesh: tuple[tuple[str, int], ...]  # the mesh axes beyond 1
    tokens_per_s: float  # measured
    fit: bool  # the calibration fits on it
    gpu: str = "h200"
    gpus_per_node: int = 4
    seq_len: int = 4096
    source: str = KEMPNERFORGE

    @property
    def gpus(self) -> int:
        out = 1
        for _, size in self.mesh:
            out *= size
        return out

    @property
    def sizes(self) -> dict[str, int]:
        return {axis: dict(self.mesh).get(axis, 1) for axis in MESH_AXES}

    @property
    def layout(self) -> str:
        return " ".join(f"{a}={s}" for a, s in self.mesh) or "one GPU"

    def config(self) -> Config:
        """The model at the run's batch: rows per rank x data-parallel ranks, over its microbatches."""
        name, overrides = _MODELS[self.model]
        rows, microbatches = _ROWS[self.model]
        ranks = self.gpus // self.sizes["tensor"]
        return load_config(os.path.join(REPO, "configs", f"{name}.py"), [
            *overrides, ("data.seq_len", str(self.seq_len)), ("execution.dtype", "bfloat16"),
            ("execution.remat", "full"), ("train.global_batch_size", str(rows * microbatches * ranks)),
            ("train.microbatches", str(microbatches)), ("model.max_seq_len", str(max(self.seq_len, 8192)))])


# the report's 14 runs; every other one (by its number) is held out from the fit
RUNS = (
    Run(1, "7B", (), 10_471, fit=True),
    Run(2, "7B", (("fsdp", 2),), 18_728, fit=False),
    Run(3, "7B", (("tensor", 2),), 13_163, fit=True),
    Run(4, "7B", (("fsdp", 4),), 38_983, fit=False),
    Run(5, "7B", (("tensor", 4),), 25_135, fit=True),
    Run(6, "7B", (("fsdp", 2), ("tensor", 2)), 25_980, fit=False),
    Run(7, "7B", (("fsdp", 2), ("tensor", 4)), 44_299, fit=True),
    Run(8, "13B", (("fsdp", 8),), 35_405, fit=False),
    Run(9, "13B", (("fsdp", 2), ("tensor", 4)), 27_345, fit=True),
    Run(10, "7B", (("fsdp", 4), ("tensor", 4)), 82_988, fit=False),
    Run(11, "13B", (("fsdp", 4), ("tensor", 4)), 53_814, fit=True),
    Run(12, "7B", (("fsdp", 8), ("tensor", 4)), 155_917, fit=False),
    Run(13, "13B", (("fsdp", 8), ("tensor", 4)), 104_309, fit=True),
    Run(14, "70B", (("fsdp", 8), ("tensor", 4)), 17_657, fit=False),
)
# the report's best layout at each GPU count (by its MFU): (GPUs, model, layout)
BEST = ((1, "7B", ()), (2, "7B", (("fsdp", 2),)), (4, "7B", (("fsdp", 4),)), (8, "13B", (("fsdp", 8),)),
        (16, "13B", (("fsdp", 4), ("tensor", 4))), (32, "13B", (("fsdp", 8), ("tensor", 4))))
