"""Qwen3.5 as its checkpoints are published: a multimodal config.json (the text model's keys in ``text_config``),
the text model's tensors under ``model.language_model.``, beside a vision encoder and a multi-token prediction
layer, which the import leaves out and names."""

import logging
import os

import numpy as np
import pytest
from conftest import REPO
from helpers import published_layout, rewrite_tensors

from jaxtron.interop import convert, score
from jaxtron.interop.hf import safetensors as st

FIXTURES = os.path.join(REPO, "tests", "fixtures", "hf")


def _published(text: dict) -> dict:
    """A published Qwen3.5 config.json: the text model's keys nested, a vision encoder's beside them."""
    architecture = text.pop("architectures")[0].replace("ForCausalLM", "ForConditionalGeneration")
    return {"architectures": [architecture], "model_type": text["model_type"].removesuffix("_text"),
            "text_config": text, "vision_config": {"depth": 2, "hidden_size": 16},
            "tie_word_embeddings": text["tie_word_embeddings"]}


def _published_layout(name: str, directory: str) -> str:
    """The fixture ``name`` rewritten as a published checkpoint: nested config, prefixed tensors, extra parts."""
    return published_layout(os.path.join(FIXTURES, name), directory, _published,
                            lambda n: "model.language_model." + n[6:] if n.startswith("model.") else n,
                            {"model.visual.blocks.0.attn.qkv.weight": (48, 16), "mtp.fc.weight": (48, 96)})


# the extended tier: the first tier imports Llama 4's published layout, the same kind of text-model selection
@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.extended) for n in ("qwen3_5", "qwen3_5_moe")])
def test_a_published_multimodal_checkpoint_imports_its_text_model(name, tmp_path, caplog):
    source = _published_layout(name, str(tmp_path / "published"))
    with caplog.at_level(logging.INFO, logger="jaxtron.interop.convert"):
        cfg = convert.from_hf(source, str(tmp_path / "converted"))
    assert cfg.family == name and cfg.linear.every == 4
    assert "left out 2 tensors" in caplog.text and "model.visual." in caplog.text and "mtp." in caplog.text
    logits = score.score(str(tmp_path / "converted"), os.path.join(FIXTURES, "tokens_88.npy"))
    assert np.abs(logits - np.load(os.path.join(FIXTURES, name, "logits.npy"))).max() < 1e-4


def test_a_tensor_outside_the_text_model_and_the_parts_left_out_is_refused(tmp_path):
    source = _published_layout("qwen3_5", str(tmp_path / "published"))
    rewrite_tensors(source, extra={"model.audio.proj.weight": np.zeros((4, 4), np.float32)})
    with pytest.raises(st.FormatError, match="model.audio.proj.weight"):
        convert.from_hf(source, str(tmp_path / "converted"))
    assert not os.path.exists(tmp_path / "converted")


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.parametrize("size,extra", [("tiny", ()), ("tiny_moe", ("--config.execution.moe_mode=capacity",
                                                                    "--config.mesh.expert=2", "--config.mesh.fsdp=1"))])
def test_the_tiny_sizes_learn_the_standard_library(size, extra, tmp_path):
    """60 steps of train.py on the built-in byte-level corpus (the MoE size with its experts over 2 devices, in
    capacity mode: on a CPU dropless mode's expanded expert GEMM is slower): the training and validation losses end
    0.5 nats below the text's unigram entropy."""
    from helpers import learning_run, logged_entropy, metrics_lines

    proc = learning_run(f"qwen3_5.py:{size}", tmp_path / "run", 2, f"--config.data.path={tmp_path / 'stdlib'}",
                        "--config.train.steps=60", "--config.train.log_every=20", "--config.train.eval_every=0",
                        "--config.train.eval_batches=2", *extra)
    assert proc.returncode == 0, proc.stderr[-3000:]
    entropy = logged_entropy(proc.stderr)
    lines = metrics_lines(tmp_path / "run")
    logged = [line for line in lines if "loss" in line]
    validation = [line["eval/loss"] for line in lines if "eval/loss" in line]
    assert logged[-1]["step"] == 60 and logged[-1]["loss_avg"] < entropy - 0.5 and validation[-1] < entropy - 0.5
