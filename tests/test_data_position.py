"""Resuming with a changed data setup: refused in one sentence, or continued from the consumed tokens."""

import dataclasses
import hashlib
import json
import logging
import threading
from pathlib import Path

import jax
import pytest
from helpers import tiny_config

from jaxtron.config.schema import DataConfig
from jaxtron.data import position as position_lib
from jaxtron.data.errors import DataError
from jaxtron.data.loader import SyntheticSource
from jaxtron.data.prepare import prepare
from jaxtron.training import loop as loop_lib


class Recording(SyntheticSource):
    """Synthetic rows that remember which global samples were asked for."""

    def __init__(self, seq_len: int = 32):
        super().__init__(256, seq_len, 0)
        self.asked: list[int] = []
        self._lock = threading.Lock()

    def rows(self, samples):
        with self._lock:
            self.asked.extend(int(g) for g in samples)
        return super().rows(samples)


def _run(cfg, workdir, source):
    return loop_lib.run(cfg, str(workdir), use_tqdm=False, devices=jax.devices()[:1])


@pytest.mark.slow
def test_a_changed_batch_size_is_refused_then_continued_from_the_consumed_tokens(tmp_path, monkeypatch):
    sources = []

    def make_sources(cfg):
        sources.append(Recording(cfg.data.seq_len))
        return sources[-1], None, {}

    monkeypatch.setattr(loop_lib, "make_sources", make_sources)
    cfg = tiny_config(train=dict(steps=4, global_batch_size=8), checkpoint=dict(every=2))
    _run(cfg, tmp_path, None)
    assert min(sources[0].asked) == 0 and max(sources[0].asked) >= 31  # steps 1-4 read samples 0..31

    bigger = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, steps=6, global_batch_size=16))
    with pytest.raises(DataError) as refused:
        _run(bigger, tmp_path, None)
    message = str(refused.value)
    assert message.startswith("the checkpoint of step 4 was written with another data setup "
                              "(train.global_batch_size 8 -> 16), so resuming would skip or repeat data;")
    assert "--config.data.resume_from_tokens=true to go on from token 1,024 of the data stream" in message

    accept = dataclasses.replace(bigger, data=dataclasses.replace(bigger.data, resume_from_tokens=True))
    summary = _run(accept, tmp_path, None)
    # step 5 starts at sample 32, the first the old setup had not read; steps 5 and 6 read 32..63, once each
    assert sorted(sources[-1].asked)[:32] == list(range(32, 64))
    assert [h["consumed_tokens"] for h in summary.history] == [(32 + 16) * 32, (32 + 32) * 32]

    # the new setup is recorded: a plain restart with it resumes exactly, without the flag
    longer = dataclasses.replace(bigger, train=dataclasses.replace(bigger.train, steps=7))
    resumed = _run(longer, tmp_path, None)
    assert sorted(sources[-1].asked)[:16] == list(range(64, 80))
    assert resumed.history[-1]["consumed_tokens"] == 80 * 32
    saved = json.loads(Path(tmp_path / "checkpoints" / "7" / "data" / "metadata").read_text())
    assert saved["consumed_tokens"] == 80 * 32 and saved["sample_offset"] == 64 - 6 * 16


def _store_config(path, **data):
    cfg = tiny_config()
    return dataclasses.replace(cfg, data=DataConfig(source="store", path=str(path), seq_len=32, **data))


def test_changed_stores_seeds_and_lengths_are_named(tmp_path):
    text = tmp_path / "a.txt"
    text.write_text("an example document about resuming runs\n" * 40)
    prepare([str(text)], "byte", str(tmp_path / "store"))
    cfg = _store_config(tmp_path / "store")
    saved = position_lib.DataPosition.start(cfg, position_lib.fingerprint(cfg)).at(10).to_dict()
    assert position_lib.resume(cfg, position_lib.fingerprint(cfg), saved).offset == 0  # unchanged: exact resume

    text.write_text("another text altogether, of a similar length\n" * 40)
    prepare([str(text)], "byte", str(tmp_path / "store"), overwrite=True)
    changed = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, seq_len=16, weights=""),
                                  train=dataclasses.replace(cfg.train, seed=3))
    with pytest.raises(DataError, match=r"\(data.seq_len 32 -> 16; tokens of data.path differs; "
                                        r"train.seed 0 -> 3\)"):
        position_lib.resume(changed, position_lib.fingerprint(changed), saved)
    accept = dataclasses.replace(changed, data=dataclasses.replace(changed.data, resume_from_tokens=True))
    position = position_lib.resume(accept, position_lib.fingerprint(accept), saved)
    # 10 steps of 8 x 32 tokens = 2560 tokens = sample 160 of 16 tokens; row 0 of step 10 reads it
    assert position.offset + 10 * 8 == 160 and position.consumed_tokens == 2560


def test_a_store_prepared_again_by_a_newer_version_resumes_and_older_checkpoints_still_do(tmp_path):
    """The fingerprint names what the tokens are (the shards' checksums), not how the manifest is written: a store
    whose manifest gained a field resumes a checkpoint of the same tokens. A checkpoint of an older version, which
    digested the whole manifest ("content of"), resumes while that manifest is unchanged."""
    text = tmp_path / "a.txt"
    text.write_text("an example document about resuming runs\n" * 40)
    prepare([str(text)], "byte", str(tmp_path / "store"))
    cfg = _store_config(tmp_path / "store")
    saved = position_lib.DataPosition.start(cfg, position_lib.fingerprint(cfg)).at(10).to_dict()
    manifest = tmp_path / "store" / "manifest.json"
    legacy = position_lib.fingerprint(cfg, legacy=True)
    assert "content of data.path" in legacy and "tokens of data.path" not in legacy
    # what a version before 5b3a1c9 recorded: the digest of its manifest file, which had no loss_mask key
    fields = json.loads(manifest.read_text())
    assert fields.pop("loss_mask") is False
    written_then = json.dumps(fields, indent=2, sort_keys=True).encode()
    older = {**saved, "fingerprint": {**legacy, "content of data.path": hashlib.sha256(written_then).hexdigest()}}
    assert position_lib.resume(cfg, position_lib.fingerprint(cfg), older).fingerprint == position_lib.fingerprint(cfg)
    fields = json.loads(manifest.read_text())
    manifest.write_text(json.dumps({**fields, "a_field_of_a_newer_version": True}, indent=2))
    assert position_lib.resume(cfg, position_lib.fingerprint(cfg), saved).offset == 0
    with pytest.raises(DataError, match=r"\(content of data.path differs\)"):  # the manifest an old one digested
        position_lib.resume(cfg, position_lib.fingerprint(cfg), older)
    fields["shards"][0]["tokens_sha256"] = "0" * 64  # other tokens
    manifest.write_text(json.dumps(fields))
    with pytest.raises(DataError, match=r"\(tokens of data.path differs\)"):
        position_lib.resume(cfg, position_lib.fingerprint(cfg), saved)


def test_a_checkpoint_without_a_data_record_resumes_with_a_warning(caplog):
    cfg = tiny_config()
    with caplog.at_level(logging.WARNING):
        position = position_lib.resume(cfg, position_lib.fingerprint(cfg), {"step": 5})
    assert (position.step, position.offset, position.consumed_tokens) == (5, 0, 5 * 8 * 32)
    assert "no record of its data setup" in caplog.text
