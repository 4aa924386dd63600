"""What a block-scaled FP8 recipe (``execution.fp8_recipe``, ``ops/block_scaled.py``) needs of a model: whole
blocks along every dimension its GEMMs contract, and dropless experts under blockwise alone."""

from __future__ import annotations

from jaxtron.config.checks import _check
from jaxtron.config.model import ExecutionConfig, ModelConfig

# execution.fp8_recipe -> the elements of its blocks along a contracted dimension (ops/block_scaled.py)
RECIPE_BLOCKS = {"mxfp8": 32, "blockwise": 128, "nvfp4": 16}


def block_scaled_widths(m: ModelConfig, seq_len: int) -> list[tuple[str, int, str | None]]:
    """(field, size, logical axis that splits it at its GEMMs) of each dimension a block-scaled recipe's GEMMs
    contract: the projections' input and output features, and a row's tokens (the weight gradients'). The
    residual width is whole where it is contracted (the activations and weights gathered for use): None."""
    head_dim = m.attention.head_dim or m.embed_dim // m.attention.num_heads
    experts = [("model.moe.expert_dim", m.resolved_expert_dim, "mlp")] if m.moe.num_experts else []
    return [*experts, ("model.embed_dim", m.embed_dim, None), ("model.mlp_dim", m.mlp_dim, "mlp"),
            ("model.attention.num_heads x head_dim", m.attention.num_heads * head_dim, "heads"),
            ("model.attention.num_kv_heads x head_dim", m.attention.num_kv_heads * head_dim, "kv_heads"),
            ("data.seq_len", seq_len, "activation_length")]


def check_block_recipe(m: ModelConfig, x: ExecutionConfig, seq_len: int) -> None:
    """With FP8 on, a block-scaled recipe's blocks fit every contracted dimension; dropless experts take blockwise
    alone (jaxtron's grouped kernel; XLA's ragged dot takes no scales)."""
    block = RECIPE_BLOCKS.get(x.fp8_recipe) if x.fp8 else None
    if block is None:
        return
    dropless = bool(m.moe.num_experts) and x.moe_mode == "dropless"
    _check(not dropless or x.fp8_recipe == "blockwise", "execution.fp8_recipe", f"is '{x.fp8_recipe}', which has no "
           "form for dropless mode's grouped expert GEMM (XLA's ragged dot takes no scales)",
           "use execution.moe_mode='capacity' (its batched expert GEMMs take every recipe), 'blockwise' or "
           "'tensorwise'")
    for field, size, _ in block_scaled_widths(m, seq_len):
        _check(size % block == 0, field, f"({size}) is not a multiple of the {block}-element blocks of "
               f"execution.fp8_recipe='{x.fp8_recipe}'", f"use a multiple of {block} or another recipe")
