"""Feed-forward blocks: gated (SwiGLU, Gemma's GeGLU, gpt-oss's clamped SwiGLU) or plain GELU (GPT)."""

from __future__ import annotations

import math

import jax
from flax import nnx

from jaxtron.config.model import GATED
from jaxtron.config.schema import ExecutionConfig, ModelConfig
from jaxtron.models.layers import GatedActivation
from jaxtron.models.projection import Projection
from jaxtron.parallel.sharding import constrain

HIDDEN_AXES = ("activation_batch", "activation_length", "activation_mlp")


class MLP(nnx.Module):
    def __init__(self, cfg: ModelConfig, execution: ExecutionConfig, rngs: nnx.Rngs, width: int = 0):
        d, f, dt = cfg.embed_dim, width or cfg.mlp_dim, execution.dtype
        self.gated = cfg.activation in GATED
        self.activation = GatedActivation.of(cfg)
        self.wi_gate = Projection(rngs, (d,), (f,), ("embed", "mlp"), cfg.init_std, dt) if self.gated else None
        self.wi_up = Projection(rngs, (d,), (f,), ("embed", "mlp"), cfg.init_std, dt)
        self.wo = Projection(rngs, (f,), (d,), ("mlp", "embed"), cfg.init_std / math.sqrt(2 * cfg.num_layers), dt)

    def __call__(self, x: jax.Array) -> tuple[jax.Array, dict[str, jax.Array]]:
        """x [batch, length, embed] -> (output of the same shape, {}: a dense MLP routes nothing)."""
        up = self.wi_up(x)
        gate = self.wi_gate(x) if self.gated else None
        with jax.named_scope("activation"):
            hidden = jax.nn.gelu(up) if gate is None else self.activation(gate, up)
        return self.wo(constrain(hidden, HIDDEN_AXES)), {}
