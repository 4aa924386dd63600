"""Analytic estimate of one mesh: per-device memory and a roofline step time, term by term.

The model follows what jaxtron's train step does, not an idealised trainer. It is computed over the step's shape
(``jaxtron.planning.shape``: the mesh, the pipeline schedule, the rows and tokens one device holds, one block's
values) in three parts, each module explaining its terms:
- ``jaxtron.planning.memory``: the parameters, AdamW moments and gradients as sharded, the activations saved for
  the backward pass, and the working space of the step's largest phase;
- ``jaxtron.planning.step_time``: matmuls, attention and elementwise work at the GPU's rates, the pipeline
  bubble, and how they combine with the communication into a step;
- ``jaxtron.planning.collectives``: each collective at the bandwidth of the mesh axes it runs over.
"""

from __future__ import annotations

import dataclasses

from jaxtron.config.post_training import keeps_reference
from jaxtron.config.schema import Config, MeshConfig, replace
from jaxtron.planning.collectives import communication_time
from jaxtron.planning.gpus import GPU
from jaxtron.planning.memory import UNSEEN_ON_TARGET, memory
from jaxtron.planning.params import parameters, state_elements
from jaxtron.planning.rollouts import rollout_flops, sampler_excess, sampler_memory, with_rollouts
from jaxtron.planning.shape import block_values, step_shape
from jaxtron.planning.step_time import (
    COMPUTE_TERMS,
    EXPOSED,
    OVERLAPPED,
    compute_time,
    expert_overlap,
    mfu_peak,
    model_flops,
    step_seconds,
    tensor_overlap,
)


@dataclasses.dataclass
class Estimate:
    mesh: dict[str, int]
    microbatches: int
    pipeline_microbatches: int  # in flight per pipeline pass (0: no pipeline schedule)
    schedule: str  # the pipeline schedule ('fill_drain' without a pipeline)
    virtual_stages: int  # its virtual stages (chunks of layers a stage; 1 without them)
    bubble: float  # the pipeline schedule's idle share
    distributed_optimizer: bool  # optimizer.distributed: the moments sharded over the batch's axes
    gather_once: bool  # pipeline.fsdp_gather='step': a stage's weights gathered over fsdp once a step
    identity_layers: int  # blocks that fill an uneven pipeline split (pipeline.uneven_stages)
    attention: str  # the attention implementation the estimate assumes
    remat: str  # the rematerialisation policy it assumes
    memory: dict[str, float]  # bytes per device by term
    time: dict[str, float]  # seconds per step by term
    exposed: tuple[str, ...]  # time terms that add to the step (the others overlap with compute)
    overlapped: tuple[str, ...]
    step_s: float
    mfu: float
    tokens_per_s: float
    collectives: dict[str, float]  # bytes per step and device, by collective kind
    config: Config  # the config that runs this program (``as_run``): `jaxtron train` and --compile take it
    sampler_bytes: float = 0.0  # GRPO: what the sampler allocates beside the parameters (``sampler_memory``)

    @property
    def memory_bytes(self) -> float:
        return sum(self.memory.values())

    @property
    def unseen_on_target_bytes(self) -> float:
        """The estimated bytes a compile without the GPU cannot see (cuDNN's workspace)."""
        return sum(self.memory.get(term, 0.0) for term in UNSEEN_ON_TARGET)

    @property
    def comm_s(self) -> float:
        """Seconds of communication per step, overlapped or not."""
        return sum(v for k, v in self.time.items() if k not in COMPUTE_TERMS)

    @property
    def dominant(self) -> str:
        """The term that sets the step time: the overlapped communication when it outlasts the compute (more of
        it than the compute hides costs time too, ``step_seconds``), else the largest exposed term."""
        compute = sum(self.time[k] for k in self.exposed if k in COMPUTE_TERMS)
        hidden = sum(self.time[k] for k in self.overlapped)
        if hidden > compute:
            return max(self.overlapped, key=self.time.get)
        return max(self.exposed, key=self.time.get)


def estimate(cfg: Config, sizes: dict[str, int], gpu: GPU, microbatches: int | None = None,
             cpu_program: bool = False, pipeline_microbatches: int | None = None) -> Estimate:
    """Per-device memory and step time of ``cfg`` on the mesh ``sizes`` of ``gpu``s.

    ``microbatches`` defaults to ``train.microbatches``; execution.remat='auto' becomes the policy a run on ``gpu``
    picks. ``cpu_program``: estimate the program XLA:CPU compiles
    for the dry run instead of the GPU's: XLA attention, and 16-bit values held in float32 (XLA:CPU has no
    16-bit matmul, so it converts their operands: the block weights are gathered in float32 and the saved
    residual stream is converted to float32 once more before the backward pass; a pipelined program also holds a
    copy of the AdamW moments through the loss's backward pass).
    """
    if cfg.execution.remat == AUTO:  # the policy that a run on this GPU would pick
        cfg = choose_remat(cfg, sizes, gpu, cpu_program, microbatches=microbatches,
                           pipeline_microbatches=pipeline_microbatches)[0]
    shape = step_shape(cfg, sizes, microbatches, cpu_program, pipeline_microbatches)
    block = block_values(cfg, shape)
    params = parameters(cfg.model)
    time = compute_time(cfg, shape, block, gpu, params)
    comm, collectives = communication_time(cfg, shape, block, params, gpu)
    time.update(comm)
    time.update(expert_overlap(cfg, shape, time, gpu))
    time.update(tensor_overlap(cfg, time))
    time = with_rollouts(cfg, shape, block, gpu, params, time)  # GRPO: its updates, log-probabilities, generation
    step = step_seconds(time, gpu.comm_overlap, gpu.comm_interference)
    held, sampler_bytes = memory(cfg, shape, block, params), 0.0
    if keeps_reference(cfg):  # DPO's and GRPO's frozen reference: float32 parameters, sharded as their rules say
        held["reference"] = 4.0 * state_elements(params, shape.mesh)
    if cfg.train.objective == "grpo":  # the sampler runs between steps, while the state stays resident
        sampler_bytes = sampler_memory(cfg, shape, block, params)
        held["generation"] = sampler_excess(sampler_bytes, held)
    return Estimate(mesh=dict(shape.mesh), microbatches=shape.microbatches,
                    pipeline_microbatches=shape.in_flight if shape.pipelined else 0, schedule=shape.schedule,
                    virtual_stages=shape.virtual_stages if shape.pipelined else 1,
                    bubble=shape.bubble, distributed_optimizer=cfg.optimizer.distributed,
                    gather_once=shape.gather_once,
                    identity_layers=shape.identity_layers, attention=shape.attention, remat=cfg.execution.remat,
                    memory=held, time=time, exposed=EXPOSED, overlapped=OVERLAPPED,
                    step_s=step, mfu=rollout_flops(cfg, model_flops(cfg, shape)) / step / mfu_peak(cfg, shape, gpu),
                    tokens_per_s=shape.step_tokens / step, collectives=collectives, config=as_run(cfg, sizes, shape),
                    sampler_bytes=sampler_bytes)


def as_run(cfg: Config, sizes: dict[str, int], shape) -> Config:
    """``cfg`` as the estimate of ``shape`` ran it: on the mesh ``sizes``, with its microbatches, pipeline
    microbatches and (for an uneven split) identity layers set, so that a run or a compile of it is the program
    estimated."""
    pipeline = cfg.pipeline
    if shape.pipelined:
        pipeline = replace(pipeline, microbatches=shape.in_flight)
    if shape.identity_layers:
        pipeline = replace(pipeline, uneven_stages=True)
    mesh = MeshConfig(**{axis: sizes.get(axis, 1) for axis in dataclasses.asdict(cfg.mesh)})
    return replace(cfg, mesh=mesh, pipeline=pipeline, train=replace(cfg.train, microbatches=shape.microbatches))


# execution.remat='auto': the policies from fastest to leanest (jaxtron/planning/remat.py says why this order)
AUTO = "auto"
AUTO_ORDER = ("save_dots_attention", "save_dots", "save_attention", "full")
# the estimate's GPU peaks are within 10% of the compiled ones (benchmarks/plan_validation.md): a policy is taken only
# with that much room to spare
MARGIN = 0.10


def with_remat(cfg: Config, policy: str) -> Config:
    return replace(cfg, execution=replace(cfg.execution, remat=policy))


def choose_remat(cfg: Config, sizes: dict[str, int], gpu: GPU, cpu_program: bool = False,
                 **options) -> tuple[Config, float]:
    """(``cfg`` with remat 'auto' resolved: the first policy of ``AUTO_ORDER`` whose estimated peak, plus
    ``MARGIN``, fits ``gpu``'s usable memory on the mesh ``sizes``, else 'full'; that peak in bytes). A config that
    names its policy comes back as it is. ``options``: the estimate's (microbatches, pipeline microbatches)."""
    if cfg.execution.remat != AUTO:
        return cfg, estimate(cfg, sizes, gpu, cpu_program=cpu_program, **options).memory_bytes
    for policy in AUTO_ORDER:
        chosen = with_remat(cfg, policy)
        need = estimate(chosen, sizes, gpu, cpu_program=cpu_program, **options).memory_bytes
        if need * (1 + MARGIN) <= gpu.usable_bytes:
            break
    return chosen, need
