"""Feed-forward blocks: SwiGLU (Llama) or plain GELU (GPT)."""

from __future__ import annotations

import math

import jax
from flax import nnx

from jaxtron.config.schema import ExecutionConfig, ModelConfig
from jaxtron.models.layers import compute_dtype, param
from jaxtron.models.lora import project
from jaxtron.ops import fp8 as fp8_ops
from jaxtron.parallel.sharding import constrain

HIDDEN_AXES = ("activation_batch", "activation_length", "activation_mlp")


class MLP(nnx.Module):
    def __init__(self, cfg: ModelConfig, execution: ExecutionConfig, rngs: nnx.Rngs, width: int = 0):
        d, f = cfg.embed_dim, width or cfg.mlp_dim
        self.gated = cfg.activation == "swiglu"
        self.wi_gate = param(rngs, (d, f), ("embed", "mlp"), cfg.init_std) if self.gated else None
        self.wi_up = param(rngs, (d, f), ("embed", "mlp"), cfg.init_std)
        self.wo = param(rngs, (f, d), ("mlp", "embed"), cfg.init_std / math.sqrt(2 * cfg.num_layers))
        self.dtype = compute_dtype(execution)

    def __call__(self, x: jax.Array, fp8: bool = False) -> tuple[jax.Array, dict[str, jax.Array]]:
        """x [batch, length, embed] -> (output of the same shape, {}: a dense MLP routes nothing)."""
        dt, einsum = self.dtype, fp8_ops.projection(fp8)
        up = project(einsum, "btd,df->btf", x, self, "wi_up", dt)
        gate = project(einsum, "btd,df->btf", x, self, "wi_gate", dt) if self.gated else None
        with jax.named_scope("activation"):
            hidden = jax.nn.gelu(up) if gate is None else jax.nn.silu(gate) * up
        hidden = constrain(hidden, HIDDEN_AXES)
        return project(einsum, "btf,fd->btd", hidden, self, "wo", dt), {}
