"""The main job prepares its corpus once and learns real text: its loss falls well below the unigram entropy."""

import json
import os

import jax
import pytest

from conftest import REPO
from jaxtron.config.loader import load_config
from jaxtron.data.corpus import stdlib_files, unigram_entropy
from jaxtron.data.store import MANIFEST, TokenStore
from jaxtron.training.loop import run


@pytest.mark.slow
def test_default_config_prepares_its_corpus_once_and_learns_it(tmp_path):
    store_dir = str(tmp_path / "stdlib-store")
    overrides = [("data.path", store_dir), ("train.steps", "60"), ("train.log_every", "20"),
                 ("train.eval_every", "40"), ("train.eval_batches", "2")]
    cfg = load_config(os.path.join(REPO, "configs", "default.py"), overrides)
    summary = run(cfg, str(tmp_path / "run1"), use_tqdm=False, devices=jax.devices()[:1])
    store = TokenStore(store_dir)
    files = stdlib_files()  # empty files (many __init__.py) are no documents
    assert store.num_documents == sum(os.path.getsize(f) > 0 for f in files) > 300
    assert store.num_tokens == sum(os.path.getsize(f) for f in files)  # bytes: one token each
    entropy = summary["unigram_entropy"]
    assert 2.5 < entropy < 4.5
    assert abs(entropy - unigram_entropy(store.read(0, store.num_tokens // 2), 256)) < 0.2
    # 60 of the default 300 steps already beat the best context-free model by a wide margin,
    # on validation files the model never trained on
    assert summary["validation_loss"] < entropy - 0.5
    assert summary["final_loss"] < entropy - 0.5
    lines = [json.loads(line) for line in open(tmp_path / "run1" / "metrics.jsonl")]
    assert [l["step"] for l in lines if "loss" in l] == [20, 40, 60]
    evals = [l for l in lines if "eval/loss" in l]
    assert [l["step"] for l in evals] == [40, 60] and evals[-1]["eval/loss"] == summary["validation_loss"]
    # the second run reuses the store instead of preparing it again
    stamp = os.stat(os.path.join(store_dir, MANIFEST)).st_mtime_ns
    cfg2 = load_config(os.path.join(REPO, "configs", "default.py"), overrides[:1] + [("train.steps", "1")])
    run(cfg2, str(tmp_path / "run2"), use_tqdm=False, devices=jax.devices()[:1])
    assert os.stat(os.path.join(store_dir, MANIFEST)).st_mtime_ns == stamp
