"""Published training runs the planner's time model is calibrated on and checked against.

KempnerForge's MFU scaling report (KempnerInstitute/KempnerForge, benchmarks/mfu_scaling/mfu_scaling_2026-04-05.md):
14 runs of Llama-3-shaped models on 1 to 32 H200s in nodes of 4 (NVLink inside a node, InfiniBand between), a
PyTorch FSDP2 stack with torch.compile, bf16, full activation checkpointing, sequence 4096. Each data-parallel
rank takes 4 rows per microbatch (70B: 2) over 2 microbatches (13B and 70B: 4); tokens/s is measured, the step
time and the token count per step agree with it. The models: "7B" is Llama-3 8B; "13B" is Llama-3 with width 5120,
40 layers, 40 query and 8 key-value heads and an MLP of 17920 (its 14.84B parameters); "70B" is Llama-3 70B.

The time model's constants are fitted on KempnerForge's runs, and each run is checked with the constants fitted on
the other 13 (``benchmarks/plan_calibration.py``).
"""

from __future__ import annotations

import dataclasses
import os

from jaxtron.config.loader import load_config
from jaxtron.config.schema import MESH_AXES, Config

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
KEMPNERFORGE = "KempnerForge MFU scaling report, 2026-04-05"
KEMPNERFORGE_STACK = "KempnerForge"
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
    gpu: str = "h200"
    gpus_per_node: int = 4
    seq_len: int = 4096
    source: str = KEMPNERFORGE
    stack: str = KEMPNERFORGE_STACK

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


MEGATRON = "Megatron"
_MEGATRON_CORE = "Megatron-Core README, weak scaling on H100"


@dataclasses.dataclass(frozen=True)
class MegatronRun:
    """A Megatron run: a GPT (f = 4h, MHA) or Llama shape, TFLOP/s per GPU as Megatron counts them (model FLOPs of
    Narayanan et al., non-causal, no recompute), turned into tokens/s; micro-batches of one row, a 1F1B pipeline
    over all of a data-parallel rank's rows where there is one, the distributed optimizer."""

    number: str
    model: str
    mesh: tuple[tuple[str, int], ...]
    tflops: float  # per GPU, as published
    batch: int  # global batch (rows)
    base: str = "gpt3_175b"  # the config the shape overrides
    shape: tuple[tuple[str, str], ...] = ()
    seq_len: int = 4096
    gpu: str = "h100"
    gpus_per_node: int = 8
    source: str = _MEGATRON_CORE
    stack: str = MEGATRON

    gpus = Run.gpus
    sizes = Run.sizes
    layout = Run.layout

    def config(self) -> Config:
        pipelined = self.sizes["pipeline"] > 1
        ranks = self.gpus // (self.sizes["tensor"] * self.sizes["pipeline"] * self.sizes["sequence"])
        rows = self.batch // ranks
        schedule = [("pipeline.schedule", "1f1b"), ("pipeline.microbatches", str(rows)),
                    ("pipeline.uneven_stages", "true")] if pipelined else [("train.microbatches", str(rows))]
        # on a split sequence Megatron runs cuDNN's kernel under its context parallelism: cuDNN by chunks here
        attention = [("execution.attention", "cudnn")] if self.sizes["sequence"] > 1 else []
        return load_config(os.path.join(REPO, "configs", f"{self.base}.py"), [
            *self.shape, ("data.seq_len", str(self.seq_len)), ("model.max_seq_len", str(max(self.seq_len, 2048))),
            ("execution.dtype", "bfloat16"), ("execution.remat", "full" if pipelined else "save_dots"),
            ("train.global_batch_size", str(self.batch)), ("optimizer.distributed", "true"), *schedule, *attention])

    @property
    def tokens_per_s(self) -> float:
        from jaxtron.metrics.flops import narayanan_flops_per_batch

        model = self.config().model
        per_token = narayanan_flops_per_batch(1, self.seq_len, model.num_layers, model.embed_dim, model.vocab_size,
                                              recompute=False) / self.seq_len
        return self.tflops * 1e12 * self.gpus / per_token


def _gpt(hidden: int, heads: int, layers: int) -> tuple[tuple[str, str], ...]:
    return (("model.embed_dim", str(hidden)), ("model.num_layers", str(layers)), ("model.mlp_dim", str(4 * hidden)),
            ("model.attention.num_heads", str(heads)), ("model.attention.num_kv_heads", str(heads)),
            ("model.attention.head_dim", str(hidden // heads)), ("model.vocab_size", "131072"),
            ("model.tie_embeddings", "false"))


# Megatron's H100 runs: Megatron-Core's weak-scaling table (``../shared/REFERENCES.md``; 48 data-parallel ranks
# each) and its GPT-3 175B and Llama-3.1 405B figures
MEGATRON_RUNS = (
    MegatronRun("M1", "1.7B", (("data", 48),), 408.8, 192, shape=_gpt(2048, 16, 24)),
    MegatronRun("M2", "7.1B", (("data", 48), ("tensor", 2)), 465.9, 192, shape=_gpt(4096, 32, 30)),
    MegatronRun("M3", "16B", (("data", 48), ("tensor", 4)), 489.1, 192, shape=_gpt(6144, 48, 32)),
    MegatronRun("M4", "70B", (("pipeline", 2), ("data", 48), ("tensor", 8)), 419.7, 384,
                shape=_gpt(8192, 64, 84)),
    MegatronRun("M5", "462B", (("pipeline", 16), ("data", 48), ("tensor", 8)), 459.9, 3072,
                shape=_gpt(18432, 144, 112)),
    MegatronRun("M6", "GPT-3 175B", (("pipeline", 8), ("data", 4), ("tensor", 4)), 390.0, 1536,
                seq_len=2048, source="Megatron-LM, GPT-3 175B on 128 H100s"),
    MegatronRun("M7", "Llama-3.1 405B", (("pipeline", 8), ("data", 8), ("sequence", 2), ("tensor", 8)), 400.0,
                1024, base="llama3_405b", seq_len=8192, source="Megatron-LM, Llama-3.1 405B"),
)

# the report's 14 runs
RUNS = (
    Run(1, "7B", (), 10_471),
    Run(2, "7B", (("fsdp", 2),), 18_728),
    Run(3, "7B", (("tensor", 2),), 13_163),
    Run(4, "7B", (("fsdp", 4),), 38_983),
    Run(5, "7B", (("tensor", 4),), 25_135),
    Run(6, "7B", (("fsdp", 2), ("tensor", 2)), 25_980),
    Run(7, "7B", (("fsdp", 2), ("tensor", 4)), 44_299),
    Run(8, "13B", (("fsdp", 8),), 35_405),
    Run(9, "13B", (("fsdp", 2), ("tensor", 4)), 27_345),
    Run(10, "7B", (("fsdp", 4), ("tensor", 4)), 82_988),
    Run(11, "13B", (("fsdp", 4), ("tensor", 4)), 53_814),
    Run(12, "7B", (("fsdp", 8), ("tensor", 4)), 155_917),
    Run(13, "13B", (("fsdp", 8), ("tensor", 4)), 104_309),
    Run(14, "70B", (("fsdp", 8), ("tensor", 4)), 17_657),
)
# the report's best layout at each GPU count (by its MFU): (GPUs, model, layout)
BEST = ((1, "7B", ()), (2, "7B", (("fsdp", 2),)), (4, "7B", (("fsdp", 4),)), (8, "13B", (("fsdp", 8),)),
        (16, "13B", (("fsdp", 4), ("tensor", 4))), (32, "13B", (("fsdp", 8), ("tensor", 4))))
