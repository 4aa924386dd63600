"""Enumerate the meshes of a GPU count, estimate each, rank them; refuse with a reason when none fits."""

from __future__ import annotations

import dataclasses
import math

from jaxtron.config.schema import MESH_AXES, Config, ConfigError, MeshConfig
from jaxtron.ops.attention import HOPPER, cudnn_unsupported
from jaxtron.parallel.checks import check_devices
from jaxtron.parallel.mesh import full_sizes, split_over_nodes
from jaxtron.parallel.sharding import shard_count
from jaxtron.planning.estimate import AUTO, AUTO_ORDER, Estimate, estimate, with_remat
from jaxtron.planning.gpus import GPU
from jaxtron.planning.params import optimizer_elements, parameters, state_elements

GIB = 2.0**30


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def with_mesh(cfg: Config, sizes: dict[str, int]) -> Config:
    """``cfg`` on these mesh sizes; its pipeline microbatches become the stage count when they were fewer, and
    layers that the stages do not split evenly are filled up with identity layers (``pipeline.uneven_stages``,
    which the estimate counts and the table shows)."""
    stages = sizes.get("pipeline", 1)
    pipeline = cfg.pipeline
    if pipeline.microbatches and pipeline.microbatches < stages:
        pipeline = dataclasses.replace(pipeline, microbatches=stages)
    if stages > 1:
        pipeline = dataclasses.replace(pipeline, uneven_stages=True)
    return dataclasses.replace(cfg, mesh=MeshConfig(**sizes), pipeline=pipeline)


def layout_problem(cfg: Config, sizes: dict[str, int], gpu: GPU) -> str | None:
    """Why the mesh cannot run this model on whole nodes of ``gpu``, or None."""
    n = math.prod(sizes.values())
    try:
        check_devices(with_mesh(cfg, sizes), n)
    except ConfigError as e:
        return str(e)
    sizes = full_sizes(sizes)
    if sizes["tensor"] > gpu.gpus_per_node:
        return f"tensor = {sizes['tensor']} exceeds the {gpu.gpus_per_node} GPUs of a node"
    if n > gpu.gpus_per_node:
        across = split_over_nodes(sizes, n // gpu.gpus_per_node)
        # an expert group may span nodes (its tokens cross the network, its weights stay put): the mesh lays it
        # over as few nodes as the axes outside it leave (parallel/mesh.py), and the estimate prices its exchanges
        if across["tensor"] > 1:
            return "tensor groups would span nodes"
    return None


def candidate_meshes(cfg: Config, n: int, gpu: GPU) -> list[dict[str, int]]:
    """Every mesh of ``n`` devices that divides the model and keeps tensor groups inside a node (expert groups may
    span nodes).
    A dense model gets no expert axis (it would only be another name for data parallelism)."""
    out = []
    for pipeline in divisors(n):
        for tensor in divisors(n // pipeline):
            if tensor > gpu.gpus_per_node:
                continue
            rest = n // pipeline // tensor
            for expert in divisors(rest) if cfg.model.moe.num_experts else [1]:
                for sequence in divisors(rest // expert):
                    for fsdp in divisors(rest // expert // sequence):
                        data = rest // expert // sequence // fsdp
                        sizes = dict(pipeline=pipeline, data=data, fsdp=fsdp, sequence=sequence, expert=expert,
                                     tensor=tensor)
                        if layout_problem(cfg, sizes, gpu) is None:
                            out.append({a: sizes[a] for a in MESH_AXES})
    return out


@dataclasses.dataclass
class Row:
    estimate: Estimate
    fits: bool


def _microbatch_options(cfg: Config, sizes: dict[str, int]) -> list[int]:
    """Microbatch counts from the config's up, each leaving a whole number of rows per device (and per pipeline
    microbatch, at least one per stage)."""
    rows = cfg.train.global_batch_size // shard_count(sizes, "activation_batch")
    stages = shard_count(sizes, "layers")
    return [k for k in divisors(rows) if k >= cfg.train.microbatches and (rows // k) % stages == 0]


def _in_flight_options(cfg: Config, sizes: dict[str, int], microbatches: int) -> list[int | None]:
    """Pipeline microbatch counts to try on a pipeline mesh: the config's (at least one per stage), then the stage
    count times 2, 4, 8, ... up to one row a microbatch, each splitting the rows of a device evenly (more: a
    smaller bubble, a smaller working set, more stage hops); [None] (the config's) without a pipeline."""
    stages = shard_count(sizes, "layers")
    if stages == 1:
        return [None]
    rows = cfg.train.global_batch_size // microbatches // shard_count(sizes, "activation_batch")
    wanted, m = {cfg.pipeline.sizes(stages)[0]}, 2 * stages
    while m <= rows:
        wanted.add(m)
        m *= 2
    return sorted(m for m in wanted if m >= stages and rows % m == 0) or [None]


def _one_f_one_b(cfg: Config, sizes: dict[str, int]) -> list[Config]:
    """``cfg`` with the 1F1B schedule, and with the interleaved one (``cfg``'s virtual stages, else 2) where each
    stage's periods split evenly into those chunks, on a pipeline mesh; none elsewhere."""
    stages = shard_count(sizes, "layers")
    if stages == 1:
        return []
    base = dataclasses.replace(cfg, pipeline=dataclasses.replace(cfg.pipeline, schedule="1f1b", virtual_stages=1,
                                                                 fsdp_gather="iteration"),
                               train=dataclasses.replace(cfg.train, microbatches=1))
    virtual = max(cfg.pipeline.virtual_stages, 2)
    # an uneven split is filled up with identity periods. Not for MoE stacks: DeepSeek-V3's published layout
    # (pipeline=16 expert=64, +6 identity) prices at 31.8 s interleaved on the H100 target against 16.3 fill-drain,
    # where the planner had the interleaved schedule faster
    uneven = cfg.model.stack_periods % (stages * virtual)
    if cfg.model.stack_periods < stages * virtual or (uneven and cfg.model.moe.num_experts):
        return [base]
    return [base, dataclasses.replace(base, pipeline=dataclasses.replace(base.pipeline, schedule="interleaved",
                                                                         virtual_stages=virtual))]


def _one_f_one_b_options(cfg: Config, sizes: dict[str, int]) -> list[int]:
    """1F1B's pipeline microbatch counts: the stage count times 1, 2, 4, ... up to a device's whole batch, one row
    a microbatch (its memory does not grow with them, so more only shrink the bubble)."""
    stages = shard_count(sizes, "layers")
    rows = cfg.train.global_batch_size // shard_count(sizes, "activation_batch")
    out, m = [], stages
    while m <= rows:
        if rows % m == 0:
            out.append(m)
        m *= 2
    return out


def _optimizer_options(cfg: Config, sizes: dict[str, int]) -> list[Config]:
    """``cfg``, and ``cfg`` with the distributed optimizer where the config has it off and it shrinks the moments
    by a tenth or more (where the mesh replicates weights over axes that split the batch's tokens)."""
    params = parameters(cfg.model)
    if cfg.optimizer.distributed or optimizer_elements(params, sizes, True) > 0.9 * state_elements(params, sizes):
        return [cfg]
    return [cfg, dataclasses.replace(cfg, optimizer=dataclasses.replace(cfg.optimizer, distributed=True))]


def _exchange_options(cfg: Config, sizes: dict[str, int], gpu: GPU) -> list[Config]:
    """``cfg``, and where the expert axis spans nodes and the config leaves the choice open (0) ``cfg`` sending its
    dropless rows once per node (``execution.moe_node_shards``, the expert shards of one node): the network then
    carries a row for each node a token's experts lie on, not one for each expert, for larger buffers (each node's
    device at one's place may send one a row for each of its tokens)."""
    x, n = cfg.execution, math.prod(sizes.values())
    if not cfg.model.moe.num_experts or x.moe_mode != "dropless" or x.moe_node_shards or x.moe_exchange == "padded" \
            or n <= gpu.gpus_per_node:
        return [cfg]
    across = split_over_nodes(sizes, n // gpu.gpus_per_node)["expert"]
    if across == 1:
        return [cfg]
    return [cfg, dataclasses.replace(cfg, execution=dataclasses.replace(x, moe_node_shards=sizes["expert"] // across))]


def _attention_options(cfg: Config, sizes: dict[str, int]) -> list[Config]:
    """``cfg``, and where 'auto' would run the blockwise kernel on a split sequence ``cfg`` with cuDNN by chunks
    (``ops/chunked.py``) where that can run: no windows, attention chunks or sinks, a head cuDNN takes on Hopper.
    The planner prices the blockwise kernel at its compiled programs' rate (``GPU.blockwise_attention_efficiency``)."""
    x, m = cfg.execution, cfg.model
    parts = shard_count(sizes, "activation_length")
    if x.attention != "auto" or parts == 1 or m.attention.local or m.attention.sinks \
            or cudnn_unsupported(x.dtype, m.qk_head_dim, parts, "gpu", HOPPER):
        return [cfg]
    return [cfg, dataclasses.replace(cfg, execution=dataclasses.replace(x, attention="cudnn"))]


def best_for_mesh(cfg: Config, sizes: dict[str, int], gpu: GPU) -> Row:
    """With execution.remat='auto': the fastest row of the policies of ``AUTO_ORDER`` that fits (the earlier
    policy on a tie), else the leanest's. Otherwise: the mesh with the fewest microbatches that fit (more
    microbatches: less activation memory, more weight gathers) and, on a pipeline mesh, the fastest schedule and
    count of pipeline microbatches among those that fit (more: a smaller bubble, more weight gathers and stage
    hops; fill-drain's memory grows with them, 1F1B's does not), with or without the distributed optimizer (the
    same traffic in one microbatch, less with more; less memory: the leaner wins a tie); if none fits, the
    estimate with the most microbatches."""
    if cfg.execution.remat == AUTO:
        rows = [best_for_mesh(with_remat(cfg, policy), sizes, gpu) for policy in AUTO_ORDER]
        fitting = [r for r in rows if r.fits]
        return min(fitting, key=lambda r: round(r.estimate.step_s, 3 - _digits(r.estimate.step_s))) if fitting \
            else rows[-1]
    est = None
    variants = [v for a in _attention_options(cfg, sizes) for c in _exchange_options(a, sizes, gpu)
                for v in _optimizer_options(c, sizes)]
    options = _microbatch_options(cfg, sizes)
    params = parameters(cfg.model)
    # the float32 weights, their gradients and the leanest moments alone outgrow the GPU: no option can fit
    floor = 8.0 * state_elements(params, sizes) + 8.0 * optimizer_elements(params, sizes, True)
    if options and floor > gpu.usable_bytes:
        return Row(estimate(variants[-1], sizes, gpu, microbatches=options[-1]), False)
    for k in options:
        fitting = []
        for option in variants:
            for m in _in_flight_options(option, sizes, k):
                est = estimate(option, sizes, gpu, microbatches=k, pipeline_microbatches=m)
                if est.memory_bytes <= gpu.usable_bytes:
                    fitting.append(est)
            for one_f_one_b in _one_f_one_b(option, sizes) if k == 1 else []:
                gathers = [one_f_one_b]  # and with a stage's weights gathered over fsdp once a step
                if sizes.get("fsdp", 1) > 1:
                    gathers.append(dataclasses.replace(
                        one_f_one_b, pipeline=dataclasses.replace(one_f_one_b.pipeline, fsdp_gather="step")))
                for schedule_cfg in gathers:
                    for m in _one_f_one_b_options(schedule_cfg, sizes):
                        candidate = estimate(schedule_cfg, sizes, gpu, microbatches=1, pipeline_microbatches=m)
                        if candidate.memory_bytes <= gpu.usable_bytes:
                            fitting.append(candidate)
        if fitting:
            return Row(min(fitting, key=lambda e: (round(e.step_s, 3 - _digits(e.step_s)), e.memory_bytes)), True)
    return Row(est, False)


def plan(cfg: Config, n: int, gpu: GPU) -> list[Row]:
    """All valid meshes of ``n`` GPUs, the ones that fit first, fastest first. Ties (the same step time to three
    figures, e.g. two compute-bound meshes) go to the mesh that communicates less, which depends least on
    overlap working out, then to the one using less memory."""
    rows = [best_for_mesh(cfg, sizes, gpu) for sizes in candidate_meshes(cfg, n, gpu)]
    return sorted(rows, key=lambda r: (not r.fits, round(r.estimate.step_s, 3 - _digits(r.estimate.step_s)),
                                       r.estimate.comm_s, r.estimate.memory_bytes))


def _digits(x: float) -> int:
    """Digits before the point, so steps are compared to 3 significant figures."""
    return math.floor(math.log10(x)) + 1 if x > 0 else 0


def refusal(cfg: Config, n: int, gpu: GPU, rows: list[Row]) -> str:
    """One sentence: why no mesh of ``n`` GPUs fits, and the first of 2n, 4n, ... GPUs on which one does."""
    from jaxtron.metrics.flops import param_count

    params = param_count(cfg.model)
    state = 16.0 * params / n
    if not rows:
        return (f"no mesh of {n} GPUs divides the model and batch (heads, kv heads, MLP width, vocabulary, experts "
                f"and the global batch {cfg.train.global_batch_size} must divide by the axes); change --gpus or the "
                "batch.")
    least = min(rows, key=lambda r: r.estimate.memory_bytes)
    need = _fewest_gpus(cfg, n, gpu)
    more = f"; doubling the GPU count, the first on which a mesh fits is {need}" if need else ""
    if state > gpu.usable_bytes:
        why = (f"{params / 1e9:.1f}B parameters need {16 * params / 1e12:.2f} TB for float32 weights, gradients and "
               f"AdamW moments (16 bytes each), {state / GIB:.0f} GiB per GPU even fully sharded over {n} GPUs, "
               f"above the {gpu.usable_bytes / GIB:.0f} GiB usable on an {gpu.name}")
    else:
        why = (f"the leanest mesh ({mesh_text(least.estimate.mesh)}, {least.estimate.microbatches} microbatches) "
               f"needs {least.estimate.memory_bytes / GIB:.0f} GiB per GPU, above the {gpu.usable_bytes / GIB:.0f} "
               f"GiB usable on an {gpu.name}")
    return f"{why}{more}."


def _fewest_gpus(cfg: Config, n: int, gpu: GPU) -> int | None:
    count = n * 2
    while count <= 65536:
        rows = plan(cfg, count, gpu)
        if rows and rows[0].fits:  # fitting rows sort first
            return count
        count *= 2
    return None


def mesh_text(sizes: dict[str, int]) -> str:
    return " ".join(f"{a}={v}" for a, v in sizes.items() if v > 1) or "one device"
