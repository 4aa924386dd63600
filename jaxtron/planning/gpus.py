"""The planner's constants: one table of what each GPU and its interconnect can do.

Every number says where it comes from. "datasheet" numbers are the vendor's; "measured" ones were measured on
such a machine (shared GPU notes: an H200 copied device to device at about 4.3 TB/s); "fitted" ones were fitted
on published training runs (``benchmarks/plan_calibration.py``: KempnerForge's 14 H200 runs, each checked with
the constants fitted on the other 13); "assumed" ones are ours and are the first to re-measure when a GPU is at hand.

Rates are what one GPU sustains:
- ``matmul_efficiency``: fraction of the dense peak that a training step's GEMMs sustain (fitted: 0.64; a lone
  bf16 8192^3 GEMM reaches 790 / 989.4 on an H200, and H100 SXM has the same tensor cores and clocks).
- ``comm_overlap``: the share of the compute that the fsdp and data collectives hide behind (fitted: 0.81).
- ``comm_interference``: the share of the hidden collectives' time the step still pays (fitted: 0.32).
- ``tensor_efficiency``: what tensor parallelism leaves of the GEMM rate beyond its collectives' bytes (assumed 1
  for jaxtron; fitted for the published stacks, ``STACK_TENSOR_EFFICIENCY``).
- ``fp8_speedup``: how many times faster than 16-bit ones FP8 projections' GEMMs run in a step, their
  quantization included (fitted on jaxtron's own bf16 and FP8 steps on one H200: 1.38;
  ``benchmarks/plan_vs_gpu.py --fit-fp8``).
- ``attention_efficiency``: fraction of the dense peak that cuDNN flash attention reaches over forward and
  backward together (assumed 0.5: published flash-attention forward kernels on H100 reach 60-75% of peak at
  head_dim 128, backward kernels 40-55%). XLA's attention materialises the score matrix and is assumed to
  reach a quarter of the peak.
- ``blockwise_attention_efficiency``: the same for the blockwise XLA kernel that ``auto`` runs on a split sequence
  (``ops/blockwise.py``; read from H100-target compiles: 0.02, ``BLOCKWISE_ATTENTION_EFFICIENCY``).
- ``grouped_gemm_efficiency``: fraction of the dense peak that dropless MoE's grouped expert GEMM reaches forward
  and backward (tokamax's Mosaic GPU kernel on an H200, 2026-11-26: 253 and 234 TFLOP/s on Mixtral's and
  DeepSeek-V3's expert shapes, 179 on Qwen3-30B-A3B's narrow one; ``benchmarks/gpu_h200_2026-11-26.md``). Capacity
  mode's batched GEMM runs at ``matmul_efficiency`` on its padded slots.
- ``hbm_bandwidth``: device memory bytes/s for the elementwise work (norms, rotary, activations, casts).
- ``nvlink_bandwidth``: NCCL bus bandwidth inside a node (``gpu/links.py``: 80% of NVLink 4's 450 GB/s).
- ``network_bandwidth``: NCCL bus bandwidth per GPU between nodes (``gpu/links.py``: 80% of one 400 Gb/s
  InfiniBand NIC a GPU, the DGX/HGX H100 and H200 layout). A ring collective whose
  group has several devices in each node drives as many NICs at once (``planning/collectives.group_bandwidth``):
  8 a node, 320 GB/s, below the 400-450 GB/s that NCCL's all-reduce test is published to reach across such nodes.
- ``usable_memory_fraction``: the part of device memory a step may plan to use; the rest is left to cuDNN
  workspaces, NCCL buffers, the CUDA context and fragmentation (jaxtron's GPU preset lets jax take 92%).
"""

from __future__ import annotations

import dataclasses

from jaxtron.config.schema import ConfigError
from jaxtron.gpu import links
from jaxtron.metrics.hardware import DENSE_PEAK_TFLOPS


@dataclasses.dataclass(frozen=True)
class GPU:
    name: str
    memory_bytes: int  # device memory as the driver reports it
    peak_flops: dict[str, float]  # dense datasheet peak per precision (the MFU denominator)
    matmul_efficiency: float
    attention_efficiency: float
    xla_attention_efficiency: float
    hbm_bandwidth: float  # bytes/s
    nvlink_bandwidth: float  # bytes/s, bus bandwidth inside a node
    network_bandwidth: float  # bytes/s per GPU, bus bandwidth across nodes
    grouped_gemm_efficiency: float = 240 / 989.4
    blockwise_attention_efficiency: float = 0.02
    # the share of the compute that the gathers and gradient reductions over fsdp and data hide behind
    # (planning/step_time.py); 1 hides them all as long as they take no longer than the compute
    comm_overlap: float = 1.0
    # the share of the time of the collectives hidden behind compute that the step still pays (their kernels share
    # the SMs and the memory bandwidth with the GEMMs)
    comm_interference: float = 0.0
    # the GEMM rate's share left under tensor parallelism beyond its collectives' bytes (which the time model counts);
    # jaxtron's assumed 1, the published stacks' in STACK_TENSOR_EFFICIENCY
    tensor_efficiency: float = 1.0
    # how many times faster than 16-bit ones the FP8 projections' GEMMs run in a step, their operands' quantization
    # included (execution.fp8; planning/step_time.py); 1: no faster
    fp8_speedup: float = 1.0
    # bytes moved per weight element in use for each pass of a microbatch over the weights beyond one a step
    # (planning/step_time.py weight_passes): jaxtron's WEIGHT_PASS_BYTES, the published stacks' in
    # STACK_WEIGHT_PASS_BYTES
    weight_pass_bytes: float = 0.0
    gpus_per_node: int = 8
    usable_memory_fraction: float = 0.90
    block_scaled: bool = False  # tensor cores that take MXFP8's and NVFP4's block scales (Blackwell)

    @property
    def usable_bytes(self) -> float:
        return self.memory_bytes * self.usable_memory_fraction

    @property
    def prices_jaxtron(self) -> bool:
        """Whether this entry prices jaxtron's programs: a published stack's (``STACK_WEIGHT_PASS_BYTES``) makes no
        weight-pass copies, and overlaps its gradient sums with its backward."""
        return self.weight_pass_bytes > 0


def _peaks(model: str) -> dict[str, float]:
    return {k: v * 1e12 for k, v in DENSE_PEAK_TFLOPS[model].items() if v}


_MIB = 2**20
# Fitted on KempnerForge's 14 H200 runs (`python benchmarks/plan_calibration.py --fit`; benchmarks/plan_calibration.md
# gives each run's error with the constants fitted on the other 13): the GEMM rate a step sustains, how much of the
# compute hides the fsdp and data collectives and what the hidden ones still cost. H100 and H200 share the compute
# and the interconnect, so both take them. The bus bandwidths stay at 80% of NVLink's 450 GB/s and of the network's
# 50 GB/s per GPU (the script says why they are not fitted).
_CALIBRATED = dict(matmul_efficiency=0.6431, comm_overlap=0.8121, comm_interference=0.3220)
# What tensor parallelism leaves of the GEMM rate, beyond its collectives' bytes (which the time model counts as
# exposed), in each stack whose runs the model is checked on: KempnerForge's fitted on its runs with the constants
# above (TP=2 costs it as large a share of the step as TP=4: a cost that follows the compute, not the bytes);
# Megatron's fitted on its runs runs to the bound of 1, its tensor collectives overlapping its GEMMs. jaxtron's own
# (``GPU.tensor_efficiency``, 1) is assumed until a multi-GPU run measures it: XLA runs the tensor group's
# collectives between the GEMMs that need them (counted exposed), the GEMMs as they are.
STACK_TENSOR_EFFICIENCY = {"KempnerForge": 0.7284, "Megatron": 1.0}
# Fitted on jaxtron's own steps measured in bf16 and in FP8 on one H200 (`python benchmarks/plan_vs_gpu.py --fit-fp8`:
# Llama-3 8B at 8 layers, Llama-3.2 1B, Mixtral 8x7B at 1 layer; each pair's ratio within 5% with the speedup fitted
# on the other two). A lone FP8 8192^3 GEMM ran 1.6 times the bf16 one in the same process; a step's FP8
# projections gain less, their operands' quantization included.
FP8_SPEEDUP = 1.38
# Read from H100-target compiles: each pass of a pipeline microbatch over a stage's weights moved 22 bytes an element
# of its routed experts (DeepSeek-V3, pipeline=4 tensor=8, 8 microbatches: the forward's float32 -> bfloat16 cast 6,
# the backward's casts to the transposed layouts 8, the float32 gradient sum's read and write 8) and 28 of Llama-3
# 8B's (pipeline=4 tensor=4: the recompute casts again); tests/test_gpu_target.py checks the planner against such a
# compile. The published stacks keep 16-bit weight copies and accumulate their gradients inside the GEMMs
# (Megatron's gradient-accumulation fusion), or cast as they gather: none of this traffic (their runs fitted the rest).
WEIGHT_PASS_BYTES = 22.0
# Read from H100-target compiles priced by the step budget: Llama-3 8B at 2 layers, 8192 tokens on sequence=2, runs
# 234.4 ms with the blockwise kernel and 85.4 with cuDNN by chunks (13.0 of it attention). Its blocks of 512 x 512
# are 162 ms at the budget's prices, which counts every block; causality skips 47% of them here, so about 86 ms
# for 1.7 ms of attention FLOPs at the dense peak: 2% of it. Its float32 scores, their elementwise work and 17k
# kernel launches make the cost (tests/test_gpu_attention_rate.py checks the ratio).
BLOCKWISE_ATTENTION_EFFICIENCY = 0.02
STACK_WEIGHT_PASS_BYTES = {"KempnerForge": 0.0, "Megatron": 0.0}
GPUS: dict[str, GPU] = {
    # 80 GB HBM3 (81,559 MiB reported), 3.35 TB/s datasheet, of which 85% is assumed reachable
    "h100": GPU("H100 SXM 80GB", 81_559 * _MIB, _peaks("H100 SXM"), attention_efficiency=0.5,
                xla_attention_efficiency=0.25, hbm_bandwidth=0.85 * 3.35e12, nvlink_bandwidth=links.NVLINK_BANDWIDTH,
                network_bandwidth=links.NETWORK_BANDWIDTH, fp8_speedup=FP8_SPEEDUP, weight_pass_bytes=WEIGHT_PASS_BYTES,
                blockwise_attention_efficiency=BLOCKWISE_ATTENTION_EFFICIENCY, **_CALIBRATED),
    # 141 GB HBM3e (143,771 MiB reported), 4.8 TB/s datasheet, 4.3 TB/s measured device-to-device copy
    "h200": GPU("H200 SXM 141GB", 143_771 * _MIB, _peaks("H200 SXM"), attention_efficiency=0.5,
                xla_attention_efficiency=0.25, hbm_bandwidth=4.3e12, nvlink_bandwidth=links.NVLINK_BANDWIDTH,
                network_bandwidth=links.NETWORK_BANDWIDTH, fp8_speedup=FP8_SPEEDUP, weight_pass_bytes=WEIGHT_PASS_BYTES,
                blockwise_attention_efficiency=BLOCKWISE_ATTENTION_EFFICIENCY, **_CALIBRATED),
    # Blackwell, no run measured: the H100's fitted and assumed shares of the peak on the datasheet figures.
    # HGX B200: 180 GB HBM3e (182,640 MiB in XLA's target spec), 8 TB/s (85% assumed reached), NVLink 5 in a node
    # of 8, a 400 Gb/s NIC a GPU
    "b200": GPU("B200 HGX 180GB", 182_640 * _MIB, _peaks("B200"), attention_efficiency=0.5,
                xla_attention_efficiency=0.25, hbm_bandwidth=0.85 * 8.0e12, nvlink_bandwidth=links.NVLINK5_BANDWIDTH,
                network_bandwidth=links.NETWORK_BANDWIDTH, fp8_speedup=FP8_SPEEDUP, weight_pass_bytes=WEIGHT_PASS_BYTES,
                blockwise_attention_efficiency=BLOCKWISE_ATTENTION_EFFICIENCY, block_scaled=True, **_CALIBRATED),
    # GB200 NVL72: 186 GB HBM3e (188,729 MiB), 8 TB/s, 72 GPUs a rack in one NVLink domain. A job of powers of two
    # runs 64 of them (16 of the rack's 18 compute trays), so a "node" here is 64 GPUs; --gpus-per-node=72 plans
    # whole racks. Between racks, a 400 Gb/s NIC a GPU
    "gb200": GPU("GB200 NVL72 186GB", 188_729 * _MIB, _peaks("GB200"), attention_efficiency=0.5,
                 xla_attention_efficiency=0.25, hbm_bandwidth=0.85 * 8.0e12, nvlink_bandwidth=links.NVLINK5_BANDWIDTH,
                 network_bandwidth=links.NETWORK_BANDWIDTH, fp8_speedup=FP8_SPEEDUP,
                 weight_pass_bytes=WEIGHT_PASS_BYTES, blockwise_attention_efficiency=BLOCKWISE_ATTENTION_EFFICIENCY,
                 gpus_per_node=64, block_scaled=True, **_CALIBRATED),
}


def check_recipe(execution, gpu: GPU) -> None:
    """A ConfigError where ``gpu`` has no tensor cores for ``execution``'s FP8 recipe: MXFP8 and NVFP4 take
    Blackwell's block-scaled ones (elsewhere XLA would run them dequantized, at the 16-bit rate or below)."""
    if execution.fp8 and execution.fp8_recipe in ("mxfp8", "nvfp4") and not gpu.block_scaled:
        raise ConfigError(f"execution.fp8_recipe='{execution.fp8_recipe}' needs Blackwell's block-scaled tensor cores, "
                          f"which the {gpu.name} lacks; plan it with --gpu=b200 or gb200, or use 'tensorwise' or "
                          "'blockwise'.")


def gpu(name: str) -> GPU:
    """The table entry for ``name`` (case-insensitive), or a ConfigError listing the known ones."""
    key = name.strip().lower()
    if key not in GPUS:
        raise ConfigError(f"--gpu={name!r} is not in the planner's table; use one of {', '.join(sorted(GPUS))}.")
    return GPUS[key]
