"""Models whose parameters and activations carry logical axis names."""

from __future__ import annotations

from flax import nnx

from jaxtron.config.schema import ExecutionConfig, ModelConfig
from jaxtron.models.transformer import Transformer


def build_model(cfg: ModelConfig, execution: ExecutionConfig, seed: int, attention_impl: str = "xla") -> Transformer:
    """Creates the model: the architecture ``cfg`` run as ``execution`` says (dtype, remat, fp8, MoE mode; resolve
    ``execution.attention`` into ``attention_impl`` first). Parameters are placed by the caller
    (jaxtron.training.state)."""
    with nnx.use_eager_sharding(False):
        return Transformer(cfg, execution, nnx.Rngs(params=seed), attention_impl)
