"""Llama 4 beyond the parity fixtures: its published multimodal layout, the mechanisms' config checks, chunked
attention against a dense mask on packed rows, and its tiny size learning."""

import json
import logging
import os

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import REPO
from helpers import published_layout

from jaxtron import families
from jaxtron.config.checks import ConfigError
from jaxtron.config.model import ModelConfig
from jaxtron.interop import convert, score
from jaxtron.models.attention import chunk_segments
from jaxtron.ops import attention as attention_ops
from jaxtron.ops import dense

FIXTURES = os.path.join(REPO, "tests", "fixtures", "hf")


def _published(text: dict) -> dict:
    """Meta's config.json: the text model's keys in ``text_config``, a vision encoder's beside them."""
    text.pop("architectures")
    return {"architectures": ["Llama4ForConditionalGeneration"], "model_type": "llama4", "text_config": text,
            "vision_config": {"hidden_size": 16, "num_hidden_layers": 2}}


def _published_layout(name: str, directory: str) -> str:
    """The fixture ``name`` as Meta publishes it: the text model's tensors under ``language_model.``, a vision
    encoder and projector beside them."""
    return published_layout(os.path.join(FIXTURES, name), directory, _published, lambda n: "language_model." + n,
                            {"vision_model.patch_embedding.linear.weight": (16, 48),
                             "multi_modal_projector.linear_1.weight": (32, 16)})


def test_a_published_multimodal_checkpoint_imports_its_text_model(tmp_path, caplog):
    source = _published_layout("llama4", str(tmp_path / "published"))
    with caplog.at_level(logging.INFO, logger="jaxtron.interop.convert"):
        cfg = convert.from_hf(source, str(tmp_path / "converted"))
    assert cfg.family == "llama4" and cfg.attention.chunk == 8 and cfg.moe.scale_input
    assert "left out 2 tensors" in caplog.text and "vision_model." in caplog.text
    logits = score.score(str(tmp_path / "converted"), os.path.join(FIXTURES, "tokens.npy"))
    assert np.abs(logits - np.load(os.path.join(FIXTURES, "llama4", "logits.npy"))).max() < 1e-4


def test_config_json_maps_the_layer_pattern_and_refuses_what_it_cannot_express():
    with open(os.path.join(FIXTURES, "llama4_maverick", "config.json")) as f:
        hf = json.load(f)
    cfg = families.model_config(hf)
    assert (cfg.attention.global_every, cfg.attention.global_nope, cfg.moe.every) == (4, True, 2)
    assert [cfg.is_moe_block(i) for i in range(4)] == [False, True, False, True]
    assert families.hf_config(cfg)["no_rope_layers"] == [1, 1, 1, 0]
    nope_elsewhere = {**hf, "no_rope_layers": [0, 1, 1, 1]}
    with pytest.raises(families.FormatError, match="no_rope_layers are not its full-attention layers"):
        families.model_config(nope_elsewhere)
    scattered = {**hf, "moe_layers": [0, 3]}
    with pytest.raises(families.FormatError, match="MoE layers are not the last of every k layers"):
        families.model_config(scattered)
    # a DeepSeek-V3 model without its balancing bias has no Hugging Face form
    deepseek = ModelConfig(family="deepseek_v3", attention=dict(kv_lora_rank=16, num_kv_heads=8),
                           moe=dict(num_experts=4, router="sigmoid", balance_bias=False))
    with pytest.raises(families.FormatError, match="model.moe.balance_bias=False"):
        families.hf_config(deepseek)


@pytest.mark.parametrize("fields,message", [
    (dict(attention=dict(window=8, chunk=8, global_every=4)), "'model.attention.chunk' (8) and model.attention.window"),
    (dict(attention=dict(chunk=8, global_every=4, temperature_floor=16)), "scales the NoPE layers' queries"),
    (dict(attention=dict(global_nope=True)), "global_every places no global layers"),
    (dict(moe=dict(num_experts=4, balance_bias=False)), "only the sigmoid router has the bias"),
])
def test_the_mechanisms_refuse_inconsistent_fields_in_one_sentence(fields, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        ModelConfig(num_layers=8, **fields)


def test_chunked_attention_on_packed_rows_equals_a_dense_mask_of_chunks():
    """Two documents in a row, chunks of 4 positions of each document: the xla and blockwise paths with the chunk
    segments equal a dense mask that lets a token see the earlier tokens of its own document's chunk."""
    rng = np.random.default_rng(0)
    b, t, n, g, h, chunk = 2, 16, 4, 2, 8, 4
    q, k, v = (jnp.asarray(rng.standard_normal(s), jnp.float32) for s in ((b, t, n, h), (b, t, g, h), (b, t, g, h)))
    segment_ids = jnp.asarray([[0] * 6 + [1] * 10, [0] * 16], jnp.int32)
    positions = jnp.asarray([list(range(6)) + list(range(10)), list(range(16))], jnp.int32)
    seen = dense.visible(positions, positions, segment_ids, segment_ids) & \
        (positions[:, :, None] // chunk == positions[:, None, :] // chunk)
    want = dense.attention(q, k, v, seen)
    chunks = chunk_segments(positions, segment_ids, chunk, t)
    for implementation in ("xla", "blockwise"):
        got = attention_ops.dot_product_attention(q, k, v, implementation=implementation, segment_ids=chunks,
                                                  positions=positions)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-6)
    # the first row's second document starts a chunk at its own position 0, not at column 8
    assert list(np.asarray(chunks[0])) == [0, 0, 0, 0, 1, 1] + [5] * 4 + [6] * 4 + [7] * 2


@pytest.mark.integration
@pytest.mark.slow
def test_the_tiny_size_learns_the_standard_library(tmp_path):
    """60 steps of train.py on the built-in byte-level corpus, the experts over 2 devices in capacity mode: the
    training and validation losses end 0.5 nats below the text's unigram entropy."""
    from helpers import learning_run, logged_entropy, metrics_lines

    proc = learning_run("llama4.py:tiny", tmp_path / "run", 2, f"--config.data.path={tmp_path / 'stdlib'}",
                        "--config.train.steps=60", "--config.train.log_every=20", "--config.train.eval_every=0",
                        "--config.train.eval_batches=2", "--config.execution.moe_mode=capacity",
                        "--config.mesh.expert=2", "--config.mesh.fsdp=1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    entropy = logged_entropy(proc.stderr)
    lines = metrics_lines(tmp_path / "run")
    logged = [line for line in lines if "loss" in line]
    validation = [line["eval/loss"] for line in lines if "eval/loss" in line]
    assert logged[-1]["step"] == 60 and logged[-1]["loss_avg"] < entropy - 0.5 and validation[-1] < entropy - 0.5
