"""benchmarks/gpu_suite.py: the smoke run on a CPU goes through every step, a failing or overlong step is recorded
while the rest go on, wheels found beside the code are installed, and every GPU case fits one 80 GB GPU."""

import importlib.util
import json
import os
import subprocess
import sys
import time
import zipfile

import pytest
from conftest import REPO

from jaxtron.config.loader import load_config
from jaxtron.parallel.checks import check_devices
from jaxtron.planning.estimate import MARGIN, estimate
from jaxtron.planning.gpus import gpu

pytestmark = pytest.mark.integration  # crosses a process boundary: .ci/run's tier, not the README's

SUITE = os.path.join(REPO, "benchmarks", "gpu_suite.py")


def _load():
    spec = importlib.util.spec_from_file_location("gpu_suite", SUITE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


suite = _load()


# the MFU cases the smoke test runs: dense bf16, and the dropless MoE in FP8 (its attention projections FP8 too;
# the others take the same code paths with other configs, and each costs a process and a compile)
SMOKE_CASES = [c for c in suite.CASES
               if c.name in ("llama3_8b 8/32 layers bf16", "mixtral_8x7b 1/32 layers dropless fp8")]


@pytest.mark.slow
def test_the_smoke_run_goes_through_every_step_and_writes_its_results(tmp_path):
    out = tmp_path / "results"
    wanted = ["environment", "predictions", "ceilings", "attention", "gpu tests",
              *(f"mfu: {c.name}" for c in SMOKE_CASES)]
    only = ",".join(wanted)
    proc = subprocess.run([sys.executable, SUITE, "--smoke", "--out", str(out), "--only", only], capture_output=True,
                          text=True, timeout=600, cwd=tmp_path, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert sorted(os.listdir(out)) == ["ceilings.json", "log.txt", "suite.json", "table.md"]
    report = json.loads((out / "suite.json").read_text())
    names = [s["name"] for s in report["steps"]]
    # in the suite's order: the ceilings and the MFU cases first, the checks last
    assert names == ["environment", "ceilings", *(f"mfu: {c.name}" for c in SMOKE_CASES), "predictions",
                     "attention", "gpu tests"]
    assert all(s["status"] == "ok" for s in report["steps"]), [s for s in report["steps"] if s["status"] != "ok"]
    steps = {s["name"]: s["result"] for s in report["steps"]}

    env = steps["environment"]
    assert env["backend"] == "cpu" and env["device_count"] == 1 and env["xla_flags_unknown"] == []
    from jaxtron.gpu.target import plugin_installed
    predicted = steps["predictions"]["cases"][suite.CASES[0].name]  # the first case, compiled for an H100
    if plugin_installed():
        assert predicted["peak_bytes"] > 0 and predicted["kernels"]["__cudnn$fmhaSoftmaxBackward"] >= 1, predicted
        row = f"| {suite.CASES[0].name} | {predicted['peak_bytes'] / 2**30:.2f} GiB |"
        assert row in (out / "table.md").read_text()
    else:
        assert "CUDA plugin is not installed" in predicted["error"]
    ceilings = steps["ceilings"]
    for name in ("bf16_matmul", "fp8_matmul"):
        assert ceilings[name]["tflops"] == pytest.approx(2 * 512 ** 3 / ceilings[name]["best_s"] / 1e12)
    assert ceilings["fp8_matmul"]["cublaslt_fp8_gemm"] is False  # a CPU has no cuBLASLt
    assert ceilings["hbm_copy"]["tb_per_s"] > 0 and ceilings["ragged_dot"]["default"]["over_dense"] > 0
    assert ceilings["launch"]["kernels"] >= 50 and ceilings["launch"]["seconds"] > 0
    assert json.loads((out / "ceilings.json").read_text()) == ceilings

    attention = steps["attention"]["lengths"]["256"]  # the blockwise kernel against XLA's whole matrix on a CPU
    assert attention["max_abs_difference"] < 0.05 and attention["blockwise"]["tflops"] > 0
    assert attention["blockwise_over_whole"] == pytest.approx(attention["blockwise"]["best_s"]
                                                              / attention["whole"]["best_s"])
    latent = steps["attention"]["latent"]  # DeepSeek-V3's head size, shrunk
    assert latent["head_dim"] == 24 and "error" not in latent, latent
    assert latent["max_abs_difference"] < 0.05 and latent["best_s"] > 0
    chunks = steps["attention"]["chunks"]["lengths"]["256"]  # one shard: the XLA kernel by chunks on a CPU
    assert "error" not in chunks["chunks"] and chunks["max_abs_difference"] < 0.05, chunks
    assert chunks["chunks_over_blockwise"] == pytest.approx(chunks["chunks"]["best_s"] / chunks["blockwise"]["best_s"])

    tests = {t["name"]: t["outcome"] for t in steps["gpu tests"]["tests"]}
    assert tests["test_attention::test_the_private_cudnn_function_still_takes_the_call_jaxtron_makes"] == "passed"
    assert tests["test_attention::test_cudnn_matches_the_xla_reference_on_a_gpu[True]"] == "skipped"
    assert len(tests) >= 7 and set(tests.values()) == {"passed", "skipped"}

    table = (out / "table.md").read_text()
    assert len(SMOKE_CASES) == 2
    for case in SMOKE_CASES:
        row = steps[f"mfu: {case.name}"]
        assert row["steps_timed"] == 10 and row["tokens_per_sec"] == pytest.approx(
            row["global_batch_size"] * row["seq_len"] / row["step_time_median_s"])
        assert row["precision"].endswith("+fp8") == (("execution.fp8", "True") in case.overrides)
        assert row["mesh"] == {"pipeline": 1, "data": 1, "fsdp": 1, "sequence": 1, "expert": 1, "tensor": 1}
        assert f"| {case.name} | {row['precision']} |" in table
        # the budget of the program it timed, at the ceilings this run measured
        spent = row["budget"]
        assert spent["ceilings"]["bf16_flops"] == pytest.approx(ceilings["bf16_matmul"]["tflops"] * 1e12)
        assert row["step_over_budget"] == pytest.approx(row["step_time_median_s"] / spent["seconds"])
    assert "| bf16 512^3 matmul |" in table and "| ragged_dot, 4 groups, default |" in table
    assert "| 256 tokens |" in table and "| 4 heads, 256 tokens, head size 24 | xla |" in table
    assert report["commit"] and report["smoke"] is True


def _step(name, code, box=30.0, parallel=False):
    return suite.Step(name, box, (sys.executable, "-c", code), parallel=parallel)


def test_a_failing_or_overlong_step_is_recorded_and_the_rest_go_on(tmp_path):
    steps = [
        _step("fails", "import sys; print('working'); print('ValueError: no such kernel'); sys.exit(3)"),
        _step("hangs", "import time; time.sleep(60)", box=1.0),
        _step("works", "import json, sys; json.dump({'x': 1}, open(sys.argv[1], 'w'))"),
        _step("writes nothing", "pass"),
    ]
    steps[2] = suite.Step("works", 30.0, (*steps[2].argv, "{result}"))
    seen = []
    with open(tmp_path / "log.txt", "w") as log:
        records = suite.run_steps(steps, dict(os.environ), log, time.monotonic() + 120, 1, seen.append)
    assert [(r["name"], r["status"]) for r in records] == [
        ("fails", "failed"), ("hangs", "timed out"), ("works", "ok"), ("writes nothing", "failed")]
    assert records[0]["error"] == "exit code 3: ValueError: no such kernel"
    assert records[1]["error"] == "stopped after its time box of 1 s" and records[1]["seconds"] < 30
    assert records[2]["result"] == {"x": 1} and records[3]["error"] == "the step wrote no result"
    assert [len(s) for s in seen] == [1, 2, 3, 4]  # the results were written after every step
    assert "===== fails" in (tmp_path / "log.txt").read_text()


def test_steps_past_the_budget_are_not_run_and_parallel_steps_share_the_machine(tmp_path):
    # each step marks its start, then waits for the other's mark: both end well only if they ran side by side
    meet = ("import json, os, sys, time; me, other, result = sys.argv[1:4]; open(me, 'w').close(); "
            "end = time.time() + 60\nwhile not os.path.exists(other) and time.time() < end: time.sleep(0.05)\n"
            "json.dump({'met': os.path.exists(other)}, open(result, 'w'))")
    marks = [str(tmp_path / f"p{i}") for i in range(2)]
    steps = [suite.Step(f"p{i}", 90.0, (sys.executable, "-c", meet, marks[i], marks[1 - i], "{result}"),
                        parallel=True) for i in range(2)]
    with open(tmp_path / "log.txt", "w") as log:
        records = suite.run_steps(steps, dict(os.environ), log, time.monotonic() + 120, 2, lambda r: None)
        late = suite.run_steps(steps[:1], dict(os.environ), log, time.monotonic() + 5, 1, lambda r: None)
    assert [(r["status"], r["result"]) for r in records] == [("ok", {"met": True})] * 2
    assert late == [{"name": "p0", "status": "not run", "seconds": 0,
                     "error": "the suite's time budget (--budget) was spent"}]


def _wheel(path, name="jaxtron_probe_pkg"):
    """A minimal pure-Python wheel, built by hand (no network, no build backend)."""
    dist = f"{name}-0.1.dist-info"
    files = {f"{name}/__init__.py": "VALUE = 42\n",
             f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n",
             f"{dist}/WHEEL": "Wheel-Version: 1.0\nGenerator: hand\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    files[f"{dist}/RECORD"] = "".join(f"{f},,\n" for f in files) + f"{dist}/RECORD,,\n"
    with zipfile.ZipFile(path / f"{name}-0.1-py3-none-any.whl", "w") as z:
        for f, text in files.items():
            z.writestr(f, text)


def test_wheels_found_beside_the_code_are_installed_and_put_on_the_steps_path(tmp_path):
    wheels = tmp_path / "whl"
    wheels.mkdir()
    with open(tmp_path / "log.txt", "w") as log:
        assert suite.install_wheels(str(tmp_path / "none"), log, str(tmp_path / "t0"))["status"] == "none found"
        _wheel(wheels)
        done = suite.install_wheels(str(wheels), log, str(tmp_path / "site"))
    assert done["status"] == "installed" and done["wheels"] == ["jaxtron_probe_pkg-0.1-py3-none-any.whl"]
    env = suite.child_env(False, done["target"])
    assert env["PYTHONPATH"].split(os.pathsep)[:2] == [REPO, done["target"]]
    assert env["JAX_PLATFORMS"] in ("cuda", os.environ.get("JAX_PLATFORMS"))
    probe = subprocess.run([sys.executable, "-c", "import jaxtron_probe_pkg as p; print(p.VALUE)"], env=env,
                           capture_output=True, text=True, timeout=60, check=False)
    assert probe.stdout.strip() == "42", probe.stderr
    smoke = suite.child_env(True, None)
    assert smoke["JAX_PLATFORMS"] == "cpu" and "xla_force_host_platform_device_count" not in smoke["XLA_FLAGS"]


@pytest.mark.parametrize("case", suite.ALL_CASES, ids=lambda c: c.name)
def test_every_gpu_case_fits_one_80gb_gpu_by_the_planners_estimate(case):
    """With the planner's 10% error to spare (remat 'auto' picks its policy with that margin)."""
    cfg = load_config(os.path.join(REPO, case.config), list(case.overrides))
    h100 = gpu("h100")
    sizes = dict(pipeline=1, data=1, fsdp=1, sequence=1, expert=1, tensor=1)
    assert check_devices(cfg, 1) == sizes
    need = estimate(cfg, sizes, h100).memory_bytes
    assert (1 + MARGIN) * need <= h100.usable_bytes, f"{case.name}: {need / 2**30:.1f} GiB estimated"


@pytest.mark.parametrize("argv,message", [
    (["--smoke"], "--out DIR is required"),
    (["--out", "x", "--budget", "0"], "--budget must be a positive number of seconds"),
    (["--out", "x", "--jobs", "0"], "--jobs must be at least 1"),
    (["--out", "x", "--only", "nothing"], "--only 'nothing' matches no step; the steps are environment, "),
])
def test_bad_arguments_get_one_sentence_and_exit_2(argv, message, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert suite.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {message}") and err.count("\n") == 1


def _peer():
    spec = importlib.util.spec_from_file_location("peer_maxtext", PEER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


PEER = os.path.join(REPO, "benchmarks", "peer_maxtext.py")


def test_the_peers_step_time_is_the_median_of_maxtexts_own_lines_after_the_first_two(tmp_path):
    """MaxText's 'completed step' lines (its log, where no metrics file was written): the two first steps (compile,
    first dispatches) are left out, and tokens/s is the global batch times the sequence over the median step."""
    peer = _peer()
    log = "\n".join(f"completed step: {i}, seconds: {s}, TFLOP/s/device: 1.0, Tokens/s/device: 10.0, "
                    f"total_weights: 256, loss: {7.0 - 0.1 * i}"
                    for i, s in enumerate([9.0, 0.02, 0.30, 0.40, 0.35, 0.31, 0.33]))
    steps = peer.parse_steps(str(tmp_path), log)
    assert [s["step"] for s in steps] == list(range(7)) and steps[-1]["loss"] == pytest.approx(6.4)
    args = type("Args", (), {"smoke": True})()
    got = peer.summarize(args, {"text": log, "steps": steps})
    assert got["median_step_s"] == 0.33 and got["timed_steps"] == 5
    assert got["tokens_per_s"] == pytest.approx(2 * 128 / 0.33, rel=1e-3)  # the smoke shape: batch 2 x 128


def test_without_its_wheels_the_peer_says_so_in_one_line(tmp_path):
    result = tmp_path / "peer.json"
    proc = subprocess.run([sys.executable, PEER, "--smoke", "--result", str(result), "--wheels", str(tmp_path / "none"),
                           "--site", str(tmp_path / "site")], capture_output=True, text=True, timeout=300,
                          check=False)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    got = json.loads(result.read_text())
    assert got["status"] == "failed" and got["error"].startswith("maxtext is not installed: run scripts/peer_wheels.sh")
