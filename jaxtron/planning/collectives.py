"""The collectives of a training step: bytes per collective kind, and their seconds by the mesh axes they run over.

Each collective runs at NVLink's bandwidth inside a node, and across nodes at the network's, on as many NICs at once
as its group has devices in a node (``Collectives.group_bandwidth``). Gathers and gradient
reductions over ``fsdp``/``data`` (and the gradient sums over ``sequence``, which also splits the tokens of a step
but no parameter) overlap with compute (XLA's latency-hiding scheduler); tensor and expert collectives sit between
dependent matmuls and are counted in full, as is the all-gather of keys and values over ``sequence`` (context
parallelism: each layer's keys depend on its input, so nothing can fetch them ahead).
"""

from __future__ import annotations

import math

from jaxtron.config.model import MoEConfig
from jaxtron.config.schema import ONE_F_ONE_B, Config
from jaxtron.parallel.mesh import split_over_nodes
from jaxtron.parallel.timetable import forward_iterations, iterations
from jaxtron.planning import muon
from jaxtron.planning.gpus import GPU
from jaxtron.planning.params import Param
from jaxtron.planning.shape import BlockValues, StepShape


class Collectives:
    """The collectives of one step on one device: ``ring`` and ``permute`` return their seconds and add their bytes
    to ``bytes`` (per step and device, by collective kind)."""

    def __init__(self, mesh: dict[str, int], gpu: GPU):
        self.mesh = mesh
        devices = math.prod(mesh.values())
        # how many nodes each mesh axis spans
        self.across = split_over_nodes(mesh, max(1, devices // gpu.gpus_per_node)) \
            if devices > gpu.gpus_per_node else {a: 1 for a in mesh}
        self.gpu = gpu
        self.bytes = {"all-gather": 0.0, "reduce-scatter": 0.0, "all-reduce": 0.0, "all-to-all": 0.0}

    def bandwidth(self, axis: str) -> float:
        """Bus bandwidth of a collective over ``axis``: the network's where the axis spans nodes, else NVLink's."""
        return self.gpu.network_bandwidth if self.across[axis] > 1 else self.gpu.nvlink_bandwidth

    def group_bandwidth(self, axes: tuple[str, ...]) -> float:
        """Bus bandwidth of a ring collective over the devices of ``axes`` together: NVLink's inside a node; across
        nodes each of the group's devices in a node drives its own NIC (NCCL's channels run one ring per NIC, each
        crossing between nodes once), so the network carries the group's bytes at its per-GPU bandwidth times the
        group's devices in a node, up to NVLink's (which the ring's hops inside the node take)."""
        nodes = math.prod(self.across[a] for a in axes)
        if nodes == 1:
            return self.gpu.nvlink_bandwidth
        local = math.prod(self.mesh[a] for a in axes) // nodes
        return min(self.gpu.nvlink_bandwidth, local * self.gpu.network_bandwidth)

    def ring(self, kind: str, axis: str | tuple[str, ...], whole_bytes: float, times: float) -> float:
        """Seconds of ``times`` collectives over ``axis`` (one mesh axis, or several as one group of devices) on
        ``whole_bytes`` buffers: an all-gather's result, a reduce-scatter's input, what an all-reduce reduces (as
        ``jaxtron.metrics.collectives`` counts them), at the group's bus bandwidth (``group_bandwidth``)."""
        axes = (axis,) if isinstance(axis, str) else tuple(axis)
        n = math.prod(self.mesh[a] for a in axes)
        if n == 1 or whole_bytes == 0:
            return 0.0
        self.bytes[kind] += times * whole_bytes
        moved = whole_bytes * (n - 1) / n * (2 if kind == "all-reduce" else 1)
        return times * moved / self.group_bandwidth(axes)

    def all_to_all(self, axis: str, whole_bytes: float, times: float, peers: int | None = None,
                   step: int = 1) -> float:
        """Seconds of ``times`` all-to-alls over ``axis`` sending ``whole_bytes`` each, evenly to ``peers`` of its
        devices (default all of them; the rows once per node go to the device at each node's same place, ``step``
        apart, then within the node, consecutive): the share for the devices of other nodes crosses the network
        while the share for this node's devices crosses NVLink, both at once; one's own share stays put."""
        n = self.mesh[axis]
        peers = peers or n
        if peers == 1 or whole_bytes == 0:
            return 0.0
        self.bytes["all-to-all"] += times * whole_bytes
        local = min(peers, max(1, n // self.across[axis] // step))  # the peers in this node
        network = whole_bytes * (peers - local) / peers / self.gpu.network_bandwidth
        nvlink = whole_bytes * (local - 1) / peers / self.gpu.nvlink_bandwidth
        return times * max(network, nvlink)

    def permute(self, axis: str, whole_bytes: float) -> float:
        """Seconds of collective-permutes over ``axis`` that move ``whole_bytes`` in all."""
        self.bytes["collective-permute"] = whole_bytes
        return whole_bytes / self.bandwidth(axis)


def fsdp_time(shape: StepShape, params: tuple[Param, ...], coll: Collectives) -> float:
    """The weights gathered over the batch's axes that split them (fsdp, and expert for the weights outside the
    experts: ``Param.gather_axes``) and their gradients reduce-scattered back, each group of weights over its own
    devices together; the gradients of weights the rules table does not split over fsdp (DeepSeek-V3's
    up-projections of the latents, say, whose dimensions are latent, heads and head size) summed over it instead,
    those weights never gathered."""
    micro = shape.microbatches
    gathers = 2 * micro  # forward and the backward's recompute/use: the weights are gathered twice per step
    rest_gathers, rest_sums = gathers, micro
    if shape.schedule in ONE_F_ONE_B:  # the embedding and head run per microbatch: forward, head, embedding backward
        # (interleaved: the embedding and the head in each of a microbatch's V forward iterations)
        rest_gathers = (2 * shape.virtual_stages + 1) * shape.in_flight
        rest_sums = 1 if shape.gather_once else 2 * shape.in_flight
    # per set of gathering axes and (staged blocks, the rest): elements gathered, their bytes as gathered for use
    # (``gather_width``), their gradients' bytes (``gradient_width``)
    by_axes: dict[tuple[tuple[str, ...], bool], list[float]] = {}
    replicated = 0.0  # gradient bytes of the weights whole on every fsdp device
    for p in params:
        axes = p.gather_axes(shape.mesh)
        if not axes:
            replicated += gradient_width(shape, p) * p.shard_elements(shape.mesh)
            continue
        whole = p.gathered_elements(shape.mesh)
        sums = by_axes.setdefault((axes, p.staged), [0.0, 0.0, 0.0])
        sums[0] += whole
        sums[1] += gather_width(shape, p) * whole
        sums[2] += gradient_width(shape, p) * whole
    # a pipeline stage gathers its blocks' weights again in every iteration of the schedule, and reduce-scatters
    # their gradients in every iteration of its backward pass; with ``pipeline.fsdp_gather='step'`` once a step
    # (the float32 weights, and the whole accumulator)
    in_flight, busy = shape.in_flight, shape.busy
    seconds = coll.ring("all-reduce", "fsdp", replicated, rest_sums)
    for (axes, staged), (gathered, used, summed) in by_axes.items():
        if not staged:
            seconds += (coll.ring("all-gather", axes, used, rest_gathers)
                        + coll.ring("reduce-scatter", axes, summed, rest_sums))
        elif shape.gather_once:
            seconds += (coll.ring("all-gather", axes, 4.0 * gathered, 1)
                        + coll.ring("reduce-scatter", axes, 4.0 * gathered, 1))
        else:
            seconds += (coll.ring("all-gather", axes, used, gathers * in_flight * busy)
                        + coll.ring("reduce-scatter", axes, summed, micro * in_flight * busy))
    return seconds


def gather_width(shape: StepShape, p: Param) -> float:
    """Bytes per element of ``p`` as gathered over fsdp for use: a projection weight of an FP8 block is gathered
    after it is quantized (one byte: ``ops/fp8.einsum``), the rest in the compute dtype."""
    if p.projection:
        return shape.fp8_share * 1.0 + (1.0 - shape.fp8_share) * shape.work_bytes
    return float(shape.work_bytes)


def gradient_width(shape: StepShape, p: Param) -> float:
    """Bytes per element of ``p``'s gradient where the backward pass sums it over a batch axis: a block weight's
    is the compute dtype's (its 16-bit copy's gradient, summed before it is converted to float32: compiled for the
    H100 target), the embedding's, the head's and the norms' outside the blocks float32."""
    return float(shape.work_bytes) if p.in_blocks else 4.0


def data_time(cfg: Config, shape: StepShape, params: tuple[Param, ...], coll: Collectives) -> float:
    """The gradient sums over the axes that split the batch's tokens but not (all) the parameters; under the
    distributed optimizer (``optimizer.distributed``) reduce-scatters and one all-gather of the updated weights,
    which move what the all-reduces would in one microbatch.

    How often: a dense model sums once a step, without a pipeline whatever its microbatches and under the 1F1B
    schedule whatever its pipeline microbatches (each device's rows accumulate apart, ``training/step.py``,
    ``training/pipeline/one_f_one_b.py``); an MoE model's 1F1B stages sum as each microbatch's backward runs, its
    head and embedding as each microbatch's head and embedding backward run; fill-drain's stages sum their weights'
    16-bit gradients once per accumulation microbatch (XLA moves the sum out of the schedule's loop, whose backward
    pass adds each period's gradient into one accumulator: ``training/pipeline/fill_drain.py``), but with virtual
    stages in every iteration of the backward pass (each stage picks its round's weights at an index of its own,
    which keeps the sum in the loop; compiled for the H100 target); otherwise once per accumulation microbatch."""
    dense = not (shape.moe_layers or shape.outside_moe_layers)
    once = dense and not (shape.pipelined or cfg.model.mtp.depth)
    distributed = cfg.optimizer.distributed
    grad_sync = 0.0
    for over_expert in (False, True):  # weights split over expert (an expert's, or gathered over it) sum without it
        axes = ("data", "sequence") if over_expert else ("data", "sequence", "expert")
        for staged in (False, True):
            weights = [p for p in params if bool(p.sharded_dims("expert")) == over_expert and p.staged == staged]
            over = sum(p.shard_elements(shape.mesh) for p in weights)
            # what is summed: a float32 accumulator of the step's microbatches, or each microbatch's gradients
            # where its backward pass makes them (``gradient_width``)
            accumulated, scattered = True, distributed
            if shape.schedule in ONE_F_ONE_B:
                times = 1 if dense else shape.in_flight * (1 if staged else 2)
            elif shape.pipelined and staged:  # fill-drain: the 16-bit weight gradients, summed after the loop
                # (virtual stages: in each iteration of its backward pass), whole under the distributed optimizer
                # too (its accumulator is split as the parameters)
                times, accumulated, scattered = shape.microbatches, False, False
                if shape.virtual_stages > 1:
                    times *= shape.in_flight * shape.busy
            else:
                times = 1 if once else shape.microbatches
                accumulated = once and shape.microbatches > 1
            summed = 4.0 * over if accumulated else sum(gradient_width(shape, p) * p.shard_elements(shape.mesh)
                                                        for p in weights)
            # reduce-scattered onto the moments' shards, and the updated weights gathered once
            if scattered:
                grad_sync += (coll.ring("reduce-scatter", axes, summed, times)
                              + coll.ring("all-gather", axes, 4.0 * over, 1))
            else:
                grad_sync += coll.ring("all-reduce", axes, summed, times)
    if shape.spread > 1:  # the stages' gradients of what they all hold (embedding, head, blocks outside) are summed
        unstaged = sum(p.shard_elements(shape.mesh) for p in params if not p.staged)
        grad_sync += coll.ring("all-reduce", "pipeline", 4.0 * unstaged, shape.microbatches)
    return grad_sync


def tensor_time(shape: StepShape, block: BlockValues, coll: Collectives) -> float:
    """The tensor group's reduce-scatters and all-gathers around each block's projections, and the loss's."""
    # per block: the attention and MLP outputs reduce-scattered and their normed inputs all-gathered over the
    # tensor group each time the block's forward runs (an all-reduce's traffic in two halves: the forward and its
    # recomputation), and as many in its backward pass (each one's transpose), plus the loss's hidden-state
    # gradient. Without the forward's recomputation XLA gathers the normed inputs once more: again in the backward
    # (``save_dots``) or in float32 in the forward (``none``). Compiled for H100s (Llama-3 8B fsdp=4 tensor=2, 70B
    # fsdp=8 tensor=8) the blocks moved 12 residuals' bytes each under full remat (5 reduce-scatters, 6
    # all-gathers, one of them float32), 10 without it (4 and 6), as counted
    blocks = shape.layers_per_stage * shape.microbatches * shape.in_flight
    reductions = 2 * (shape.forward_passes - 1) * blocks
    gathers = reductions + (2 * blocks if shape.forward_passes == 3 else 0)
    residual = block.residual * shape.work_bytes
    return (coll.ring("reduce-scatter", "tensor", residual, reductions)
            + coll.ring("all-gather", "tensor", residual, gathers)
            + coll.ring("all-reduce", "tensor", 4.0 * shape.outside_rows * shape.local_len * block.embed,
                        shape.microbatches))


def sequence_time(cfg: Config, shape: StepShape, block: BlockValues, coll: Collectives) -> float:
    """The keys and values gathered over ``sequence`` (context parallelism)."""
    block_calls = shape.layers_per_stage * shape.microbatches * shape.in_flight
    kv = block.attention["kv"] * shape.work_bytes
    if shape.attention == "blockwise" or shape.chunks:  # keys and values gathered in the forward pass and its
        # recomputation; their gradients reduce-scattered back in the backward pass
        return (coll.ring("all-gather", "sequence", kv, (2 if cfg.execution.remat != "none" else 1) * block_calls)
                + coll.ring("reduce-scatter", "sequence", kv, block_calls))
    return coll.ring("all-gather", "sequence", kv, (shape.forward_passes - 1) * block_calls)


def expert_time(cfg: Config, shape: StepShape, block: BlockValues, coll: Collectives) -> float:
    """The MoE blocks' all-to-all exchanges over ``expert``: in dropless mode the routed rows alone (the ragged
    exchange a GPU runs), in capacity mode the capacity slots. Each block exchanges twice (rows out, outputs home)
    in its forward pass and in its backward pass, and sends its rows out once more when its forward is recomputed:
    under every remat policy but 'none', since none of them saves an exchange's result. The way home is not
    recomputed: the backward pass needs no expert output (``models/experts.py`` weights the hidden values), and the
    H100 compile of DeepSeek-V3 moves 5/6 of the rows it did when it was. The router weights travelling with the
    rows (4 bytes a row) are left out. Rows sent once per node (``execution.moe_node_shards``) cross
    between nodes once for each node a token's experts lie on (``nodes_reached``), then within the node as before."""
    if not (shape.moe_layers and shape.expert > 1):
        return 0.0
    exchange = block.moe_exchanged * block.embed * shape.work_bytes
    moe_blocks = shape.moe_blocks()
    exchanges = 5 if cfg.execution.remat != "none" or shape.forward_passes > 3 else 4
    times = exchanges * moe_blocks * shape.microbatches * shape.in_flight
    per_node, moe = cfg.execution.moe_node_shards, cfg.model.moe
    if cfg.execution.moe_mode == "dropless" and 0 < per_node < shape.expert:  # once per node, then within it
        nodes = shape.expert // per_node
        rows = block.moe_exchanged / moe.experts_per_token * nodes_reached(moe, nodes)
        crossing = rows * (block.embed * shape.work_bytes + 8 * moe.experts_per_token)  # with ids and weights
        return (coll.all_to_all("expert", crossing, times, peers=nodes, step=per_node)
                + coll.all_to_all("expert", exchange, times, peers=per_node))
    return coll.all_to_all("expert", exchange, times)


def nodes_reached(moe: MoEConfig, nodes: int) -> float:
    """How many of ``nodes`` (holding the experts in order, as many each) a token's experts lie on, on average.
    Drawn evenly (the softmax router, or groups that do not line up with nodes): the chance that a node holds none
    of k experts drawn among all. Where the sigmoid router's groups lie whole in nodes or the nodes in groups, a
    token reaches only the nodes of its top groups (node-limited routing), and since a group is chosen for its best
    experts it reaches nearly all of them (3.97 of 4 for DeepSeek-V3's router on random scores): all of them."""
    experts, k = moe.num_experts, moe.experts_per_token
    if moe.router == "sigmoid" and moe.router_groups > 1:
        router_groups, top = moe.router_groups, moe.router_top_groups
        if router_groups % nodes == 0:
            return float(min(nodes, top, k))
        if nodes % router_groups == 0:
            return float(min(nodes, top * nodes // router_groups, k))
    per_node = experts // nodes
    return nodes * (1.0 - math.comb(experts - per_node, k) / math.comb(experts, k))


def pipeline_time(shape: StepShape, block: BlockValues, coll: Collectives) -> float:
    """The pipeline stages' exchanges of activations."""
    boundary = block.residual_split * shape.work_bytes  # a microbatch's stream between stages, one device's share
    collected = shape.rows * shape.local_len * block.embed // shape.tensor * shape.work_bytes
    if shape.stages > 1 and shape.schedule in ONE_F_ONE_B:
        return one_f_one_b_exchanges(shape, boundary, collected, coll)
    seconds = 0.0
    if shape.stages > 1:
        # each iteration moves one microbatch's activations a stage on: a permute forward, and in the backward pass
        # the shift back and the wrap-around from the first stage to the last as two (as compiled on pipeline=2 x
        # fsdp=4 and pipeline=4 x fsdp=2; tests/test_plan.py). The first stage keeps the finished microbatches: a
        # sum over the stages once per accumulation microbatch and, in the backward pass, a gather of their gradient
        seconds = (coll.permute("pipeline", 3.0 * shape.iterations * boundary * shape.microbatches)
                   + coll.ring("all-reduce", "pipeline", collected, shape.microbatches)
                   + coll.ring("all-gather", "pipeline", collected, shape.microbatches))
    if shape.spread > 1:  # the rows come together for the schedule and part after it: an all-gather each way
        seconds += coll.ring("all-gather", "pipeline", collected, 2 * shape.microbatches)
    return seconds


def one_f_one_b_exchanges(shape: StepShape, boundary: float, collected: float, coll: Collectives) -> float:
    """Seconds of the 1F1B loop's exchanges between stages, 5 boundaries' bytes an iteration on the H100 target
    (tests/test_gpu_tensor_overlap.py, GPT-3 175B's published layout). Every iteration (``timetable.iterations``,
    the fill and drain included) shifts forward and back, the wrap-around with it (two permutes). The iterations
    that run the forward phase (``timetable.forward_iterations``: the drain's run none) also send the head its
    pieces and take their gradients back (two all-to-alls, ``training/pipeline/head_pieces.py``) and, on a tensor
    group, sum the embedding lookup, which XLA runs in another device order (a permute there and back across
    stages, the all-reduce over the tensor group)."""
    stages, in_flight, virtual = shape.stages, shape.in_flight, shape.virtual_stages
    runs = iterations(stages, in_flight, virtual) * shape.microbatches
    forward = forward_iterations(stages, in_flight, virtual) * shape.microbatches
    lookup = forward if shape.tensor > 1 else 0.0
    # the head whole on every stage instead: the finished microbatches reach the rest by permutes from the last
    # stage, forward and backward
    whole = 0.0 if shape.spread > 1 else 2.0 * collected * shape.microbatches
    seconds = coll.permute("pipeline", (2.0 * runs + lookup) * boundary + whole)
    seconds += coll.ring("all-reduce", "tensor", boundary, lookup)
    return seconds + (coll.all_to_all("pipeline", boundary, 2 * forward) if shape.spread > 1 else 0.0)


def sums_after_the_loop(shape: StepShape) -> bool:
    """Whether the gradient sums over data run outside a pipeline's loop, nothing beside them: a dense model's 1F1B
    step sums once, after its loop, and gathers the distributed optimizer's working copy before it. GPT-3 175B's
    published layout on the H100 target: the 21.7 GB reduce-scatter had 0.018 s of kernels in its window, the
    11.6 GB gather 0.032 s (the overlap counter; tests/test_gpu_target.py checks a cut of Llama-3 8B)."""
    dense = not (shape.moe_layers or shape.outside_moe_layers)
    return dense and shape.pipelined and shape.schedule in ONE_F_ONE_B


def communication_time(cfg: Config, shape: StepShape, block: BlockValues, params: tuple[Param, ...],
                       gpu: GPU) -> tuple[dict[str, float], dict[str, float]]:
    """(seconds per step by communication term, bytes per step and device by collective kind)."""
    coll = Collectives(shape.mesh, gpu)
    data = data_time(cfg, shape, params, coll)
    after = data if sums_after_the_loop(shape) and gpu.prices_jaxtron else 0.0  # Megatron overlaps them
    time = {"fsdp_comm": fsdp_time(shape, params, coll),
            "data_comm": data - after,
            "data_comm_after_loop": after,
            "tensor_comm": tensor_time(shape, block, coll),
            "sequence_comm": sequence_time(cfg, shape, block, coll),
            "expert_comm": expert_time(cfg, shape, block, coll),
            "pipeline_comm": pipeline_time(shape, block, coll),
            "optimizer_comm": optimizer_time(cfg, shape, params, coll)}
    return time, coll.bytes


def optimizer_time(cfg: Config, shape: StepShape, params: tuple[Param, ...], coll: Collectives) -> float:
    """Seconds of the optimizer's own collectives: Muon's moves of its matrices to whole ones and back
    (``jaxtron.planning.muon.moves``), each at the slowest link of the axes it runs over; none under AdamW."""
    seconds = 0.0
    for kind, whole_bytes, sent, axes in muon.moves(cfg, params, shape.mesh):
        coll.bytes[kind] += whole_bytes
        seconds += sent / min(coll.bandwidth(a) for a in axes)
    return seconds
