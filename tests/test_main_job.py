"""The main job prepares its corpus once and learns real text: its loss falls well below the unigram entropy."""

import os

import pytest
from helpers import learning_run, logged_entropy, metrics_lines

from jaxtron.data.corpus import stdlib_files, unigram_entropy
from jaxtron.data.store import MANIFEST, TokenStore

pytestmark = pytest.mark.integration  # crosses a process boundary: .ci/run's tier, not the README's


@pytest.mark.slow
def test_default_config_prepares_its_corpus_once_and_learns_it(tmp_path):
    store_dir = str(tmp_path / "stdlib-store")
    # 60 of the default 300 steps, at half the batch: 1/10 of the main job's tokens
    args = (f"--config.data.path={store_dir}", "--config.train.steps=60", "--config.train.global_batch_size=8",
            "--config.train.log_every=20", "--config.train.eval_every=40", "--config.train.eval_batches=2")
    first = learning_run("default.py", tmp_path / "run", 1, *args)
    assert first.returncode == 0, first.stderr[-3000:]
    store = TokenStore(store_dir)
    files = stdlib_files()  # empty files (many __init__.py) are no documents
    assert store.num_documents == sum(os.path.getsize(f) > 0 for f in files) > 300
    assert store.num_tokens == sum(os.path.getsize(f) for f in files)  # bytes: one token each
    entropy = logged_entropy(first.stderr)
    assert 2.5 < entropy < 4.5
    assert abs(entropy - unigram_entropy(store.read(0, store.num_tokens // 2), 256)) < 0.2
    lines = metrics_lines(tmp_path / "run")
    assert [line["step"] for line in lines if "loss" in line] == [20, 40, 60]
    evals = [line for line in lines if "eval/loss" in line]
    assert [line["step"] for line in evals] == [40, 60]
    # a tenth of the main job already beats the best context-free model by a wide margin (about 0.8 nats),
    # on validation files the model never trained on
    assert evals[-1]["eval/loss"] < entropy - 0.5
    assert [line for line in lines if "loss" in line][-1]["loss_avg"] < entropy - 0.5
    # the same command again opens the store without preparing it, finds the run finished and trains nothing
    stamp = os.stat(os.path.join(store_dir, MANIFEST)).st_mtime_ns
    second = learning_run("default.py", tmp_path / "run", 1, *args)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "preparing" not in second.stderr and logged_entropy(second.stderr) == entropy
    assert "the run already reached train.steps = 60" in second.stderr
    assert os.stat(os.path.join(store_dir, MANIFEST)).st_mtime_ns == stamp
