"""Analytic estimate of one mesh: per-device memory and a roofline step time, term by term.

The model follows what jaxtron's train step does, not an idealised trainer:
- Parameters, AdamW moments and gradients are float32 (16 bytes per parameter, one more gradient buffer with
  microbatches), sharded as ``jaxtron.parallel.sharding.RULES`` says; the shard sizes are computed from the real
  model's parameter shapes and logical axis names.
- Activations kept for the backward pass follow ``execution.remat`` (which block outputs are saved per layer). The
  residual stream between blocks is split along the sequence over ``tensor`` as well as ``sequence``
  (Megatron-style sequence parallelism, ``activation_residual_length``); the normed inputs of attention and the
  MLP are gathered whole over the tensor group.
- Working space is the largest of three phases: the backward pass of one block (its recomputed intermediates and
  their gradients, XLA attention's float32 score matrices or blockwise attention's float32 key and value gradients
  over the gathered sequence and its per-block scores, the block's weights gathered over ``fsdp`` in float32 and
  their gradients before the reduce-scatter, the MoE exchange buffers) and the loss (float32 logits of one
  ``train.logit_chunks`` slice, embedding and output head gathered over ``fsdp``) and, in the CPU program, the
  optimizer update (XLA:CPU holds the new parameters and moments beside the old ones until the non-finite check
  picks; it dominates where the state is sharded little and the activations are small).
- Step time: matmul FLOPs (model FLOPs plus the remat recompute) at the measured GEMM rate, attention at the
  attention kernel's rate, elementwise traffic at HBM bandwidth, and each collective at the NVLink or the
  network bandwidth of the axis it runs over. Gathers and gradient reductions over ``fsdp``/``data`` (and the
  gradient sums over ``sequence``, which also splits the tokens of a step but no parameter) overlap
  with compute (XLA's latency-hiding scheduler); tensor and expert collectives sit between dependent matmuls and
  are counted in full, as is the all-gather of keys and values over ``sequence`` (context parallelism: each
  layer's keys depend on its input, so nothing can fetch them ahead).

The few copy counts below (how many buffers of a kind are live at the peak) were read off XLA's buffer
assignment of compiled steps; ``benchmarks/plan_validation.md`` compares the totals with the compiler's.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
from flax import nnx

from jaxtron.config.schema import Config, ExecutionConfig, ModelConfig
from jaxtron.metrics.flops import flops_breakdown, hardware_flops_breakdown
from jaxtron.models import build_model
from jaxtron.models.moe import capacity
from jaxtron.ops.attention import cpu_implementation, resolve_implementation
from jaxtron.ops.blockwise import block_size
from jaxtron.parallel.mesh import full_sizes, split_over_nodes
from jaxtron.parallel.sharding import logical_names, logical_to_spec
from jaxtron.parallel.stages import padding
from jaxtron.planning.gpus import GPU
from jaxtron.training.pipeline import bubble_fraction

# live copies at the peak, per kind of buffer (see the module docstring)
LAYER_COPIES = 1.65  # one block's intermediates during its backward: recomputed values and their gradients
MOE_COPIES = 1.5  # the MoE block's exchange buffers and expert hidden values (rows padded to the worst case)
SCORE_COPIES = 3.0  # XLA attention's float32 [batch, heads, q, k] arrays in the backward: scores, probs, grads
BLOCK_SCORE_COPIES = 4.0  # blockwise attention's float32 arrays of one pair of blocks in the backward: s, p, dp, ds
ATTENTION_BLOCK = 512  # blockwise attention's block of queries and of keys (ops/blockwise.py)
# cuDNN by chunks on a sharded sequence (ops/chunked.py), in the block's backward, in units of the gathered keys
# and values: a call's copy with the document's keys first, its 16-bit gradients, those put back in column order,
# and their sum over the two chunks (assumed: a GPU program cannot be compiled here; benchmarks/README.md has the
# CPU compile of the same structure with the XLA kernel in cuDNN's place)
CHUNK_KV_COPIES = 4.0
WEIGHT_COPIES = 2.0  # gathered block weights besides their float32 gradient: this block's and the next one's
LOGIT_COPIES = 2.0  # float32 logits of one slice: the logits and their gradient
HEAD_COPIES = 2.0  # embedding and output head gathered over fsdp besides their gradient
UPDATE_COPIES = 3.0  # XLA:CPU's update: new float32 parameters and both moments, before the skip-or-apply select
# elementwise traffic of one block per token, in units of (h + q + 2k + f): norms, rotary, residual adds,
# activation function and casts, forward only (the backward moves about twice as much)
ELEMENTWISE_PASSES = 6.0


@dataclasses.dataclass(frozen=True)
class Param:
    path: str  # e.g. 'moe_layers.mlp.wo'
    shape: tuple[int, ...]
    names: tuple[str | None, ...]

    @property
    def in_blocks(self) -> bool:
        """A stacked block parameter: of the periods a pipeline runs, or of the blocks outside it."""
        return bool(self.names) and self.names[0] in ("layers", "unstaged_layers")

    @property
    def staged(self) -> bool:
        """A parameter of the periods a pipeline schedule runs (each stage holds its own)."""
        return bool(self.names) and self.names[0] == "layers"

    def shard_elements(self, sizes: dict[str, int], without: tuple[str, ...] = ()) -> int:
        """Elements one device holds (ceil division, as jax pads uneven shards); ``without``: mesh axes whose
        sharding is undone (e.g. 'fsdp' for the gathered weights)."""
        total = 1
        for dim, axes in zip(self.shape, logical_to_spec(self.names)):
            axes = () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)
            ways = math.prod(sizes.get(a, 1) for a in axes if a not in without)
            total *= -(-dim // ways)
        return total


@functools.lru_cache(maxsize=8)
def parameters(model: ModelConfig) -> tuple[Param, ...]:
    """Shapes and logical names of the model's parameters (abstract: nothing is allocated)."""
    state = jax.eval_shape(lambda: nnx.split(build_model(model, ExecutionConfig(), 0, "xla"), nnx.Param)[1])
    return tuple(Param(".".join(map(str, path)), tuple(v.get_value().shape), logical_names(v))
                 for path, v in nnx.to_flat_state(state))


@dataclasses.dataclass
class Estimate:
    mesh: dict[str, int]
    microbatches: int
    pipeline_microbatches: int  # in flight per pipeline pass (0: no pipeline schedule)
    bubble: float  # the pipeline schedule's idle share
    identity_layers: int  # blocks that fill an uneven pipeline split (pipeline.uneven_stages)
    attention: str  # the attention implementation the estimate assumes
    memory: dict[str, float]  # bytes per device by term
    time: dict[str, float]  # seconds per step by term
    exposed: tuple[str, ...]  # time terms that add to the step (the others overlap with compute)
    overlapped: tuple[str, ...]
    step_s: float
    mfu: float
    tokens_per_s: float
    collectives: dict[str, float]  # bytes per step and device, by collective kind

    @property
    def memory_bytes(self) -> float:
        return sum(self.memory.values())

    @property
    def comm_s(self) -> float:
        """Seconds of communication per step, overlapped or not."""
        return sum(v for k, v in self.time.items() if k not in COMPUTE_TERMS)

    @property
    def dominant(self) -> str:
        """The term that sets the step time: the overlapped communication when it outlasts the compute,
        else the largest exposed term."""
        compute = sum(self.time[k] for k in self.exposed if k in COMPUTE_TERMS)
        hidden = sum(self.time[k] for k in self.overlapped)
        if hidden > compute:
            return max(self.overlapped, key=self.time.get)
        return max(self.exposed, key=self.time.get)


COMPUTE_TERMS = ("matmul", "attention", "elementwise", "pipeline_bubble")


def estimate(cfg: Config, sizes: dict[str, int], gpu: GPU, microbatches: int | None = None,
             cpu_program: bool = False, pipeline_microbatches: int | None = None) -> Estimate:
    """Per-device memory and step time of ``cfg`` on the mesh ``sizes`` of ``gpu``s.

    ``microbatches`` defaults to ``train.microbatches``. ``cpu_program``: estimate the program XLA:CPU compiles
    for the dry run instead of the GPU's: XLA attention, and 16-bit values held in float32 (XLA:CPU has no
    16-bit matmul, so it converts their operands: the block weights are gathered in float32 and the saved
    residual stream is converted to float32 once more before the backward pass; a pipelined program also holds a
    copy of the AdamW moments through the loss's backward pass).
    """
    sizes = full_sizes(sizes)
    m, run, n_dev = cfg.model, cfg.execution, math.prod(sizes.values())
    micro = microbatches or cfg.train.microbatches
    stages = sizes["pipeline"]
    in_flight, virtual = cfg.pipeline.schedule(stages)
    in_flight = pipeline_microbatches or in_flight
    pipelined = (stages, in_flight) != (1, 1)
    iterations = in_flight * virtual + stages - 1 if pipelined else 1
    bubble = bubble_fraction(stages, in_flight, virtual)
    # a stage runs its blocks in every iteration, the fill and drain included (on zeros): their collectives run
    # this many times as often as the microbatches' useful work needs
    busy = iterations / (in_flight * virtual) if pipelined else 1.0
    # an uneven split runs identity periods too (pipeline.uneven_stages): they cost a period's memory and work
    period = m.period
    pads = padding(m.stack_periods, stages, virtual)
    run_m = dataclasses.replace(m, num_layers=m.num_layers + pads * period) if pads else m  # the blocks run
    # blocks outside the schedule (a dense prefix, the prediction modules)
    outside = m.prefix_layers + m.mtp_depth
    staged_blocks = run_m.num_layers - m.prefix_layers
    impl = cpu_implementation(run.attention, run.dtype, m.qk_head_dim, sizes["sequence"]) if cpu_program \
        else resolve_implementation(run.attention, run.dtype, m.qk_head_dim, sizes["sequence"], backend="gpu")
    T, S, E, F = sizes["tensor"], sizes["sequence"], sizes["expert"], sizes["fsdp"]
    chunks = impl == "cudnn" and S > 1  # cuDNN by chunks of the load-balanced layout (ops/chunked.py)
    dp = sizes["data"] * F * E
    c = 2 if run.dtype == "bfloat16" else 4
    s = cfg.data.seq_len
    t = s // S
    rows = cfg.train.global_batch_size // micro // dp  # rows per device and (accumulation) microbatch
    b = rows // in_flight  # rows each block call runs on (a pipeline microbatch)
    # the work outside the schedule (embedding, those blocks, head, loss) splits its rows over the stages too
    # where they divide (jaxtron.training.pipeline.Schedule.outside); else every stage runs all of its rows
    spread = stages if stages > 1 and rows % stages == 0 else 1
    outside_rows = rows / spread  # rows per device of the work outside the schedule
    # blocks this stage runs per microbatch, the idle iterations' included, in full-row equivalents
    layers_here = staged_blocks // stages * busy + outside / spread
    h, f, d = m.embed_dim, m.mlp_dim, m.qk_head_dim  # latent attention: values padded to the query-key size
    nq, nk = m.num_heads * d // T, m.num_kv_heads * d // T
    ft = f // T
    s_kv = s if S > 1 else t
    params = parameters(m)

    # state: float32 parameters, two AdamW moments, gradients (+ the microbatch accumulator)
    shard = sum(p.shard_elements(sizes) for p in params)
    memory = {"parameters": 4.0 * shard, "optimizer": 8.0 * shard,
              "gradients": 4.0 * shard * (2 if micro > 1 else 1),
              "batch": 5 * 4.0 * rows * micro * t}

    # byte sizes: c in the GPU program; XLA:CPU holds 16-bit intermediates and gathered weights in float32
    work_c = 4 if cpu_program else c
    stack_copy = 4 if cpu_program and c < 4 else 0  # XLA:CPU's float32 copy of the saved residual stack

    # one block's forward values, in elements per device and microbatch: the residual stream whole (x, as the
    # projections take it) and split over the tensor group (xs, as it runs between them)
    x = b * t * h
    xs = x // T
    attn = {"q": b * t * nq, "kv": 2 * b * s_kv * nk, "out": b * t * nq}
    if m.latent_attention:  # the low-rank query, the key-value latent and the shared rotated key
        attn["latent"] = b * t * (m.q_lora_rank + m.kv_lora_rank + m.qk_rope_head_dim)
    mlp = {"gate_up": 2 * b * t * ft, "act": b * t * ft}
    heads = m.num_heads // T
    scores = b * heads * t * s_kv if impl == "xla" else 0  # float32 [batch, heads, q, k] (flash: none)
    # the block input, its two norms, two residual sums and the MLP output split; both normed inputs gathered
    everything = 6 * xs + (2 * x if T > 1 else 0) + sum(attn.values()) + sum(mlp.values())
    # save_dots keeps the projections' outputs: the two of residual width are whole (before their reduce-scatter)
    saved = {"none": everything, "full": xs, "save_attention": xs + attn["out"],
             "save_dots": xs + 2 * x + attn["q"] + attn["kv"] + mlp["gate_up"],
             "save_dots_attention": xs + 2 * x + attn["q"] + attn["kv"] + attn["out"] + mlp["gate_up"]}[run.remat]
    saved_scores = 2 * scores if run.remat == "none" else 0  # scores and probabilities kept for the backward
    moe_layers = run_m.num_moe_layers
    tokens = b * t
    k = m.experts_per_token
    moe_rows = 0
    if moe_layers:  # rows each device's expert GEMMs run over: worst-case (dropless) or capacity buffers
        moe_rows = tokens * k * E if run.moe_mode == "dropless" else \
            m.num_experts * b * capacity(m, run.capacity_factor, t)
    fe = m.resolved_expert_dim // T
    moe_values = moe_rows * (2 * h + 3 * fe) + 2 * tokens * k * h  # buffers in and out, hidden; sorted rows
    moe_saved = moe_values if run.remat in ("none", "save_dots", "save_dots_attention") else 0
    # every iteration of the schedule leaves the saved values of the blocks the stage ran, the idle ones of the
    # fill and drain included (they compute on zeros): iterations x blocks of one pass, for a pipeline microbatch
    passes, per_pass = (iterations, virtual * stages) if pipelined else (1, 1)
    mtp_moe = m.mtp_depth if m.num_experts else 0
    block_saved = saved * c + xs * stack_copy + saved_scores * 4.0
    memory["activations"] = float(passes * (staged_blocks // per_pass * block_saved
                                            + moe_layers // per_pass * moe_saved * c)
                                  # the blocks outside the schedule run once on all of its rows
                                  + in_flight / spread * (outside * block_saved + mtp_moe * moe_saved * c))
    if pipelined:  # the schedule's carries: each iteration's stage input, and every microbatch's latest output
        memory["pipeline_buffers"] = float((iterations + in_flight) * xs * work_c)

    per_block = {}  # elements of one block's weights gathered over fsdp, per stack ('layers', 'moe_layers')
    for p in params:
        if p.in_blocks:
            stack = p.path.split(".")[0]
            whole = p.shard_elements(sizes, without=("fsdp", "pipeline"))  # the whole stack, one block of each
            per_block[stack] = per_block.get(stack, 0) + whole // p.shape[0]
    block_weights = max(per_block.values())
    flash = 0.0  # blockwise attention's backward: float32 gradients of the gathered keys and values, of the
    if impl == "blockwise":  # local queries, and the arrays of one pair of blocks
        pair = b * heads * block_size(t, ATTENTION_BLOCK) * block_size(s_kv, ATTENTION_BLOCK)
        flash = 4.0 * (attn["kv"] + attn["q"] + BLOCK_SCORE_COPIES * pair)
    elif chunks:
        flash = c * CHUNK_KV_COPIES * attn["kv"]
    layer_work = ((LAYER_COPIES * everything + MOE_COPIES * (moe_values if moe_layers else 0)) * work_c
                  + SCORE_COPIES * scores * 4.0 + flash
                  + block_weights * (WEIGHT_COPIES * work_c + 4.0))  # gathered copies and the float32 gradient
    vocab = m.vocab_size // T
    head_params = [p for p in params if not p.in_blocks and "vocab" in p.names]
    head_gathered = sum(p.shard_elements(sizes, without=("fsdp",)) for p in head_params)
    loss_work = (LOGIT_COPIES * 4.0 * outside_rows * t * vocab / cfg.train.logit_chunks
                 + head_gathered * (HEAD_COPIES * work_c + 4.0)
                 # a pipelined program on XLA:CPU copies the AdamW moments before the loss's backward pass
                 + (memory["optimizer"] if cpu_program and pipelined else 0.0))
    # XLA:CPU's optimizer update holds the new state beside the old until the step's finiteness check picks one
    # (a GPU's fusions write it in place of the donated state; unmeasured there, so not counted)
    update_work = UPDATE_COPIES * 4.0 * shard if cpu_program else 0.0
    memory["working"] = float(max(layer_work, loss_work, update_work))

    # --- time ---
    peak = gpu.peak_flops["bfloat16"] if run.dtype == "bfloat16" else gpu.peak_flops["bfloat16"] / 2  # fp32: TF32
    terms = flops_breakdown(m, s)
    # model FLOPs plus what the remat policy re-runs, from the table HFU uses (jaxtron.metrics.flops.RECOMPUTED)
    hardware = hardware_flops_breakdown(run_m, run, s, attention=impl)
    step_tokens = cfg.train.global_batch_size * s
    matmul = sum(v for k, v in hardware.items() if k != "attention_scores")
    # by chunks, a chunk's first document is computed twice on its own keys (once merged with its earlier keys):
    # at most a diagonal block per chunk, 1 / (2 x sequence) of a device's causal work
    scores_flops = hardware["attention_scores"] * (1 + 1 / (2 * S) if chunks else 1)
    attention_eff = gpu.attention_efficiency if impl == "cudnn" else gpu.xla_attention_efficiency
    forward_passes = 3 + (1 if run.remat == "full" else 0)  # forward, backward (twice the traffic), recompute
    # bytes per device: a tensor group of T devices shares its tokens and splits all of the work, the
    # residual-width values along the sequence and the head and MLP widths across
    elementwise = (ELEMENTWISE_PASSES * forward_passes * (staged_blocks + outside * stages / spread)
                   * (h // T + nq + 2 * nk + ft) * c * step_tokens / (n_dev / T))
    # unless the stages split their rows, the output head and the blocks outside the schedule run on every stage
    # for its data-parallel rows (replicated over the pipeline axis)
    if stages > 1 and spread == 1:
        inner = hardware_flops_breakdown(dataclasses.replace(run_m, num_layers=staged_blocks, first_dense_layers=0,
                                                             mtp_depth=0), run, s, attention=impl)
        repeated = {k: v - (inner[k] if k != "logits" else 0.0) for k, v in hardware.items()}
        matmul += sum(v for k, v in repeated.items() if k != "attention_scores") * (stages - 1)
        scores_flops += repeated["attention_scores"] * (stages - 1)
    time = {"matmul": matmul * step_tokens / n_dev / (peak * gpu.matmul_efficiency),
            "attention": scores_flops * step_tokens / n_dev / (peak * attention_eff),
            "elementwise": elementwise / gpu.hbm_bandwidth}
    # the stages idle through the fill and drain: the bubble's share of the schedule's iterations
    time["pipeline_bubble"] = sum(time.values()) * bubble / (1 - bubble)

    across = split_over_nodes(sizes, max(1, n_dev // gpu.gpus_per_node)) if n_dev > gpu.gpus_per_node else \
        {a: 1 for a in sizes}

    def bandwidth(axis: str) -> float:
        return gpu.network_bandwidth if across[axis] > 1 else gpu.nvlink_bandwidth

    coll = {"all-gather": 0.0, "reduce-scatter": 0.0, "all-reduce": 0.0, "all-to-all": 0.0}

    def ring(kind: str, axis: str | tuple[str, ...], whole_bytes: float, times: float) -> float:
        """Seconds of ``times`` collectives over ``axis`` (one mesh axis, or several as one group of devices;
        ring algorithms at the slowest of their links) on ``whole_bytes`` buffers: an all-gather's result, a
        reduce-scatter's input, what an all-reduce reduces (as ``jaxtron.metrics.collectives`` counts them)."""
        axes = (axis,) if isinstance(axis, str) else axis
        n = math.prod(sizes[a] for a in axes)
        if n == 1 or whole_bytes == 0:
            return 0.0
        coll[kind] += times * whole_bytes
        moved = whole_bytes * (n - 1) / n * (2 if kind == "all-reduce" else 1)
        return times * moved / min(bandwidth(a) for a in axes)

    gathers = 2 * micro  # forward and the backward's recompute/use: the weights are gathered twice per step
    gathered = {True: 0, False: 0}  # elements gathered over fsdp: the staged blocks' and the rest
    for p in params:
        gathered[p.staged] += p.shard_elements(sizes, without=("fsdp",))
    # a pipeline stage gathers its blocks' weights again in every iteration of the schedule, and reduce-scatters
    # their gradients in every iteration of its backward pass
    time["fsdp_comm"] = (ring("all-gather", "fsdp", work_c * gathered[True], gathers * in_flight * busy)
                         + ring("all-gather", "fsdp", work_c * gathered[False], gathers)
                         + ring("reduce-scatter", "fsdp", 4.0 * gathered[True], micro * in_flight * busy)
                         + ring("reduce-scatter", "fsdp", 4.0 * gathered[False], micro))
    # the axes that split the batch's tokens but not (all) the parameters sum the gradients of what they do not
    # shard, in one all-reduce over all of them: every parameter over ``data`` and ``sequence`` (the tokens of
    # a row; no parameter is split over it), and over ``expert`` too where it is not an expert's
    grad_sync = 0.0
    for expert_owned in (False, True):
        axes = ("data", "sequence") if expert_owned else ("data", "sequence", "expert")
        over = sum(p.shard_elements(sizes) for p in params if ("experts" in p.names) == expert_owned)
        grad_sync += ring("all-reduce", axes, 4.0 * over, micro)
    if spread > 1:  # the stages' gradients of what they all hold (embedding, head, blocks outside) are summed
        grad_sync += ring("all-reduce", "pipeline", 4.0 * sum(p.shard_elements(sizes) for p in params
                                                             if not p.staged), micro)
    time["data_comm"] = grad_sync
    layer_passes = forward_passes  # forward, backward, recompute
    # per block: the attention and MLP outputs reduce-scattered and their normed inputs all-gathered over the
    # tensor group in each forward pass (an all-reduce's traffic in two halves), twice as many in the backward
    # pass, plus the loss's hidden-state gradient
    tensor_reductions = (2 * (layer_passes - 2) + 4) * layers_here * micro * in_flight
    time["tensor_comm"] = (ring("reduce-scatter", "tensor", x * work_c, tensor_reductions)
                           + ring("all-gather", "tensor", x * work_c, tensor_reductions)
                           + ring("all-reduce", "tensor", 4.0 * outside_rows * t * h, micro))
    block_calls = layers_here * micro * in_flight
    if impl == "blockwise" or chunks:  # keys and values gathered in the forward pass and its recomputation;
        # their gradients reduce-scattered back in the backward pass
        time["sequence_comm"] = (ring("all-gather", "sequence", attn["kv"] * work_c,
                                      (2 if run.remat != "none" else 1) * block_calls)
                                 + ring("reduce-scatter", "sequence", attn["kv"] * work_c, block_calls))
    else:
        time["sequence_comm"] = ring("all-gather", "sequence", attn["kv"] * work_c, (layer_passes - 1) * block_calls)
    if moe_layers and E > 1:
        exchange = moe_rows * h * work_c
        time["expert_comm"] = ring("all-to-all", "expert", exchange,
                                   2 * (layer_passes - 1) * (moe_layers // stages * busy + mtp_moe / spread) * micro
                                   * in_flight)
    else:
        time["expert_comm"] = 0.0
    # each schedule iteration moves one microbatch's activations a stage on (the residual stream between blocks,
    # split over the tensor group): a permute forward, and in the backward pass the shift back and the wrap-around
    # from the first stage to the last as two (on two stages XLA mostly runs them as one swap, as compiled on
    # pipeline=2 x fsdp=4; tests/test_plan.py); the finished microbatches, kept on the first stage, reach the rest
    # once per step (forward and backward); between dependent steps
    boundary = xs * work_c
    collected = rows * t * h // T * work_c
    if stages > 1:
        hops = 2.0 if stages == 2 else 3.0
        coll["collective-permute"] = (hops * iterations * boundary + 2.0 * collected) * micro
    time["pipeline_comm"] = coll.get("collective-permute", 0.0) / bandwidth("pipeline")
    if spread > 1:  # the rows come together for the schedule and part after it: an all-gather each way
        time["pipeline_comm"] += ring("all-gather", "pipeline", collected, 2 * micro)
    overlapped = ("fsdp_comm", "data_comm")
    exposed = ("matmul", "attention", "elementwise", "pipeline_bubble", "tensor_comm", "sequence_comm",
               "expert_comm", "pipeline_comm")
    compute = sum(time[k] for k in COMPUTE_TERMS)
    step = max(compute, sum(time[k] for k in overlapped)) + sum(time[k] for k in exposed if k not in COMPUTE_TERMS)
    model_flops = sum(terms.values()) * step_tokens / n_dev
    return Estimate(mesh=dict(sizes), microbatches=micro, pipeline_microbatches=in_flight if pipelined else 0,
                    bubble=bubble, identity_layers=pads * period, attention=impl, memory=memory, time=time,
                    exposed=exposed, overlapped=overlapped, step_s=step,
                    mfu=model_flops / step / gpu.peak_flops["bfloat16"], tokens_per_s=step_tokens / step,
                    collectives=coll)
