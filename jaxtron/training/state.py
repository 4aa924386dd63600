"""Train state: abstract shapes first, then shardings, then a sharded initialisation under jit."""

from __future__ import annotations

import math
import os
from typing import Any

import jax
import optax
from flax import nnx, struct
from jax.sharding import Mesh

from jaxtron.config.post_training import keeps_reference
from jaxtron.config.schema import ONE_F_ONE_B, Config, ConfigError, DpoConfig, RlConfig, TrainConfig
from jaxtron.models import build_model, lora, moe, stack, tensor_chunks
from jaxtron.models.stack import remat_policy
from jaxtron.ops import fp8 as fp8_ops
from jaxtron.parallel.sharding import shard_count
from jaxtron.parallel.stages import padding, reorder, storage_order
from jaxtron.parallel.state_sharding import tree_shardings
from jaxtron.training.optimizer import learning_rate_schedule, make_optimizer
from jaxtron.training.pipeline.fill_drain import Schedule
from jaxtron.training.pipeline.one_f_one_b import OneFOneBSchedule


@struct.dataclass
class TrainState:
    step: jax.Array
    params: Any  # nnx.State of Params (each carries its logical axis names)
    opt_state: Any
    nonfinite: jax.Array  # int32 [total skipped steps, skipped in a row, first step that hit the limit or -1]
    # DPO's frozen reference model (a full fine-tune's: train.init_from's parameters; None otherwise). Never saved:
    # a resumed run reads it again from train.init_from, as a LoRA run reads its base
    reference: Any = None


@struct.dataclass
class Setup:
    """Everything static that the step needs besides the state: what the config builds (the model's graph, the
    optimizer, the stack's runner) and the config's ``train`` section it came from."""

    graphdef: Any = struct.field(pytree_node=False)
    tx: optax.GradientTransformation = struct.field(pytree_node=False)
    abstract_state: TrainState = struct.field(pytree_node=False)
    learning_rate: Any = struct.field(pytree_node=False)  # optimizer count -> the rate (an optax schedule)
    # train.*: microbatches, the loss's terms (z_loss, router losses, mtp_loss), logit_chunks, seed, the
    # non-finite limit
    train: TrainConfig = struct.field(pytree_node=False, default=TrainConfig())
    # the layer stack's runner (a pipeline Schedule) and the period order the stack is stored in (None: the plain
    # scan, natural order)
    stack_runner: Schedule | None = struct.field(pytree_node=False, default=None)
    layer_order: tuple[int, ...] | None = struct.field(pytree_node=False, default=None)
    # XLA options the step compiles with (ops/fp8.py: what FP8 projections need), as (name, value) pairs
    compiler_options: tuple[tuple[str, object], ...] = struct.field(pytree_node=False, default=())
    # on a GPU, compiled a second time with the first compile's costs as XLA's scheduler's (metrics/schedule.py)
    budget_schedule: bool = struct.field(pytree_node=False, default=False)
    # the distributed optimizer (``optimizer.distributed``): moments sharded as ``state_sharding.optimizer_spec`` says
    distributed_optimizer: bool = struct.field(pytree_node=False, default=False)
    dpo: DpoConfig = struct.field(pytree_node=False, default=DpoConfig())  # train.objective='dpo': beta and smoothing
    rl: RlConfig = struct.field(pytree_node=False, default=RlConfig())  # train.objective='grpo': the update's terms


def pipeline_schedule(cfg: Config, stages: int) -> Schedule | None:
    """The pipeline schedule of ``stages`` stages (None without a pipeline and its microbatches)."""
    microbatches, virtual = cfg.pipeline.sizes(stages)
    if (stages, microbatches) == (1, 1):
        return None
    runner = OneFOneBSchedule if cfg.pipeline.schedule in ONE_F_ONE_B else Schedule
    return runner(stages, microbatches, virtual, remat_policy(cfg.execution.remat),
                    padding(cfg.model.stack_periods, stages, virtual), cfg.pipeline.schedule,
                    cfg.pipeline.fsdp_gather == "step")


def layer_order(cfg: Config, stages: int) -> tuple[int, ...]:
    """The order of the periods in the stored layer stack under this many pipeline stages (``PAD``: an
    identity period filling an uneven split)."""
    return tuple(int(i) for i in storage_order(cfg.model.stack_periods, stages, cfg.pipeline.sizes(stages)[1]))


def _init_fn(cfg: Config, attention_impl: str, stages: int | None = None):
    """The initialiser; the layer stack is stored in the order of ``stages`` pipeline stages (default: those of
    the mesh set with ``jax.set_mesh``, see ``stage_count``)."""
    order = layer_order(cfg, stage_count(cfg, None) if stages is None else stages)

    def init() -> tuple[Any, TrainState]:
        model = build_model(cfg.model, cfg.execution, cfg.train.seed, attention_impl)
        if cfg.lora.rank:
            lora.add_adapters(model, cfg.lora, cfg.train.seed)
        graphdef, params = nnx.split(model, nnx.Param)
        params = reorder(params, None, order)  # each layer initialised as without a pipeline, stored stage-major
        trainable, _ = lora.split(params)  # a LoRA run's optimizer sees (and holds state for) the adapters alone
        tx = make_optimizer(cfg.optimizer, cfg.train.steps, trainable)
        reference = None  # DPO's reference: a copy here, train.init_from's parameters once the run starts
        if keeps_reference(cfg):
            reference = jax.tree.map(jax.numpy.copy, params)
        return graphdef, tx, TrainState(step=jax.numpy.zeros((), jax.numpy.int32), params=params,
                                        opt_state=tx.init(trainable),
                                        nonfinite=jax.numpy.array([0, 0, -1], jax.numpy.int32), reference=reference)
    return init


def _mesh_sizes(sizes: dict[str, int] | None) -> dict[str, int] | None:
    """``sizes``, or those of the mesh set with ``jax.set_mesh``; None when neither is there."""
    if sizes is None:
        mesh = jax.sharding.get_abstract_mesh()
        sizes = None if mesh.empty else dict(mesh.shape)
    return sizes


def stage_count(cfg: Config, sizes: dict[str, int] | None) -> int:
    """Pipeline stages: the pieces the rules table cuts the stage dimension into on a mesh of ``sizes`` (default:
    the mesh set with ``jax.set_mesh``, else ``mesh.pipeline``, 1 when it is -1)."""
    sizes = _mesh_sizes(sizes)
    return shard_count(sizes, "stages") if sizes is not None else max(cfg.mesh.pipeline, 1)


def expert_shards(cfg: Config, sizes: dict[str, int] | None) -> int:
    """Into how many pieces the rules table cuts the experts on a mesh of ``sizes`` (default as ``stage_count``,
    else ``mesh.expert``)."""
    sizes = _mesh_sizes(sizes)
    return shard_count(sizes, "experts") if sizes is not None else max(cfg.mesh.expert, 1)


def tensor_count(cfg: Config, sizes: dict[str, int] | None) -> int:
    """Devices in the tensor group on a mesh of ``sizes`` (default as ``stage_count``, else ``mesh.tensor``)."""
    sizes = _mesh_sizes(sizes)
    return shard_count(sizes, tensor_chunks.SPLIT_AXIS) if sizes is not None else max(cfg.mesh.tensor, 1)


def setup(cfg: Config, attention_impl: str, sizes: dict[str, int] | None = None) -> Setup:
    """Graph definition, optimizer and abstract state, with no parameter memory allocated; ``sizes`` are the
    mesh's (see ``stage_count``)."""
    stages = stage_count(cfg, sizes)
    init = _init_fn(cfg, attention_impl, stages)
    holder = {}

    def abstract():
        graphdef, tx, state = init()
        holder.update(graphdef=graphdef, tx=tx)
        return state

    state = jax.eval_shape(abstract)
    tensorwise = cfg.execution.fp8 and cfg.execution.fp8_recipe == "tensorwise"  # ops/fp8.py's GEMM options
    return Setup(graphdef=holder["graphdef"], tx=holder["tx"], abstract_state=state,
                 learning_rate=learning_rate_schedule(cfg.optimizer, cfg.train.steps), train=cfg.train,
                 stack_runner=pipeline_schedule(cfg, stages), layer_order=layer_order(cfg, stages),
                 compiler_options=tuple({**stack.compiler_options(cfg.execution),
                                         **tensor_chunks.compiler_options(cfg.execution.tensor_chunks,
                                                                          tensor_count(cfg, sizes)),
                                         **fp8_ops.compiler_options(tensorwise),
                                         **moe.compiler_options(cfg.model, expert_shards(cfg, sizes),
                                                                 cfg.execution.moe_chunks)}.items()),
                 budget_schedule=moe.budget_schedule(cfg.model, expert_shards(cfg, sizes), cfg.execution.moe_schedule),
                 distributed_optimizer=cfg.optimizer.distributed, dpo=cfg.dpo,
                 rl=cfg.rl)


@struct.dataclass
class SavedState:
    """What a checkpoint holds: a train state without its reference. Its own class, not a TrainState with the
    reference None, since orbax would record that None and refuse checkpoints written before it existed."""

    step: jax.Array
    params: Any
    opt_state: Any
    nonfinite: jax.Array

    def train_state(self) -> TrainState:
        """The train state this was saved from, its reference to be read again (from ``train.init_from``)."""
        return TrainState(step=self.step, params=self.params, opt_state=self.opt_state, nonfinite=self.nonfinite)


def saved_part(state: TrainState, like: TrainState | None = None) -> SavedState:
    """What a checkpoint holds of a train state (or of a tree shaped like one, ``lora.saved_part`` says how):
    all but the reference model, and only the adapters of a LoRA run's parameters."""
    def saved(tree: TrainState) -> SavedState:
        return SavedState(step=tree.step, params=tree.params, opt_state=tree.opt_state, nonfinite=tree.nonfinite)
    return lora.saved_part(saved(state), None if like is None else saved(like))


def state_shardings(mesh: Mesh, abstract_state: TrainState, distributed_optimizer: bool = False) -> TrainState:
    """Params and optimizer moments follow the parameters' logical names; under the distributed optimizer both also
    split over the batch's axes (``state_sharding.optimizer_spec``: the params are float32 masters, and a step
    gathers its working copy, ``working_copy.py``); the DPO reference stays as its rule places it. Scalars are
    replicated."""
    shardings = tree_shardings(mesh, abstract_state)
    if distributed_optimizer:
        shardings = shardings.replace(opt_state=tree_shardings(mesh, abstract_state.opt_state, optimizer=True),
                                      params=tree_shardings(mesh, abstract_state.params, optimizer=True))
    return shardings


def state_bytes_per_device(abstract_state: TrainState, shardings: TrainState) -> int:
    """Bytes of parameters and optimizer state that each device holds (the largest shard set)."""
    leaves = jax.tree.leaves(abstract_state)
    specs = jax.tree.leaves(shardings, is_leaf=lambda x: isinstance(x, jax.sharding.Sharding))
    return sum(math.prod(sh.shard_shape(x.shape)) * x.dtype.itemsize for x, sh in zip(leaves, specs, strict=True))


def check_fits(abstract_state: TrainState, shardings: TrainState, devices: list) -> None:
    """ConfigError when the state alone (activations not counted) cannot fit the devices' memory."""
    need = state_bytes_per_device(abstract_state, shardings)
    local = [d for d in devices if d.process_index == jax.process_index()]
    stats = local[0].memory_stats() or {}
    if "bytes_limit" in stats:
        have, where = stats["bytes_limit"], f"per device but each {local[0].device_kind} has"
    elif local[0].platform == "cpu":  # a process's CPU devices share its host's memory
        need *= len(local)
        have, where = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "in all but this host has"
    else:
        return
    if need > have:
        raise ConfigError(f"config field 'mesh' leaves {need / 2**30:.1f} GiB of parameters and optimizer state "
                          f"{where} {have / 2**30:.1f} GiB (activations not counted); use more devices, "
                          "a larger mesh.fsdp or a smaller model.")


def sharded_init(cfg: Config, attention_impl: str, shardings: TrainState | None):
    """The jitted initialiser: each device computes only its own shards (partitionable RNG)."""
    init = _init_fn(cfg, attention_impl)
    return jax.jit(lambda: init()[2], out_shardings=shardings)


def init_from_params(cfg: Config, abstract_params: Any, shardings: Any, layer_order) -> Any:
    """``train.init_from``'s parameters, placed as this run's (``shardings``, the stack in ``layer_order``): all of
    them, or a LoRA run's base (all but its adapters and their seeds, which that model does not have)."""
    from jaxtron.checkpoint.params import restore_params
    return restore_params(cfg.train.init_from, lora.own(abstract_params, lora=False),
                          lora.own(shardings, abstract_params, lora=False), layer_order=layer_order)


def init_state(cfg: Config, attention_impl: str, shardings: TrainState | None) -> TrainState:
    """Initialises directly into the target shardings (under the mesh they belong to): no device ever holds the
    full model."""
    return sharded_init(cfg, attention_impl, shardings)()
