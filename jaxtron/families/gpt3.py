"""GPT-3 (``configs/gpt3_175b.py``): GELU MLPs, LayerNorm and learned positions. Hugging Face has no class of its
shape (GPT-2's differs: fused qkv, biases), so it is trained here and not exported."""

from __future__ import annotations

from typing import Any

from jaxtron.families.family import Family, FormatError


def _not_converted(*_: Any) -> Any:
    raise FormatError("model.family='gpt3' has no Hugging Face class; jaxtron trains it but does not convert it.")


GPT3 = Family(
    name="gpt3", model_type="gpt3", architectures=(),
    description="GELU MLPs, LayerNorm, learned positions; no Hugging Face class",
    model_fields=_not_converted, hf_fields=_not_converted, tensors=_not_converted,
    mechanisms=frozenset({"gelu", "layernorm", "learned_positions"}),
)
