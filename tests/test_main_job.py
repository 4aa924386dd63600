"""The main job learns real text: its loss falls well below the unigram entropy of that text."""

import json
import os

import jax

from conftest import REPO
from jaxtron.config_loader import load_config
from jaxtron.data.corpus import load_stdlib_bytes, unigram_entropy
from jaxtron.training.loop import run


def test_default_config_learns_the_standard_library(tmp_path):
    cfg = load_config(os.path.join(REPO, "configs", "default.py"),
                      [("train.steps", "60"), ("train.log_every", "20"), ("train.eval_batches", "2")])
    summary = run(cfg, str(tmp_path), use_tqdm=False, devices=jax.devices()[:1])
    corpus = load_stdlib_bytes()
    entropy = unigram_entropy(corpus.train, 256)
    assert 2.5 < entropy < 4.5 and summary["unigram_entropy"] == entropy
    assert corpus.held_out.size > 100_000 and corpus.train.size > 20 * corpus.held_out.size / 2
    # 60 of the default 300 steps already beat the best context-free model by a wide margin, on held-out files
    assert summary["held_out_loss"] < entropy - 0.5
    assert summary["final_loss"] < entropy - 0.5
    lines = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert [l["step"] for l in lines if "loss" in l] == [20, 40, 60]
    assert lines[-1]["eval/loss"] == summary["held_out_loss"]
