"""benchmarks/mfu.py measures the real step and reports consistent numbers (no timing is asserted)."""

import importlib.util
import json
import os

import pytest
from conftest import REPO


def _load():
    spec = importlib.util.spec_from_file_location("mfu_bench", os.path.join(REPO, "benchmarks", "mfu.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_benchmark_writes_a_consistent_report(tmp_path, capsys):
    bench = _load()
    out = tmp_path / "r.json"
    rc = bench.main([os.path.join(REPO, "configs", "default.py"), "--steps", "3", "--warmup", "1",
                     "--output", str(out), "--config.model.num_layers=1", "--config.data.seq_len=32",
                     "--config.mesh.fsdp=4", "--config.mesh.tensor=2"])
    assert rc == 0
    report = json.loads(out.read_text())
    (row,) = report["results"]
    assert report["device_count"] == 8 and row["mesh"]["fsdp"] == 4 and row["mesh"]["tensor"] == 2
    assert row["steps_timed"] == 3
    assert row["step_time_min_s"] <= row["step_time_median_s"] <= row["step_time_max_s"]
    assert abs(row["tokens_per_sec"] - 16 * 32 / row["step_time_median_s"]) < 1e-6 * row["tokens_per_sec"]
    # a CPU has no datasheet peak: MFU is against the matmul rate measured in the same run
    assert row["mfu_basis"] == "measured matmul ceiling" and row["matmul_ceiling_tflops"] > 0
    assert row["mfu"] == row["fraction_of_matmul_ceiling"] == row["tflops_per_device"] / row["matmul_ceiling_tflops"]
    assert row["precision"] == "float32"
    out = capsys.readouterr().out
    assert "default.py" in out and "against the matmul ceiling measured in the same run" in out


def test_benchmark_bad_input_exits_2(capsys):
    assert _load().main([os.path.join(REPO, "configs", "default.py"), "--config.mesh.fsdp=3"]) == 2
    assert capsys.readouterr().err.startswith("error: config field")
