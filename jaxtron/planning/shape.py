"""The shape of one training step on one mesh: what the memory, time and collective terms of the estimate depend on.

Two levels: ``StepShape`` holds the mesh, the pipeline schedule and how the step's rows and tokens fall on one
device; ``BlockValues`` holds the sizes of one transformer block's values on that device.
"""

from __future__ import annotations

import dataclasses
import math

from jaxtron.config.schema import ONE_F_ONE_B, Config, ModelConfig
from jaxtron.metrics.flops import fp8_blocks
from jaxtron.models.moe import capacity
from jaxtron.ops.attention import HOPPER, cpu_implementation, resolve_implementation
from jaxtron.parallel.mesh import full_sizes
from jaxtron.parallel.sharding import shard_count
from jaxtron.parallel.stages import padding
from jaxtron.training.pipeline.fill_drain import bubble_fraction


@dataclasses.dataclass(frozen=True)
class StepShape:
    """One step of a config on one mesh, as seen from one device."""

    # the mesh
    mesh: dict[str, int]  # every mesh axis's size, outermost first
    devices: int
    data_parallel: int  # ways the batch's rows are split (``activation_batch``)
    sequence: int  # ways a row's tokens are split (``activation_length``: context parallelism)
    tensor: int  # the tensor group: devices that share their tokens and split heads, MLP width and vocabulary
    expert: int  # ways the routed experts are split (``experts``)
    stages: int  # pipeline stages (``layers`` split over the pipeline)
    # the schedule
    microbatches: int  # gradient-accumulation microbatches per step
    in_flight: int  # pipeline microbatches per pass of the schedule (1 without a pipeline)
    virtual_stages: int
    pipelined: bool  # whether the blocks run in a pipeline schedule
    schedule: str  # pipeline.schedule ('fill_drain' without a pipeline)
    gather_once: bool  # pipeline.fsdp_gather == 'step' on a pipeline with fsdp: the stages' weights held whole
    iterations: int  # iterations of one pass of the schedule, fill and drain included (1 without a pipeline)
    bubble: float  # the schedule's idle share
    # a stage runs its blocks in every iteration, the fill and drain included (on zeros): their collectives run
    # this many times as often as the microbatches' useful work needs
    busy: float
    spread: int  # ways the work outside the schedule splits its rows over the stages (1: every stage runs all)
    # the blocks
    model: ModelConfig  # the model as run: an uneven pipeline split adds identity layers
    identity_layers: int  # blocks that fill an uneven pipeline split (pipeline.uneven_stages)
    staged_blocks: int  # blocks the schedule runs, identity ones included
    outside_blocks: int  # blocks outside the schedule: a dense prefix, the prediction modules
    moe_layers: int  # MoE blocks the schedule runs
    outside_moe_layers: int  # MoE blocks outside the schedule (the prediction modules of an MoE model)
    # blocks one device runs per microbatch, the idle iterations' included, in full-row equivalents
    layers_per_stage: float
    # the tokens
    seq_len: int
    local_len: int  # tokens of a row on one device
    kv_len: int  # keys and values attention sees per row: the whole row when the sequence is split
    rows: int  # rows per device and (accumulation) microbatch
    block_rows: int  # rows each block call runs on (a pipeline microbatch)
    outside_rows: float  # rows per device of the work outside the schedule
    step_tokens: int  # tokens of the whole step
    # the program
    attention: str  # the attention implementation
    chunks: bool  # cuDNN by chunks of the load-balanced layout (ops/chunked.py)
    cpu_program: bool  # XLA:CPU's program of the dry run rather than the GPU's
    # dropless experts on a grouped GEMM kernel (the GPU's program unless execution.expert_gemm is 'xla') rather
    # than on jax.lax.ragged_dot's dense expansion
    expert_kernel: bool
    value_bytes: int  # bytes of a compute-dtype value
    # byte sizes: ``value_bytes`` in the GPU program; XLA:CPU holds 16-bit intermediates and gathered weights in
    # float32
    work_bytes: int
    stack_copy_bytes: int  # XLA:CPU's float32 copy of the saved residual stack (per element; 0: none)
    # passes over a block's forward work per step: forward, backward (twice the traffic), and the recompute
    forward_passes: int
    fp8_share: float = 0.0  # the share of blocks whose projections run in FP8 (execution.fp8, fp8_skip_layers)

    def moe_blocks(self, idle: bool = True) -> float:
        """MoE blocks one device runs per (pipeline) microbatch: its stage's, with the fill and drain's idle
        iterations (``idle``) or without them (left to the bubble), and its share of those outside the schedule."""
        return self.moe_layers // self.stages * (self.busy if idle else 1.0) + self.outside_moe_layers / self.spread


def step_shape(cfg: Config, sizes: dict[str, int], microbatches: int | None = None, cpu_program: bool = False,
               pipeline_microbatches: int | None = None) -> StepShape:
    """The shape of a step of ``cfg`` on the mesh ``sizes`` (arguments as ``jaxtron.planning.estimate.estimate``)."""
    sizes = full_sizes(sizes)
    m, execution = cfg.model, cfg.execution
    micro = microbatches or cfg.train.microbatches
    stages = shard_count(sizes, "layers")
    in_flight, virtual = cfg.pipeline.sizes(stages)
    in_flight = pipeline_microbatches or in_flight
    pipelined = (stages, in_flight) != (1, 1)
    iterations = in_flight * virtual + stages - 1 if pipelined else 1
    # an uneven split runs identity periods too (pipeline.uneven_stages): they cost a period's memory and work
    pads = padding(m.stack_periods, stages, virtual)
    run_m = dataclasses.replace(m, num_layers=m.num_layers + pads * m.period) if pads else m
    outside = m.prefix_layers + m.mtp.depth
    sequence = shard_count(sizes, "activation_length")
    if cpu_program:
        impl = cpu_implementation(execution.attention, execution.dtype, m.qk_head_dim, sequence)
    else:
        # the planner's GPUs (planning/gpus.py) are all Hopper
        impl = resolve_implementation(execution.attention, execution.dtype, m.qk_head_dim, sequence, backend="gpu",
                                      capability=HOPPER)
    value_bytes = 2 if execution.dtype == "bfloat16" else 4
    local_len = cfg.data.seq_len // sequence
    data_parallel = shard_count(sizes, "activation_batch")
    rows = cfg.train.global_batch_size // micro // data_parallel
    # the work outside the schedule (embedding, those blocks, head, loss) splits its rows over the stages too
    # where they divide (jaxtron.training.pipeline.fill_drain.Schedule.outside); else every stage runs all of its rows.
    # 1F1B runs the head inside its loop, a microbatch's tokens split over the stages where they divide
    # (training/pipeline/head_pieces.py), and the embedding on every stage
    if pipelined and cfg.pipeline.schedule in ONE_F_ONE_B:
        split = shard_count(sizes, "activation_residual_length")
        spread = stages if stages > 1 and not m.mtp.depth and cfg.data.seq_len % (stages * split) == 0 else 1
    else:
        spread = stages if stages > 1 and rows % stages == 0 else 1
    staged_blocks = run_m.num_layers - m.prefix_layers
    busy = iterations / (in_flight * virtual) if pipelined else 1.0
    return StepShape(
        mesh=sizes, devices=math.prod(sizes.values()), data_parallel=data_parallel, sequence=sequence,
        tensor=sizes["tensor"], expert=shard_count(sizes, "experts"), stages=stages,
        microbatches=micro, in_flight=in_flight, virtual_stages=virtual, pipelined=pipelined,
        schedule=cfg.pipeline.schedule if pipelined else "fill_drain", iterations=iterations,
        gather_once=pipelined and cfg.pipeline.fsdp_gather == "step" and sizes.get("fsdp", 1) > 1,
        bubble=bubble_fraction(stages, in_flight, virtual), busy=busy, spread=spread,
        model=run_m, identity_layers=pads * m.period, staged_blocks=staged_blocks, outside_blocks=outside,
        moe_layers=run_m.num_moe_layers, outside_moe_layers=m.mtp.depth if m.moe.num_experts else 0,
        layers_per_stage=staged_blocks // stages * busy + outside / spread,
        seq_len=cfg.data.seq_len, local_len=local_len, kv_len=cfg.data.seq_len if sequence > 1 else local_len,
        rows=rows, block_rows=rows // in_flight, outside_rows=rows / spread,
        step_tokens=cfg.train.global_batch_size * cfg.data.seq_len,
        attention=impl, chunks=impl == "cudnn" and sequence > 1, cpu_program=cpu_program,
        expert_kernel=bool(run_m.num_moe_layers) and execution.moe_mode == "dropless" and not cpu_program
        and execution.expert_gemm != "xla", value_bytes=value_bytes, work_bytes=4 if cpu_program else value_bytes,
        stack_copy_bytes=4 if cpu_program and value_bytes < 4 else 0,
        # 1F1B recomputes every block's forward once, whatever the remat policy (training/pipeline/one_f_one_b.py)
        forward_passes=3 + (1 if execution.remat == "full" or (pipelined and cfg.pipeline.schedule in ONE_F_ONE_B)
                            else 0),
        fp8_share=fp8_blocks(m, execution)[0] / m.num_layers)


@dataclasses.dataclass(frozen=True)
class BlockValues:
    """Sizes of one block's values on one device, in elements per (pipeline) microbatch unless named otherwise."""

    embed: int  # the residual width (whole: the tensor group splits the tokens of the residual stream instead)
    q_width: int  # query and attention-output width per device: heads x query-key head size (values padded to it)
    kv_width: int  # key (and value) width per device
    mlp_width: int  # MLP hidden width per device
    expert_width: int  # an expert's hidden width per device
    heads: int  # attention heads per device
    vocab: int  # vocabulary entries per device
    residual: int  # the residual stream whole, as the projections take it
    residual_split: int  # the residual stream split over the tensor group, as it runs between the projections
    attention: dict[str, int]  # attention's values: 'q', 'kv', 'out', and with latent attention 'latent'
    mlp: dict[str, int]  # the MLP's values: 'gate_up', 'act'
    scores: int  # XLA attention's float32 [batch, heads, q, k] scores (other kernels: none)
    # cuDNN's float32 softmax statistics, which a policy that keeps the attention's outputs (or none) keeps too: [rows x
    # execution.attention_max_segments, heads, length] in the packed layout of documents (ops/cudnn.py), [rows, heads,
    # length] by chunks
    attention_stats: int
    # the block input, its two norms, two residual sums and the MLP output split; both normed inputs gathered
    everything: int
    moe_rows: int  # rows each device's expert GEMMs run over: dropless receive buffers or capacity buffers
    moe_exchanged: int  # rows each device sends its expert shards per exchange: routed (dropless) or its slots
    moe_values: int  # the MoE exchange buffers in and out, the expert hidden values and the sorted rows
    # dropless mode's grouped GEMMs computed as XLA computes jax.lax.ragged_dot (every row against every local
    # expert): what that expansion adds beyond one expert's [rows, embed + expert width]
    moe_expanded: int


def block_values(cfg: Config, shape: StepShape) -> BlockValues:
    """One block's values for a step of ``cfg`` of this shape."""
    m, execution, sizes = cfg.model, cfg.execution, shape.mesh
    b, t, tensor = shape.block_rows, shape.local_len, shape.tensor
    h, d = m.embed_dim, m.qk_head_dim
    q_width = m.attention.num_heads * d // shard_count(sizes, "activation_heads")
    kv_width = m.attention.num_kv_heads * d // shard_count(sizes, "activation_kv_heads")
    mlp_width = m.mlp_dim // shard_count(sizes, "activation_mlp")
    heads = m.attention.num_heads // shard_count(sizes, "activation_heads")
    x = b * t * h
    attention = {"q": b * t * q_width, "kv": 2 * b * shape.kv_len * kv_width, "out": b * t * q_width}
    if m.latent_attention:  # the low-rank query, the key-value latent and the shared rotated key
        a = m.attention
        attention["latent"] = b * t * (a.q_lora_rank + a.kv_lora_rank + a.qk_rope_head_dim)
    mlp = {"gate_up": 2 * b * t * mlp_width, "act": b * t * mlp_width}
    tokens, k = b * t, m.moe.experts_per_token
    moe_rows = moe_exchanged = 0
    if shape.moe_layers and execution.moe_mode == "dropless":
        # the receive buffer: every peer's rows (the worst case), or moe_receive_factor times the device's own
        factor = min(shape.expert, execution.moe_receive_factor) if execution.moe_receive_factor else shape.expert
        moe_rows, moe_exchanged = math.ceil(tokens * k * factor), tokens * k
    elif shape.moe_layers:
        moe_rows = moe_exchanged = m.moe.num_experts * b * capacity(m, execution.capacity_factor, t)
    expert_width = m.resolved_expert_dim // shard_count(sizes, "activation_mlp")
    # rows once per node: a device's rows for each node out and in, and the next hop's rows sorted by expert (as
    # many as every node's device at its place may send it, ``models/experts._exchange_nodes``)
    per_node = execution.moe_node_shards
    nodes = shape.expert // per_node if execution.moe_mode == "dropless" and 0 < per_node < shape.expert else 1
    return BlockValues(
        embed=h, q_width=q_width, kv_width=kv_width, mlp_width=mlp_width, expert_width=expert_width, heads=heads,
        vocab=m.vocab_size // shard_count(sizes, "activation_vocab"), residual=x, residual_split=x // tensor,
        attention=attention, mlp=mlp,
        scores=b * heads * t * shape.kv_len if shape.attention == "xla" else 0,
        attention_stats=b * heads * t * (1 if shape.chunks else execution.attention_max_segments)
        if shape.attention == "cudnn" else 0,
        everything=6 * (x // tensor) + (2 * x if tensor > 1 else 0) + sum(attention.values()) + sum(mlp.values()),
        moe_rows=moe_rows, moe_exchanged=moe_exchanged,
        moe_values=moe_rows * (2 * h + 3 * expert_width) + 2 * tokens * k * h * nodes + 2 * tokens * h * (nodes > 1),
        moe_expanded=(m.moe.num_experts // shape.expert - 1) * moe_rows * (h + expert_width)
        if shape.moe_layers and execution.moe_mode == "dropless" else 0)
