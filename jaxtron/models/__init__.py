"""Models whose parameters and activations carry logical axis names."""

from __future__ import annotations

from flax import nnx

from jaxtron.config.schema import ModelConfig
from jaxtron.models.transformer import Transformer


def build_model(cfg: ModelConfig, seed: int, attention_impl: str = "xla") -> Transformer:
    """Creates the model. Parameters are placed by the caller (see jaxtron.training.state)."""
    with nnx.use_eager_sharding(False):
        return Transformer(cfg, nnx.Rngs(params=seed), attention_impl)
