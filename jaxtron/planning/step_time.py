"""Roofline step time: the compute terms, and how they combine with the communication terms into a step.

Matmul FLOPs (model FLOPs plus the remat recompute) run at the measured GEMM rate, attention at the attention
kernel's rate, elementwise traffic at HBM bandwidth; the stages of a pipeline idle through its bubble. The
collectives (``jaxtron.planning.collectives``) either overlap with this compute or add to it (``OVERLAPPED``,
``EXPOSED``).
"""

from __future__ import annotations

import functools

from jaxtron.config.schema import ONE_F_ONE_B, Config, ExecutionConfig, replace
from jaxtron.metrics.flops import flops_breakdown, fp8_flop_share, fp8_flops_per_token, hardware_flops_breakdown
from jaxtron.metrics.hardware import weighted_peak
from jaxtron.planning import muon
from jaxtron.planning.gpus import GPU, check_recipe
from jaxtron.planning.params import Param
from jaxtron.planning.shape import BlockValues, StepShape
from jaxtron.planning.working_copy import WORKING_COPY_PASS_BYTES, reads_working_copy

# elementwise traffic of one block per token, in units of (h + q + 2k + f): norms, rotary, residual adds,
# activation function and casts, forward only (the backward moves about twice as much)
ELEMENTWISE_PASSES = 6.0

COMPUTE_TERMS = ("matmul", "attention", "elementwise", "weights", "expert_rows", "pipeline_bubble", "optimizer",
                 "logprobs", "generation")  # the last two: GRPO's (planning/rollouts.py), 0 otherwise
# gathers and gradient reductions over fsdp/data (and sequence) overlap with compute (XLA's latency-hiding
# scheduler), but for the sums a 1F1B loop leaves after it (``collectives.sums_after_the_loop``); the other
# collectives sit between dependent computations (see jaxtron.planning.collectives)
OVERLAPPED = ("fsdp_comm", "data_comm")
EXPOSED = ("matmul", "attention", "elementwise", "weights", "expert_rows", "pipeline_bubble", "optimizer",
           "logprobs", "generation", "tensor_comm", "sequence_comm", "expert_comm", "pipeline_comm", "optimizer_comm",
           "data_comm_after_loop")
# the MoE exchanges that run beside the experts' GEMMs, and the tensor group's collectives that run beside the
# projections' GEMMs: they cost only their interference with them (``expert_overlap``, ``tensor_overlap``)
HIDDEN = ("expert_comm_hidden", "tensor_comm_hidden")
# The share of a chunked part's tensor collectives that run beside GEMMs, by execution.tensor_chunks (one, or two and
# more; models/tensor_chunks.py): the least share of the blocks' gathered and reduce-scattered bytes that the kernels
# in their windows can hide on the H100 target at NVLink's rate, rounded down to 5%. Llama-3 70B at 2 layers,
# tensor=8: 84% of both (13% and 51% whole, which the planner takes as exposed); tests/test_gpu_tensor_overlap.py.
TENSOR_HIDDEN = {1: 0.0, 2: 0.80}
# Each chunk beyond the first adds its own weight gradient into the sum: one more pass over the chunked projections'
# weights each time a microbatch passes them, in bytes an element. GPT-3 175B's published layout cut to 16 layers on
# the H100 target: 2 chunks cost 62.3 ms of the budget (1019.5 -> 1081.8 ms, the backward's adds 6.3 -> 72.9 ms) for
# 7.25G such element passes at the budget's copy rate, 17.7 bytes each; tests/test_gpu_tensor_overlap.py.
TENSOR_CHUNK_PASS_BYTES = 18.0
# Under 1F1B with one chunk a stage the chunks' gradients are summed in the backward phase and added in place: the
# same cut as 1F1B with 8 microbatches, phases counted where they run, 2 chunks cost 49.1 ms (530.0 -> 579.1 ms),
# which the planner's terms give at 10.3 bytes an element; tests/test_gpu_tensor_overlap.py.
IN_PLACE_CHUNK_PASS_BYTES = 10.0
# A further pass over a stage's block weights in a 1F1B loop with one chunk a stage, by the budget's kernels of each
# phase (Llama-3 8B at 8 layers on pipeline=2 tensor=4, 8 pipeline microbatches, H100 target): from the working
# copy, its bfloat16 slices forward and backward (8.0) and the float32 gradient sum (6.0, every iteration); from the
# float32 masters, the casts (9.6) and the sum (8.0). tests/test_gpu_target.py. (An earlier reading, 3.98 and
# 15.95, took the difference of 4 and 8 microbatches, and so of the fill's and drain's activation work too.)
IN_PLACE_PASS_BYTES = {"working copy": 14.0, "masters": 18.0}
# With more chunks a stage (the interleaved schedule) each stage picks its chunk at an index of its own
# (training/pipeline/one_f_one_b.py OneFOneB.slot): the slices become gathers and the sum a scatter that copy each
# slice apart, 12 bytes an element more (the difference of the two programs; tests/test_gpu_target.py).
STAGE_INDEX_PASS_BYTES = 12.0
# The share of the MoE exchanges' time that XLA's latency-hiding scheduler (models/moe.py COMPILER_OPTIONS) runs beside
# compute, by what the scheduler weighs the program with (execution.moe_schedule) and the token chunks
# (execution.moe_chunks: one, or two and more): the least of the H100-target programs of Mixtral 8x7B (2 layers,
# expert=8) and DeepSeek-V3 (4 layers, fsdp=2 expert=8 inside a node; expert=16 over 2 nodes, rows once per node),
# each exchange at the bandwidth of its links (NVLink inside a node, the network across), rounded down to 5%.
# With the budget's costs: one chunk 43% (DeepSeek-V3 across nodes; the programs inside a node 72-94%), chunks 63%
# (DeepSeek-V3 across nodes at 2 chunks, its config; 72% at 4; inside a node 78-86%). The hop inside a node of rows
# sent once per node runs among the node's devices (models/experts.py), at NVLink's rate. While the remat recomputed
# the way home its kernels sat beside more exchanges (92-98% inside a node), but that compute is gone
# (benchmarks/moe_overlap_budget.md). With XLA's own: 19% and 21% (DeepSeek-V3 across nodes).
# tests/test_gpu_target.py checks that every one of those programs hides at least this.
EXCHANGES_HIDDEN = {("xla", 1): 0.15, ("xla", 2): 0.20, ("budget", 1): 0.40, ("budget", 2): 0.60}


def exchanges_hidden(execution) -> float:
    """``EXCHANGES_HIDDEN`` of a run's ``execution`` config."""
    return EXCHANGES_HIDDEN[(execution.moe_schedule, min(execution.moe_chunks, 2))]


# The dropless MoE block's own memory traffic in a step (forward, recompute and backward), in passes over a device's
# rows of the experts' GEMMs (its receive buffers where the experts are split, its routed rows where they are not):
# sorting, gathering the rows into the buffers and their outputs back, the layouts the grouped kernel and the
# exchanges take. Read off H100-target compiles (the memory-bound kernels of the 'experts' scope whose results have
# no dimension of the expert width: neither the weights nor the hidden values, which are not priced): DeepSeek-V3
# at 4 layers on fsdp=2 expert=8 (receive buffers of 2x) moved 29 passes over its buffers, Mixtral 8x7B at 2 layers
# on expert=8 (worst-case buffers of 8x) 20 at 4 chunks and 24 at one (39 and 27 while the recompute brought the
# outputs home), DeepSeek-V3's experts whole on pipeline=4 tensor=8 17 over its routed rows;
# tests/test_gpu_target.py checks the first two within 25%.
EXPERT_ROW_PASSES = {"exchanged": 25.0, "local": 17.0}
# the 16-bit grouped expert GEMM's backward reads each expert's matrix transposed, made by a kernel of its own each
# pass (ops/grouped_kernels.transposed): its read and write of the bfloat16 copy, bytes an element beyond
# GPU.weight_pass_bytes (the H100 compile of Mixtral 8x7B on a pipeline, tests/test_gpu_target.py)
GROUPED_TRANSPOSE_BYTES = 4.0


def compute_time(cfg: Config, shape: StepShape, block: BlockValues, gpu: GPU,
                 params: tuple[Param, ...]) -> dict[str, float]:
    """Seconds per step of the compute terms: 'matmul', 'attention', 'elementwise', 'weights' (``weight_passes``),
    'expert_rows' (``expert_row_bytes``), 'pipeline_bubble' and 'optimizer' (Muon's Newton-Schulz GEMMs of the
    parameters ``params``, once a step, after the schedule)."""
    execution, hardware = _step_hardware(cfg, shape)
    # the matmul term carries the routed experts at the dense rate's scale (``_expert_scale``)
    experts = hardware.get("experts", 0.0) * (_expert_scale(execution, gpu) - 1)
    matmul = sum(v for k, v in hardware.items() if k != "attention_scores") + experts
    # by chunks, a chunk's first document is computed twice on its own keys (once merged with its earlier keys):
    # at most a diagonal block per chunk, 1 / (2 x sequence) of a device's causal work
    scores_flops = hardware["attention_scores"] * (1 + 1 / (2 * shape.sequence) if shape.chunks else 1)
    attention_eff = {"cudnn": gpu.attention_efficiency, "blockwise": gpu.blockwise_attention_efficiency}.get(
        shape.attention, gpu.xla_attention_efficiency)
    tensor, stages, spread = shape.tensor, shape.stages, shape.spread
    # bytes per device: a tensor group of T devices shares its tokens and splits all of the work, the
    # residual-width values along the sequence and the head and MLP widths across
    elementwise = (ELEMENTWISE_PASSES * shape.forward_passes
                   * (shape.staged_blocks + shape.outside_blocks * stages / spread)
                   * (block.embed // tensor + block.q_width + 2 * block.kv_width + block.mlp_width)
                   * shape.value_bytes * shape.step_tokens / (shape.devices / tensor))
    # unless the stages split their rows, the output head and the blocks outside the schedule run on every stage
    # for its data-parallel rows (replicated over the pipeline axis)
    if stages > 1 and spread == 1:
        staged_only = replace(shape.model, num_layers=shape.staged_blocks, moe=dict(first_dense_layers=0),
                              mtp=dict(depth=0))
        inner = hardware_flops_breakdown(staged_only, execution, shape.seq_len, attention=shape.attention)
        repeated = {k: v - (inner[k] if k != "logits" else 0.0) for k, v in hardware.items()}
        matmul += sum(v for k, v in repeated.items() if k != "attention_scores") * (stages - 1)
        scores_flops += repeated["attention_scores"] * (stages - 1)
    # the FP8 projections' GEMMs (and their recompute) run ``low_precision_speedup`` times faster
    fp8 = fp8_flops_per_token(shape.model, execution, shape.seq_len, hardware=True, attention=shape.attention)
    matmul -= fp8 * (1.0 - 1.0 / low_precision_speedup(execution, gpu)) if fp8 else 0.0
    peak = _peak(execution, gpu)
    time = {"matmul": matmul * shape.step_tokens / shape.devices / _matmul_rate(execution, shape, gpu),
            "attention": scores_flops * shape.step_tokens / shape.devices / (peak * attention_eff),
            "elementwise": elementwise / gpu.hbm_bandwidth}
    # dropless 16-bit experts run the grouped kernel (as ``_expert_scale`` prices them); a table entry without
    # weight-pass bytes prices a published stack, which makes no such copies
    grouped = execution.moe_mode == "dropless" and not execution.fp8
    transposed = GROUPED_TRANSPOSE_BYTES if grouped and gpu.prices_jaxtron else 0.0
    # under the distributed optimizer the projections' passes read the step's working copy, not the masters
    copied = tuple(p for p in params
                   if cfg.optimizer.distributed and reads_working_copy(p, shape.mesh, shape.value_bytes))
    others = tuple(p for p in params if p not in copied)
    copy_bytes = min(gpu.weight_pass_bytes, WORKING_COPY_PASS_BYTES)
    staged_bytes = {"masters": gpu.weight_pass_bytes, "working copy": copy_bytes}
    one_f_one_b = shape.pipelined and shape.schedule in ONE_F_ONE_B
    one_chunk = one_f_one_b and shape.virtual_stages == 1
    chunk_bytes = IN_PLACE_CHUNK_PASS_BYTES if one_chunk else TENSOR_CHUNK_PASS_BYTES
    if one_f_one_b and gpu.prices_jaxtron:  # as compiled, by phase
        extra = 0.0 if one_chunk else STAGE_INDEX_PASS_BYTES
        staged_bytes = {k: v + extra for k, v in IN_PLACE_PASS_BYTES.items()}
    time["weights"] = (pass_bytes(shape, others, gpu.weight_pass_bytes, staged_bytes["masters"])
                       + pass_bytes(shape, copied, copy_bytes, staged_bytes["working copy"])
                       + weight_passes(shape, params, experts_only=True) * transposed
                       + chunk_passes(cfg, shape, params) * chunk_bytes) / gpu.hbm_bandwidth
    time["expert_rows"] = expert_row_bytes(cfg, shape, block) / gpu.hbm_bandwidth
    # the stages idle through the fill and drain: the bubble's share of the schedule's iterations (in each of which
    # a stage passes over its weights too)
    time["pipeline_bubble"] = sum(time.values()) * shape.bubble / (1 - shape.bubble)
    time["optimizer"] = muon.optimizer_time(cfg, params, shape.mesh, gpu)
    time["logprobs"] = time["generation"] = 0.0  # GRPO's, added by planning/rollouts.py
    return time


def weight_passes(shape: StepShape, params: tuple[Param, ...], experts_only: bool = False) -> float:
    """Weight elements a device passes over beyond one pass a step (``experts_only``: of the routed experts' weights
    alone). Each microbatch of a step
    (``train.microbatches``, and a pipeline's microbatches through a stage) casts the weights it uses to the compute
    dtype, casts them again for the backward pass's transposed GEMMs and adds its gradient to the float32 sum:
    ``GPU.weight_pass_bytes`` an element (the H100 compile of DeepSeek-V3's experts on a pipeline: 22). The first
    pass is in the GEMM rate the published runs were fitted with (one pass a step, and their stacks keep 16-bit
    weights and accumulate into float32 inside the GEMM); the further ones are what microbatches cost beyond their
    FLOPs, and what makes many small microbatches over many local experts memory-bound."""
    params = tuple(p for p in params if "experts" in p.names or not experts_only)
    staged = sum(p.gathered_elements(shape.mesh) for p in params if p.staged)
    rest = sum(p.gathered_elements(shape.mesh) for p in params if not p.staged)
    if not shape.pipelined:
        return (staged + rest) * (shape.microbatches - 1)
    # the weights outside the schedule (embedding, head, a dense prefix) pass once an accumulation microbatch
    return staged * (shape.microbatches * shape.in_flight - 1) + rest * (shape.microbatches - 1)


def pass_bytes(shape: StepShape, params: tuple[Param, ...], per_element: float, staged_per_element: float) -> float:
    """Bytes of the passes over ``params`` beyond one a step (``weight_passes``): the staged weights' at
    ``staged_per_element`` bytes an element, the others' at ``per_element``."""
    staged = weight_passes(shape, tuple(p for p in params if p.staged))
    return (weight_passes(shape, params) - staged) * per_element + staged * staged_per_element


def chunk_passes(cfg: Config, shape: StepShape, params: tuple[Param, ...]) -> float:
    """Weight elements a device passes over to add the gradients of ``execution.tensor_chunks`` beyond the first
    (``TENSOR_CHUNK_PASS_BYTES``): the block projections' weights, at the chunked parts' share, each microbatch."""
    chunks = cfg.execution.tensor_chunks
    if chunks <= 1 or shape.tensor <= 1 or cfg.execution.fp8:  # FP8 blocks run whole (models/transformer.py)
        return 0.0
    staged = sum(p.gathered_elements(shape.mesh) for p in params if p.projection and p.staged)
    rest = sum(p.gathered_elements(shape.mesh) for p in params if p.projection and not p.staged)
    staged_runs = shape.microbatches * (shape.in_flight if shape.pipelined else 1)
    return (chunks - 1) * chunked_share(cfg.model) * (staged * staged_runs + rest * shape.microbatches)


def expert_row_bytes(cfg: Config, shape: StepShape, block: BlockValues) -> float:
    """Bytes a device's dropless MoE blocks move over their rows in a step (``EXPERT_ROW_PASSES``), the bubble's
    iterations left to the bubble; none in capacity mode (its slots are priced as the GEMMs' padded rows)."""
    if not (shape.moe_layers and cfg.execution.moe_mode == "dropless"):
        return 0.0
    passes = EXPERT_ROW_PASSES["exchanged" if shape.expert > 1 else "local"]
    return (passes * block.moe_rows * block.embed * shape.value_bytes * shape.moe_blocks(idle=False)
            * shape.microbatches * shape.in_flight)


def step_seconds(time: dict[str, float], overlap: float = 1.0, interference: float = 0.0) -> float:
    """The step: the compute, plus the overlapped communication that ``overlap`` x the compute does not hide, plus
    ``interference`` x what it does hide (running beside the GEMMs, the collectives' kernels take some of their
    SMs and memory bandwidth), plus the exposed communication. With ``overlap`` 1 and no interference the
    overlapped communication costs nothing until it outlasts the compute; the published runs say otherwise
    (``GPU.comm_overlap``, ``GPU.comm_interference``, benchmarks/plan_calibration.md)."""
    compute = sum(time[k] for k in COMPUTE_TERMS)
    overlapped = sum(time[k] for k in OVERLAPPED)
    hidden = min(overlapped, overlap * compute)
    return compute + interference * (hidden + sum(time.get(k, 0.0) for k in HIDDEN)) + (overlapped - hidden) + \
        sum(time[k] for k in EXPOSED if k not in COMPUTE_TERMS)


def model_flops(cfg: Config, shape: StepShape) -> float:
    """Model FLOPs per device and step (the MFU numerator: no recompute, causal attention counted as half)."""
    return sum(flops_breakdown(cfg.model, shape.seq_len).values()) * shape.step_tokens / shape.devices


def mfu_peak(cfg: Config, shape: StepShape, gpu: GPU) -> float:
    """The MFU denominator, as the train metrics take it: the dense bf16 peak, or with FP8 projections the
    FLOP-weighted peak of the FP8 and the 16-bit model FLOPs (``jaxtron.metrics.hardware.flop_weighted_peak``)."""
    bf16 = gpu.peak_flops["bfloat16"]
    share = fp8_flop_share(cfg.model, cfg.execution, shape.seq_len)
    low = low_precision(cfg.execution)
    if not share or low not in gpu.peak_flops:
        return bf16
    return weighted_peak(share, 1.0, gpu.peak_flops[low], bf16)


def low_precision(execution: ExecutionConfig) -> str:
    """The peak an FP8 recipe's projections run against: 'fp4' for NVFP4's, 'fp8' for the others'."""
    return "fp4" if execution.fp8_recipe == "nvfp4" else "fp8"


def low_precision_speedup(execution: ExecutionConfig, gpu: GPU) -> float:
    """How many times faster than 16-bit ones a recipe's projection GEMMs run: the FP8 speedup fitted on
    tensorwise steps (``GPU.fp8_speedup``), times the FP4 peak over the FP8 one for NVFP4 (assumed: no run has
    measured it)."""
    check_recipe(execution, gpu)
    if low_precision(execution) == "fp4":
        return gpu.fp8_speedup * gpu.peak_flops["fp4"] / gpu.peak_flops["fp8"]
    return gpu.fp8_speedup


def _step_hardware(cfg: Config, shape: StepShape) -> tuple[ExecutionConfig, dict[str, float]]:
    """(the execution whose FLOPs the step runs: a 1F1B schedule recomputes every block's forward once, as remat
    'full' does; its hardware FLOPs per token by term: model FLOPs plus what the remat policy re-runs, from the
    table HFU uses, ``jaxtron.metrics.flops.RECOMPUTED``)."""
    execution = replace(cfg.execution, remat="full") if shape.schedule in ONE_F_ONE_B else cfg.execution
    return execution, _hardware_flops(shape.model, execution, shape.seq_len, shape.attention)


@functools.lru_cache(maxsize=4096)  # a plan asks it for every mesh of every remat policy; callers only read it
def _hardware_flops(model, execution, seq_len: int, attention: str) -> dict[str, float]:
    return hardware_flops_breakdown(model, execution, seq_len, attention=attention)


def _peak(execution: ExecutionConfig, gpu: GPU) -> float:
    """The dense peak the step's matmuls run against: bf16's, or for float32 TF32's (half of it)."""
    return gpu.peak_flops["bfloat16"] if execution.dtype == "bfloat16" else gpu.peak_flops["bfloat16"] / 2


def _matmul_rate(execution: ExecutionConfig, shape: StepShape, gpu: GPU) -> float:
    """FLOP/s of the step's GEMMs: the peak at the measured GEMM efficiency, tensor parallelism's on top."""
    return _peak(execution, gpu) * gpu.matmul_efficiency * (gpu.tensor_efficiency if shape.tensor > 1 else 1.0)


def _expert_scale(execution: ExecutionConfig, gpu: GPU) -> float:
    """The routed experts' GEMM time over a dense GEMM's of their FLOPs: the grouped kernel's rate (dropless), or
    capacity_factor times the rows (capacity mode's padded slots)."""
    if execution.moe_mode == "dropless":
        return gpu.matmul_efficiency / gpu.grouped_gemm_efficiency
    return execution.capacity_factor


def expert_gemm_seconds(cfg: Config, shape: StepShape, gpu: GPU) -> float:
    """Seconds per step of the routed experts' GEMMs (recompute included), at the rate ``compute_time`` runs them."""
    execution, hardware = _step_hardware(cfg, shape)
    return (hardware.get("experts", 0.0) * _expert_scale(execution, gpu) * shape.step_tokens / shape.devices
            / _matmul_rate(execution, shape, gpu))


def chunked_share(model) -> float:
    """The share of a block's tensor collectives that ``execution.tensor_chunks`` runs in chunks: those of grouped-query
    attention and of a dense MLP, each half of a block's (latent attention, Gated DeltaNet and MoE run whole)."""
    kinds = [model.block_kind(i) for i in range(model.num_layers)]
    attention = 0.0 if model.latent_attention else sum(not k.linear for k in kinds)
    return (attention + sum(not k.moe for k in kinds)) / (2 * len(kinds))


def tensor_overlap(cfg: Config, time: dict[str, float]) -> dict[str, float]:
    """``time``'s tensor collectives split into those the step waits for ('tensor_comm') and those that run beside
    the projections' GEMMs ('tensor_comm_hidden', ``TENSOR_HIDDEN`` of the chunked parts'), up to the GEMMs' time."""
    total = time.get("tensor_comm", 0.0)
    # FP8's per-tensor scales read all of a block's rows, so its projections run whole (models/transformer.py)
    share = 0.0 if cfg.execution.fp8 else TENSOR_HIDDEN[min(cfg.execution.tensor_chunks, 2)]
    hidden = min(share * chunked_share(cfg.model) * total, time["matmul"]) if share and total else 0.0
    return {"tensor_comm": total - hidden, "tensor_comm_hidden": hidden}


def expert_overlap(cfg: Config, shape: StepShape, time: dict[str, float], gpu: GPU) -> dict[str, float]:
    """``time``'s expert exchanges split into those the step waits for ('expert_comm') and those that run beside
    the experts' GEMMs ('expert_comm_hidden'): ``exchanges_hidden`` of them, up to the GEMMs' own time."""
    total = time.get("expert_comm", 0.0)
    hidden = exchanges_hidden(cfg.execution) * min(total, expert_gemm_seconds(cfg, shape, gpu)) if total else 0.0
    return {"expert_comm": total - hidden, "expert_comm_hidden": hidden}
