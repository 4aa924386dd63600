"""Per-device memory of a training step, term by term.

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

The few copy counts below (how many buffers of a kind are live at the peak) were read off XLA's buffer
assignment of compiled steps, XLA:CPU's and the H100 target's (``GPU_*``: the program a GPU runs, compiled without
one, ``jaxtron/gpu/target.py``); ``benchmarks/plan_validation.md`` compares the totals with both compilers'.
"""

from __future__ import annotations

from jaxtron.config.schema import ONE_F_ONE_B, Config
from jaxtron.ops.blockwise import block_size
from jaxtron.planning.params import Param, optimizer_elements, state_elements
from jaxtron.planning.shape import BlockValues, StepShape
from jaxtron.planning.working_copy import working_copy_bytes
from jaxtron.training.optimizer import matrix_dimensions

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
# dropless experts on jax.lax.ragged_dot (XLA:CPU, and XLA:GPU with execution.expert_gemm=xla): the [local experts,
# rows, ...] arrays of its dense expansion, in units of ``BlockValues.moe_expanded`` (fitted on the Qwen3-30B-A3B
# and DeepSeek-V3 dropless pairs of benchmarks/plan_validation.md, 16 and 32 local experts: 2.9 and 3.0)
EXPANDED_COPIES = 3.0

# The GPU program (XLA:GPU for the H100 target, jaxtron/gpu/target.py) differs, fitted on its compiled steps
# (benchmarks/plan_validation.md: 39 (model, mesh) pairs of 1B to 671B, dense and MoE; XLA's allocation peak,
# which includes the gaps its heap leaves between buffers, so these are effective counts rather than buffers one
# can point to):
GPU_LOGIT_COPIES = 1.1  # the float32 logits of one slice
# the logits' gradient, which the loss makes in its forward pass in the compute dtype (ops/cross_entropy.py) while the
# float32 logits are live, in units of that gradient's bytes (XLA frees part of the logits as it writes it), and the
# share of a step's (or microbatch's) gradients not yet made while the loss runs in the forward pass, without a
# pipeline schedule: fitted together on the 39 pairs of benchmarks/plan_validation.md compiled at the loss's change
# (a grid of 0 to 1 by quarters each, with GPU_LOGIT_COPIES 0.75 to 1.1: the one that keeps every pair within 10%)
GPU_LOGIT_GRADIENT_COPIES = 0.5
GPU_FORWARD_LOSS_FREE_GRADIENTS = 0.25
GPU_HEAD_COPIES = 0.75  # embedding and output head gathered over fsdp in 16 bits (freed as their GEMMs end)
# DPO's and GRPO's per-token log-probabilities (ops/cross_entropy.target_log_probs) differentiated by jax: GRPO's
# float32 logits, their softmax and their gradient live at once (three copies of the whole, 23.5 GiB, in its step
# of Llama-3 8B at 4 layers, 64 rows of 2048 tokens, tensor=8 H100s); DPO's cotangent is the mask times one number a
# row, and XLA fuses one copy away (2.04 fitted on 32 rows on the same mesh). Of one slice with train.logit_chunks.
GPU_PER_TOKEN_LOGIT_COPIES = {"grpo": 3.0, "dpo": 2.0}
GPU_LAYER_COPIES = 1.1  # one block's intermediates during its backward (LAYER_COPIES on XLA:CPU)
GPU_TENSOR_GATHER_COPIES = 3.0  # the normed inputs gathered over the tensor group (16-bit), their gradients, sums
GPU_WEIGHT_COPIES = 0.75  # gathered block weights (16-bit; their float32 gradients are reduce-scattered at once)
GPU_MOE_COPIES = 1.5  # the MoE block's exchange buffers and expert hidden values (MOE_COPIES on XLA:CPU)
# dropless experts on a grouped GEMM kernel (ops/grouped.py, ops/grouped_fp8.py): the weight gradients of a block's
# local experts, which the kernels return in float32 (all three matrices live at once)
GPU_EXPERT_GRADIENT_COPIES = 1.0
# The share of the step's gradients not yet made while fill-drain's loss runs (between the schedule's forward and
# backward passes; XLA starts some of their accumulators early; fitted on the pipeline pairs)
GPU_LOSS_FREE_GRADIENTS = 0.5
# A stacked weight whose fsdp-sharded dimension is not the one right after the stack's (the output projections:
# [layers, ..., embed]; the experts': [layers, experts, embed, ...]) is gathered one block at a time from a
# float32 copy of the whole stack that XLA:GPU transposes so that dimension comes first, made once per step and
# held through it (read off the buffer assignments of the H100 compiles). One such copy per weight:
GPU_LAYOUT_COPIES = 1.0
# cuDNN's flash backward accumulates the query gradient in float32 in a workspace that cuDNN sizes on the device:
# a compile without a GPU cannot see it (the call's workspace is empty there), so it is estimated, not compared
# A loop body of several dense blocks (a period of the local/global pattern, Gemma 3's six) keeps each block past
# the first's saved values and float32 residual stream once more while it runs. Gemma 3 12B at 6 layers, fsdp=8, on
# the H100 target: a period of 6 took 1.0, 4.6 and 4.2 GiB more than periods of 1 under full, save_dots and
# save_dots_attention; this term gives 0.9, 4.5 and 4.8. gpt-oss's period of two MoE blocks took 0.1 GiB more: MoE
# blocks are left out.
GPU_PERIOD_RESIDUAL_BYTES = 4.0
CUDNN_WORKSPACE_Q_BYTES = 4.0
UNSEEN_ON_TARGET = ("cudnn_workspace",)  # terms a compile without the GPU cannot see


def state_memory(cfg: Config, shape: StepShape, params: tuple[Param, ...]) -> dict[str, float]:
    """Bytes of the train state and the batch: float32 parameters, two AdamW moments (one momentum for Muon's
    matrices), gradients (+ the microbatch accumulator), and the step's five int32 batch arrays. Under the
    distributed optimizer the parameters (masters), the moments and the accumulator hold their shard over the
    batch's axes (``state_sharding.optimizer_spec``), and the step holds its working copy (``working_copy.py``)."""
    shard = state_elements(params, shape.mesh)
    moments = optimizer_elements(params, shape.mesh, cfg.optimizer.distributed)
    distributed = cfg.optimizer.distributed  # float32 masters split as the moments, and the step's working copy
    return {"parameters": 4.0 * (moments if distributed else shard),
            "working_copy": working_copy_bytes(params, shape.mesh, shape.value_bytes) if distributed else 0.0,
            "optimizer": 4.0 * (2 * moments - muon_momenta(cfg, shape, params)),
            "gradients": 4.0 * shard + (4.0 * moments if shape.microbatches > 1 else 0.0),
            "batch": 5 * 4.0 * shape.rows * shape.microbatches * shape.local_len}


def saved_per_block(cfg: Config, block: BlockValues, gpu: bool = False) -> tuple[int, int, int]:
    """Elements one block keeps for its backward pass under ``execution.remat``: (values in the compute dtype,
    float32 attention scores or softmax statistics, MoE values in the compute dtype); ``gpu``: of the GPU's
    program."""
    remat, xs, attn = cfg.execution.remat, block.residual_split, block.attention
    # save_dots keeps the projections' outputs. The two of residual width: XLA:CPU keeps them whole (before their
    # reduce-scatter over the tensor group), XLA:GPU split. Llama-3 8B, fsdp x tensor = 8, 4096 tokens, batch 8, H100
    # target: the compiled peak under save_dots stays 27.5-28.6 GiB from tensor=2 to 8, while counting them whole
    # gave 32.0, 35.7 and 42.7 GiB.
    x = xs if gpu else block.residual
    saved = {"none": block.everything, "full": xs, "save_attention": xs + attn["out"],
             "save_dots": xs + 2 * x + attn["q"] + attn["kv"] + block.mlp["gate_up"],
             "save_dots_attention": xs + 2 * x + attn["q"] + attn["kv"] + attn["out"] + block.mlp["gate_up"]}[remat]
    scores = 2 * block.scores if remat == "none" else 0  # scores and probabilities kept for the backward
    if remat in ("none", "save_attention", "save_dots_attention"):  # with the output, cuDNN's softmax statistics
        scores += block.attention_stats
    moe = block.moe_values if remat in ("none", "save_dots", "save_dots_attention") else 0
    return saved, scores, moe


def activation_memory(cfg: Config, shape: StepShape, block: BlockValues) -> dict[str, float]:
    """Bytes of the values saved for the backward pass ('activations') and of a pipeline schedule's carries
    ('pipeline_buffers', with a pipeline only)."""
    c = shape.value_bytes
    if shape.schedule in ONE_F_ONE_B:  # each period's input for the units between their forward and backward
        v = shape.virtual_stages  # (interleaved: a unit is a chunk of 1/V of the stage's periods)
        kept = min(2 * v * shape.stages - 1, shape.in_flight * v)
        periods = (shape.staged_blocks // cfg.model.period) // (shape.stages * v)
        return {"activations": float(kept * periods * block.residual_split * c),
                # the activations moving one stage on and the gradients one stage back
                "pipeline_buffers": float(2 * block.residual_split * shape.work_bytes)}
    saved, saved_scores, moe_saved = saved_per_block(cfg, block, not shape.cpu_program)
    # every iteration of the schedule leaves the saved values of the blocks the stage ran, the idle ones of the
    # fill and drain included (they compute on zeros): iterations x blocks of one pass, for a pipeline microbatch
    passes, per_pass = (shape.iterations, shape.virtual_stages * shape.stages) if shape.pipelined else (1, 1)
    block_saved = saved * c + block.residual_split * shape.stack_copy_bytes + saved_scores * 4.0
    memory = {"activations": float(passes * (shape.staged_blocks // per_pass * block_saved
                                             + shape.moe_layers // per_pass * moe_saved * c)
                                   # the blocks outside the schedule run once on all of its rows
                                   + shape.in_flight / shape.spread * (shape.outside_blocks * block_saved
                                                                       + shape.outside_moe_layers * moe_saved * c))}
    if shape.pipelined:  # the schedule's queue of every microbatch's latest output, and its gradient
        memory["pipeline_buffers"] = float(2 * shape.in_flight * block.residual_split * shape.work_bytes)
    return memory


def period_memory(cfg: Config, shape: StepShape, block: BlockValues) -> dict[str, float]:
    """Bytes a GPU program's loop body of several dense blocks holds besides one block's (``GPU_PERIOD_RESIDUAL_BYTES``
    says what was measured)."""
    dense = sum(not kind.moe for kind in cfg.model.period_blocks())
    if shape.cpu_program or dense < 2 or shape.schedule in ONE_F_ONE_B:
        return {}
    saved, saved_scores, _ = saved_per_block(cfg, block, gpu=True)
    per_block = saved * shape.value_bytes + saved_scores * 4.0 + block.residual_split * GPU_PERIOD_RESIDUAL_BYTES
    return {"period_copies": float((dense - 1) * per_block)}


def gpu_terms(shape: StepShape, block: BlockValues, params: tuple[Param, ...]) -> dict[str, float]:
    """Bytes only the GPU program holds: the float32 copies of weight stacks it gathers in another layout and
    cuDNN's workspace (``CUDNN_WORKSPACE_Q_BYTES`` per query element, for the flash backward). (A pipeline
    schedule's backward loop adds its gradients into the step's own: fill-drain's loop runs period by period and
    1F1B's accumulators are the step's gradients.)"""
    if shape.cpu_program:
        return {}
    terms = {}
    if shape.mesh.get("fsdp", 1) > 1:
        transposed = sum(p.shard_elements(shape.mesh) for p in params
                         if p.in_blocks and p.sharded_dims("fsdp")[:1] not in ((), (1,)))
        if transposed:
            terms["layout_copies"] = GPU_LAYOUT_COPIES * 4.0 * transposed
    if shape.attention == "cudnn":
        terms["cudnn_workspace"] = CUDNN_WORKSPACE_Q_BYTES * block.attention["q"]
    return terms


def gathered_stage(shape: StepShape, params: tuple[Param, ...]) -> dict[str, float]:
    """``pipeline.fsdp_gather='step'``: a stage's float32 weights whole over fsdp through the schedule, and its
    gradient accumulator whole beside the step's sharded gradients."""
    if not shape.gather_once:
        return {}
    whole = sum(p.gathered_elements(shape.mesh) for p in params if p.staged)
    return {"gathered_stage": 4.0 * whole * 2}


def block_work(shape: StepShape, block: BlockValues, params: tuple[Param, ...]) -> float:
    """Bytes of working space in one block's backward pass."""
    per_block = {}  # elements of one block's weights gathered over fsdp, per stack ('layers', 'moe_layers')
    for p in params:
        if p.in_blocks:
            stack = p.path.split(".")[0]
            whole = p.gathered_elements(shape.mesh, also=("pipeline",))  # the whole stack, one block of each
            per_block[stack] = per_block.get(stack, 0) + whole // p.shape[0]
    block_weights = max(per_block.values())
    expert_grads = 0.0  # dropless experts: their kernels' float32 weight gradients, or ragged_dot's expansion
    if shape.expert_kernel:
        local = sum(p.gathered_elements(shape.mesh, also=("pipeline",)) // p.shape[0]
                    for p in params if p.in_blocks and "experts" in p.names)
        expert_grads = GPU_EXPERT_GRADIENT_COPIES * 4.0 * local
    elif block.moe_expanded:
        expert_grads = EXPANDED_COPIES * block.moe_expanded * shape.work_bytes
    flash = 0.0  # blockwise attention's backward: float32 gradients of the gathered keys and values, of the
    if shape.attention == "blockwise":  # local queries, and the arrays of one pair of blocks
        pair = (shape.block_rows * block.heads * block_size(shape.local_len, ATTENTION_BLOCK)
                * block_size(shape.kv_len, ATTENTION_BLOCK))
        flash = 4.0 * (block.attention["kv"] + block.attention["q"] + BLOCK_SCORE_COPIES * pair)
    elif shape.chunks:
        flash = shape.value_bytes * CHUNK_KV_COPIES * block.attention["kv"]
    work_c = shape.work_bytes
    moe = (block.moe_values if shape.moe_layers else 0) * work_c
    if not shape.cpu_program:
        gathered = 2 * block.residual if shape.mesh.get("tensor", 1) > 1 else 0  # the normed inputs, whole
        return ((GPU_LAYER_COPIES * (block.everything - gathered) + GPU_TENSOR_GATHER_COPIES * gathered) * work_c
                + GPU_MOE_COPIES * moe + SCORE_COPIES * block.scores * 4.0 + flash
                + block_weights * GPU_WEIGHT_COPIES * work_c + expert_grads)
    return (LAYER_COPIES * block.everything * work_c + MOE_COPIES * moe + SCORE_COPIES * block.scores * 4.0 + flash
            + block_weights * (WEIGHT_COPIES * work_c + 4.0) + expert_grads)  # gathered copies, float32 gradient


def loss_work(cfg: Config, shape: StepShape, block: BlockValues, params: tuple[Param, ...],
              optimizer_bytes: float, gradient_bytes: float = 0.0, made_bytes: float = 0.0) -> float:
    """Bytes of working space in the loss and its backward pass, beyond the step's state; ``optimizer_bytes``:
    the AdamW moments', ``gradient_bytes``: the gradients' (accumulators included), ``made_bytes``: those of the
    gradients one pass makes (a step's or a microbatch's)."""
    head_params = [p for p in params if not p.in_blocks and "vocab" in p.names]
    head_gathered = sum(p.gathered_elements(shape.mesh) for p in head_params)
    # the 1F1B schedule runs the head and loss on one pipeline microbatch at a time
    rows = shape.block_rows if shape.schedule in ONE_F_ONE_B else shape.outside_rows
    logits = 4.0 * rows * shape.local_len * block.vocab / cfg.train.logit_chunks
    if not shape.cpu_program and cfg.train.objective in ("dpo", "grpo"):
        copies = GPU_PER_TOKEN_LOGIT_COPIES[cfg.train.objective]
        return copies * logits + GPU_HEAD_COPIES * head_gathered * shape.work_bytes
    if not shape.cpu_program:
        work = ((GPU_LOGIT_COPIES + GPU_LOGIT_GRADIENT_COPIES * shape.work_bytes / 4.0) * logits
                + GPU_HEAD_COPIES * head_gathered * shape.work_bytes)
        if shape.pipelined and shape.schedule not in ONE_F_ONE_B:
            # fill-drain's loss runs between the schedule's forward pass and its backward pass, which makes the
            # gradients: its working space takes the place of those not yet made
            work -= GPU_LOSS_FREE_GRADIENTS * gradient_bytes
        elif not shape.pipelined:  # the loss runs in the forward pass (its gradient made there), before the backward
            work -= GPU_FORWARD_LOSS_FREE_GRADIENTS * made_bytes
        return work
    return (LOGIT_COPIES * logits
            + head_gathered * (HEAD_COPIES * shape.work_bytes + 4.0)
            # a pipelined program on XLA:CPU copies the AdamW moments before the loss's backward pass
            + (optimizer_bytes if shape.pipelined else 0.0))


def update_work(cfg: Config, shape: StepShape, params: tuple[Param, ...]) -> float:
    """Bytes of working space in the optimizer update."""
    # XLA:CPU's optimizer update holds the new state beside the old until the step's finiteness check picks one
    # (a GPU's fusions write it in place of the donated state; unmeasured there, so not counted)
    if not shape.cpu_program:
        return 0.0
    moments = optimizer_elements(params, shape.mesh, cfg.optimizer.distributed)
    return UPDATE_COPIES / 3 * 4.0 * (state_elements(params, shape.mesh) + 2 * moments
                                      - muon_momenta(cfg, shape, params))


def muon_momenta(cfg: Config, shape: StepShape, params: tuple[Param, ...]) -> int:
    """Elements one device holds of the matrices Muon updates (one momentum each, where AdamW holds two moments);
    0 under AdamW."""
    if cfg.optimizer.name != "muon":
        return 0
    matrices = tuple(p for p in params if matrix_dimensions(p.names))
    return optimizer_elements(matrices, shape.mesh, cfg.optimizer.distributed)


def saved_shards(cfg: Config, shape: StepShape, params: tuple[Param, ...]) -> dict[str, float]:
    """XLA:CPU's program without a checkpoint (remat 'none'), in float32, without a pipeline: a projection that
    gathers its fsdp-split weight again in the backward pass (``state_sharding.gathered_einsum``, a custom VJP)
    saves the layer's shard, which the layer scan then holds as a copy of the parameter stack (the default model on
    data=2 fsdp=4: 1.10 MiB a device more, against 1.50 counted here). The H100 program's peak is unchanged (bf16
    and float32), and so is a 16-bit cast's on XLA:CPU (a new array, saved either way)."""
    if not shape.cpu_program or cfg.execution.remat != "none" or shape.pipelined or shape.value_bytes != 4:
        return {}
    shards = sum(p.shard_elements(shape.mesh) for p in params
                 if p.projection and p.gathered_elements(shape.mesh) != p.shard_elements(shape.mesh))
    return {"saved_shards": 4.0 * shards} if shards else {}


def memory(cfg: Config, shape: StepShape, block: BlockValues, params: tuple[Param, ...]) -> dict[str, float]:
    """Bytes per device by term: the state, the batch, the saved activations (and pipeline carries), and the
    working space of the step's largest phase."""
    terms = state_memory(cfg, shape, params)
    terms.update(activation_memory(cfg, shape, block))
    terms.update(period_memory(cfg, shape, block))
    terms.update(gpu_terms(shape, block, params))
    terms.update(gathered_stage(shape, params))
    terms.update(saved_shards(cfg, shape, params))
    terms["working"] = float(max(block_work(shape, block, params),
                                 loss_work(cfg, shape, block, params, terms["optimizer"], terms["gradients"],
                                           terms["parameters"]),
                                 update_work(cfg, shape, params)))
    return terms
