"""Weights & Biases beside metrics.jsonl: every metric, the config, one run id across a resume, losses unchanged."""

import glob
import importlib.util
import json
import os
import struct

import pytest
from helpers import metrics_lines

from jaxtron import cli

TINY = ["--config.data.source=synthetic", "--config.model.num_layers=1", "--config.model.embed_dim=64",
        "--config.model.attention.num_heads=4", "--config.model.attention.num_kv_heads=4",
        "--config.model.mlp_dim=128", "--config.data.seq_len=32", "--config.train.global_batch_size=8",
        "--config.train.log_every=1", "--config.train.eval_batches=0", "--config.checkpoint.every=2"]


def test_a_missing_wandb_package_is_refused_before_anything_is_written(tmp_path, monkeypatch, capsys):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    workdir = tmp_path / "run"
    assert cli.main(["train", *TINY, "--config.train.steps=2", "--config.train.wandb_project=p",
                     f"--workdir={workdir}"]) == 2
    err = capsys.readouterr().err
    assert "config field 'train.wandb_project' is set but the wandb package is not installed" in err
    assert "Traceback" not in err and not workdir.exists()


def wandb_records(path: str) -> list:
    """The records of an offline W&B run file: a header, then 32 KiB blocks of checksummed chunks."""
    from wandb.proto import wandb_internal_pb2
    with open(path, "rb") as f:
        data = f.read()
    assert data[:4] == b":W&B"
    block, position, records, pieces = 32768, 7, [], b""
    while position + 7 <= len(data):
        left = block - position % block
        _, length, kind = struct.unpack("<IHB", data[position:position + 7]) if left >= 7 else (0, 0, 0)
        if left < 7 or length == kind == 0:  # the rest of a block too short for a chunk header is padding
            position += left
            continue
        pieces += data[position + 7:position + 7 + length]
        position += 7 + length
        if kind in (1, 4):  # a whole record, or the last chunk of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pieces)
            records.append(record)
            pieces = b""
    return records


def _history(run_file: str) -> tuple[dict, dict[int, dict]]:
    """(the run record's fields, {step: logged values}) of one offline W&B run file."""
    run, steps = {}, {}
    for record in wandb_records(run_file):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run = {"id": record.run.run_id, "name": record.run.display_name, "project": record.run.project,
                   "config": {c.key: json.loads(c.value_json) for c in record.run.config.update}}
        elif kind == "history":
            values = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in
                      record.history.item}
            steps[values["_step"]] = {k: v for k, v in values.items() if not k.startswith("_")}
    return run, steps


@pytest.mark.integration
@pytest.mark.slow
def test_wandb_gets_every_metric_keeps_its_run_across_a_resume_and_leaves_losses_alone(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb_files"))
    (tmp_path / "wandb_files").mkdir()
    plain, logged = tmp_path / "plain", tmp_path / "logged"
    assert cli.main(["train", *TINY, "--config.train.steps=8", f"--workdir={plain}"]) == 0
    on = [*TINY, "--config.train.wandb_project=jaxtron-tests", f"--workdir={logged}"]
    assert cli.main(["train", *on, "--config.train.steps=4"]) == 0
    run_id = (logged / "wandb_run_id").read_text().strip()
    assert cli.main(["train", *on, "--config.train.steps=8"]) == 0  # the resume, with train.steps raised
    assert (logged / "wandb_run_id").read_text().strip() == run_id

    records = metrics_lines(logged)
    assert [r["step"] for r in records] == list(range(1, 9))
    assert [r["loss"] for r in records] == [r["loss"] for r in metrics_lines(plain)]  # bit for bit
    runs = sorted(glob.glob(str(tmp_path / "wandb_files" / "wandb" / "offline-run-*" / "run-*.wandb")))
    assert len(runs) == 2 and all(os.path.basename(r) == f"run-{run_id}.wandb" for r in runs)
    seen = {}
    for run_file in runs:
        run, steps = _history(run_file)
        assert run["id"] == run_id and run["name"] == "logged" and run["project"] == "jaxtron-tests"
        assert run["config"]["workdir"] == str(logged)
        assert run["config"]["train"]["wandb_project"] == "jaxtron-tests"
        seen.update(steps)
    assert sorted(seen) == list(range(1, 9))
    for record in records:  # every metric metrics.jsonl holds, with its value (nulls are left out)
        expected = {k: v for k, v in record.items() if k != "step" and v is not None}
        assert seen[record["step"]] == expected, record["step"]
