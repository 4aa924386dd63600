"""Train state: abstract shapes first, then shardings, then a sharded initialisation under jit."""

from __future__ import annotations

from typing import Any

import jax
import optax
from flax import nnx, struct
from jax.sharding import Mesh

from jaxtron.config import Config
from jaxtron.models import build_model
from jaxtron.sharding import tree_shardings
from jaxtron.training.optimizer import learning_rate_schedule, make_optimizer


@struct.dataclass
class TrainState:
    step: jax.Array
    params: Any  # nnx.State of Params (each carries its logical axis names)
    opt_state: Any


@struct.dataclass
class Setup:
    """Everything static that the step needs besides the state."""

    graphdef: Any = struct.field(pytree_node=False)
    tx: optax.GradientTransformation = struct.field(pytree_node=False)
    abstract_state: TrainState = struct.field(pytree_node=False)
    schedule: Any = struct.field(pytree_node=False)
    microbatches: int = struct.field(pytree_node=False, default=1)
    z_loss: float = struct.field(pytree_node=False, default=0.0)


def _init_fn(cfg: Config, attention_impl: str):
    def init() -> tuple[Any, TrainState]:
        model = build_model(cfg.model, cfg.train.seed, attention_impl)
        graphdef, params = nnx.split(model, nnx.Param)
        tx = make_optimizer(cfg.optimizer, cfg.train.steps, params)
        return graphdef, tx, TrainState(step=jax.numpy.zeros((), jax.numpy.int32), params=params,
                                        opt_state=tx.init(params))
    return init


def setup(cfg: Config, attention_impl: str) -> Setup:
    """Graph definition, optimizer and abstract state, with no parameter memory allocated."""
    init = _init_fn(cfg, attention_impl)
    holder = {}

    def abstract():
        graphdef, tx, state = init()
        holder.update(graphdef=graphdef, tx=tx)
        return state

    state = jax.eval_shape(abstract)
    return Setup(graphdef=holder["graphdef"], tx=holder["tx"], abstract_state=state,
                 schedule=learning_rate_schedule(cfg.optimizer, cfg.train.steps),
                 microbatches=cfg.train.microbatches, z_loss=cfg.train.z_loss)


def state_shardings(mesh: Mesh, abstract_state: TrainState) -> TrainState:
    """Params and optimizer moments follow the parameters' logical names; scalars are replicated."""
    return tree_shardings(mesh, abstract_state)


def sharded_init(cfg: Config, attention_impl: str, shardings: TrainState | None):
    """The jitted initialiser: each device computes only its own shards (partitionable RNG)."""
    init = _init_fn(cfg, attention_impl)
    return jax.jit(lambda: init()[2], out_shardings=shardings)


def init_state(cfg: Config, attention_impl: str, shardings: TrainState | None) -> TrainState:
    """Initialises directly into the target shardings: no device ever holds the full model."""
    return sharded_init(cfg, attention_impl, shardings)()
