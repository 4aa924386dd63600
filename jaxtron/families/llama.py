"""Llama 2, 3, 3.1 and 3.2 (``LlamaForCausalLM``): grouped-query attention and dense SwiGLU blocks, RoPE with
Llama-3.1's frequency bands. The defaults of ``ModelConfig``; the layout the other families build on."""

from __future__ import annotations

from typing import Any

from jaxtron.config.model import ModelConfig
from jaxtron.families import config_json, hf_tensors
from jaxtron.families.family import Family, Fixture

# the fixtures' shared shapes (scripts/hf_fixtures.py): a 96-token vocabulary, RoPE with Llama-3.1's bands
VOCAB = 96
ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 32}


def _fixture(tied: bool) -> dict[str, Any]:
    return dict(vocab_size=VOCAB, hidden_size=48, intermediate_size=80, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-5, tie_word_embeddings=tied,
                rope_parameters=dict(ROPE))


def _model_fields(hf: dict, tensor_names) -> dict[str, Any]:
    return config_json.core_fields(hf)


def _hf_fields(cfg: ModelConfig, router_aux_loss: float) -> dict[str, Any]:
    return {**config_json.core_hf(cfg, "llama"), "mlp_bias": False}


LLAMA = Family(
    name="llama", model_type="llama", architectures=("LlamaForCausalLM",),
    description="grouped-query attention, dense SwiGLU blocks",
    model_fields=_model_fields, hf_fields=_hf_fields, tensors=hf_tensors.tensors,
    mechanisms=frozenset({"llama3_rope", "yarn"}),
    fixtures=(Fixture("llama", 0, _fixture(tied=False)),  # Llama 3.1-style: untied head, config.json of transformers 5
              # Llama 3.2-style: tied embeddings, sharded safetensors with an index, config.json in the 4.x form
              Fixture("llama_tied", 1, _fixture(tied=True), shard="60KB", v4=True)),
)
