"""One command that turns 8 minutes on an H100/H200 into numbers: ceilings, MFU beside its budget, a peer, checks.

    PYTHONPATH=. python3 benchmarks/gpu_suite.py --out DIR          # on the GPU machine, from the source tree
    PYTHONPATH=. python3 benchmarks/gpu_suite.py --out DIR --smoke  # the same code paths on a CPU, tiny shapes

Steps, in order (what decides the dense step's speed first), each in its own process (``gpu_probes.py``, the
peer's script, or pytest) with its own time box, each writing its results to DIR before the next starts (a step
that fails or runs out of time is recorded and the rest go on; steps past the budget are not run):

1. environment: device, memory, driver, jax/jaxlib/CUDA/cuDNN versions, the GPU preset and whether the installed
   jaxlib accepts its XLA flags;
2. ceilings: bf16 and fp8 8192^3 matmuls, HBM copy bandwidth, what one more kernel launch adds, and ragged_dot
   against one dense GEMM of the same FLOPs (about 1x: a grouped GEMM; about the number of groups: dense
   expansion); written to DIR/ceilings.json for the MFU steps;
3. MFU of the real train step (``CASES``): each case in a fresh process so its peak memory is its own, median of 10
   timed steps after compile and warm-up (``benchmarks/mfu.py``), beside the time budget of the very program it
   timed at the ceilings of step 2 (``jaxtron/metrics/budget.py``) and their ratio;
4. the peer (``benchmarks/peer_maxtext.py``, where it and its wheels are present): MaxText on the shape of the
   first case, its tokens/s beside jaxtron's;
5. the variants that decide defaults (``VARIANTS``: remat policies, FP8), as step 3;
6. predictions: each case compiled for a compile-only GPU of this machine's kind on the CPU
   (``jaxtron/gpu/target.py``; needs jax's CUDA 12 plugin, which the GPU machines lack: ``--only predictions``
   runs it on any machine that has it); then attention: cuDNN's causal kernel against the blockwise XLA kernel of
   a sharded sequence at 8k and 32k tokens, and whether the fused kernel takes DeepSeek-V3's head size (192);
   then the GPU tests (``pytest -m gpu``).

DIR receives ``suite.json`` (everything), ``table.md`` (ready to paste into benchmarks/README.md) and
``log.txt`` (each step's output). Wheels found in ``.whl/`` beside the code (``scripts/gpu_wheels.sh``) are
installed first with ``pip install --no-index --no-deps --target``. Exit code 0 when every step succeeded, 1
when one did not (its row says why), 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import glob
import json
import math
import os
import platform
import re
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

# neither imports jax: the parent process never touches the GPU
from jaxtron.gpu import preset as gpu_preset
from jaxtron.metrics.hardware import peak_flops
from jaxtron.metrics.kernels import describe

START = time.monotonic()


@dataclasses.dataclass(frozen=True)
class Case:
    """One MFU measurement: a config with overrides sized for one 80 GB GPU (the planner's estimate, with its
    15% error, stays under the usable memory: tests/test_gpu_suite.py checks it)."""
    name: str
    config: str
    overrides: tuple[tuple[str, str], ...]

    def smoke(self) -> tuple[tuple[str, str], ...]:
        """The same case shrunk to run on a CPU in seconds: same config, precision, MoE mode and code paths."""
        keep = {k: v for k, v in self.overrides
                if k in ("execution.fp8", "execution.moe_mode", "mesh.expert", "execution.remat",
                         "execution.scan_layers")}
        tiny = dict(SMOKE_SHAPE, **keep)
        return tuple(tiny.items())


_LLAMA8B = (("model.num_layers", "8"), ("data.seq_len", "4096"), ("train.global_batch_size", "4"),
            ("train.logit_chunks", "8"))
_LLAMA1B = (("train.global_batch_size", "4"), ("train.logit_chunks", "8"))  # whole model, sequence 8192
_LLAMA1B_32K = (("data.seq_len", "32768"), ("train.global_batch_size", "1"), ("train.logit_chunks", "8"))
_MIXTRAL = (("model.num_layers", "1"), ("data.seq_len", "4096"), ("train.global_batch_size", "4"),
            ("train.logit_chunks", "8"), ("mesh.expert", "1"))
CASES = (
    Case("llama3_8b 8/32 layers bf16", "configs/llama3_8b.py", _LLAMA8B),
    Case("llama3_8b 8/32 layers fp8", "configs/llama3_8b.py", (*_LLAMA8B, ("execution.fp8", "True"))),
    Case("llama3_1b bf16", "configs/llama3_1b.py", _LLAMA1B),
    Case("llama3_1b fp8", "configs/llama3_1b.py", (*_LLAMA1B, ("execution.fp8", "True"))),
    Case("llama3_1b 32k bf16", "configs/llama3_1b.py", _LLAMA1B_32K),
    Case("mixtral_8x7b 1/32 layers dropless", "configs/mixtral_8x7b.py",
         (*_MIXTRAL, ("execution.moe_mode", "dropless"))),
    Case("mixtral_8x7b 1/32 layers dropless fp8", "configs/mixtral_8x7b.py",
         (*_MIXTRAL, ("execution.moe_mode", "dropless"), ("execution.fp8", "True"))),
    Case("mixtral_8x7b 1/32 layers capacity", "configs/mixtral_8x7b.py",
         (*_MIXTRAL, ("execution.moe_mode", "capacity"))),
)
# the variants that decide defaults, measured after the cases and the peer: the remat policies 'auto' chooses
# between (full: the policy the earlier runs measured, in the same call as 'auto''s pick), FP8 under full remat,
# the layers in line rather than in a loop
_FULL = ("execution.remat", "full")
VARIANTS = (
    Case("variant: llama3_8b 8/32 layers bf16, remat full", "configs/llama3_8b.py", (*_LLAMA8B, _FULL)),
    Case("variant: llama3_8b 8/32 layers bf16, remat save_dots", "configs/llama3_8b.py",
         (*_LLAMA8B, ("execution.remat", "save_dots"))),
    Case("variant: llama3_8b 8/32 layers fp8, remat full", "configs/llama3_8b.py",
         (*_LLAMA8B, ("execution.fp8", "True"), _FULL)),
    Case("variant: llama3_1b bf16, remat full", "configs/llama3_1b.py", (*_LLAMA1B, _FULL)),
    # the layers in line (execution.scan_layers=False): no stacking copies of what the backward pass keeps
    Case("variant: llama3_8b 8/32 layers bf16, layers in line", "configs/llama3_8b.py",
         (*_LLAMA8B, ("execution.scan_layers", "False"))),
)
ALL_CASES = CASES + VARIANTS
SMOKE_SHAPE = {"model.num_layers": "1", "model.embed_dim": "64", "model.attention.num_heads": "4",
               "model.attention.num_kv_heads": "2", "model.attention.head_dim": "16", "model.mlp_dim": "128",
               "model.vocab_size": "512", "data.seq_len": "64",
               "train.global_batch_size": "4", "train.logit_chunks": "2"}


@dataclasses.dataclass(frozen=True)
class Step:
    name: str
    box_s: float  # its time box (smaller when the suite's budget is nearly spent)
    argv: tuple[str, ...]  # the process that runs it
    junit: bool = False  # the process is pytest, writing a JUnit XML report to {result}
    parallel: bool = False  # may run beside other parallel steps (--jobs)


# ---------------------------------------------------------------------------------------------------------------
# The parent: runs each step in its own process, time-boxed, and rewrites the results after every step.


class _Running:
    """A step's process, started inside a scratch folder that holds its result file and its own log."""

    def __init__(self, index: int, step: Step, env: dict[str, str]):
        self.index, self.step, self.start = index, step, time.monotonic()
        self.tmp = tempfile.TemporaryDirectory()
        self.result_file = os.path.join(self.tmp.name, "result.xml" if step.junit else "result.json")
        self.log_path = os.path.join(self.tmp.name, "log.txt")
        self.argv = [a.replace("{result}", self.result_file) for a in step.argv]
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO,
                                         start_new_session=True)

    def poll(self) -> tuple[bool, int | None]:
        """(finished, exit code); a step past its time box is killed with all it started (exit code None)."""
        rc = self.proc.poll()
        if rc is not None:
            return True, rc
        if time.monotonic() - self.start > self.step.box_s:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
            return True, None
        return False, None

    def finish(self, rc: int | None, log) -> dict:
        """The step's record; its output is appended to the suite's log."""
        with open(self.log_path, errors="replace") as f:
            output = f.read()
        log.write(f"\n===== {self.step.name} (time box {self.step.box_s:.0f} s): {' '.join(self.argv)}\n{output}")
        log.flush()
        out: dict = {"name": self.step.name, "status": "ok", "seconds": round(time.monotonic() - self.start, 1)}
        if self.step.junit:
            out["result"] = _read_junit(self.result_file)
        elif rc == 0 and os.path.exists(self.result_file):
            with open(self.result_file) as f:
                out["result"] = json.load(f)
        self.tmp.cleanup()
        failed_tests = [t["name"] for t in out.get("result", {}).get("tests", []) if t["outcome"] == "failed"]
        if rc is None:
            out.update(status="timed out", error=f"stopped after its time box of {self.step.box_s:.0f} s")
        elif failed_tests:
            out.update(status="failed", error=f"{len(failed_tests)} failed: {', '.join(failed_tests)}")
        elif rc != 0 and not (self.step.junit and rc == 5):  # pytest's 5: no test collected
            out.update(status="failed", error=f"exit code {rc}: {_last_error(output)}")
        elif "result" not in out:
            out.update(status="failed", error="the step wrote no result")
        return out


def run_steps(steps: list[Step], env: dict[str, str], log, deadline: float, jobs: int, done) -> list[dict]:
    """Run the steps in order, each inside min(its box, what is left of the budget). Steps marked parallel run up
    to ``jobs`` at a time (only a CPU smoke run uses more than one: a GPU runs one program at a time);
    ``done(records)`` is called after every step, with the records so far in step order."""
    records: list[dict | None] = [None] * len(steps)
    running: list[_Running] = []
    queue = list(enumerate(steps))
    def may_start(step: Step) -> bool:
        return not running or (step.parallel and len(running) < jobs and all(r.step.parallel for r in running))

    while queue or running:
        while queue and may_start(queue[0][1]):
            i, step = queue.pop(0)
            left = deadline - time.monotonic()
            if left < 10:
                records[i] = {"name": step.name, "status": "not run", "seconds": 0,
                              "error": "the suite's time budget (--budget) was spent"}
                done([r for r in records if r])
                continue
            running.append(_Running(i, dataclasses.replace(step, box_s=min(step.box_s, left)), env))
        time.sleep(0.1)
        for r in list(running):
            finished, rc = r.poll()
            if finished:
                running.remove(r)
                records[r.index] = r.finish(rc, log)
                done([x for x in records if x])
    return records


def _last_error(output: str) -> str:
    """The line of a step's output that says what went wrong (a Python exception's own line, usually)."""
    lines = [line.strip() for line in output.splitlines()[-200:] if line.strip()]
    for line in reversed(lines):
        if re.match(r"^[\w.]*(Error|Exception|Exit)\b", line) or line.startswith("error:"):
            return line[:500]
    return lines[-1][:500] if lines else "no output"


def _read_junit(path: str) -> dict:
    if not os.path.exists(path):
        return {"error": "pytest wrote no report", "tests": []}
    tests = []
    for case in ET.parse(path).getroot().iter("testcase"):
        outcome, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            node = case.find(tag)
            if node is not None:
                outcome = {"failure": "failed", "error": "failed", "skipped": "skipped"}[tag]
                message = (node.get("message") or "").splitlines()[0][:300] if node.get("message") else ""
        tests.append({"name": f"{case.get('classname', '').split('.')[-1]}::{case.get('name')}",
                      "outcome": outcome, "message": message, "seconds": float(case.get("time", 0))})
    return {"tests": tests}


def gpu_test_files() -> list[str]:
    """The test files that hold a ``gpu``-marked test (collecting only them keeps the step short)."""
    files = []
    for path in sorted(glob.glob(os.path.join(REPO, "tests", "test_*.py"))):
        with open(path) as f:
            if "@pytest.mark.gpu" in f.read():
                files.append(os.path.relpath(path, REPO))
    return files


PEER = os.path.join(REPO, "benchmarks", "peer_maxtext.py")
PEER_BESIDE = "llama3_8b 8/32 layers bf16"  # the case whose shape the peer trains
CEILINGS_FILE = "ceilings.json"  # the ceilings step's result, which the MFU steps price their budgets at


def plan_steps(smoke: bool, python: str, out_dir: str = "") -> list[Step]:
    """The steps in the order a GPU call spends its minutes on them: what decides the dense step's speed first
    (ceilings, the MFU cases beside their budgets, the peer, the variants that decide defaults), then the kernels'
    checks. The MFU steps read the ceilings the ceilings step measured from ``out_dir``."""
    here = os.path.dirname(os.path.abspath(__file__))
    smoke_flag = ("--smoke",) if smoke else ()
    probe_argv = (python, os.path.join(here, "gpu_probes.py"), "--result", "{result}", *smoke_flag)
    boxes = {"environment": 60, "predictions": 150, "ceilings": 90, "attention": 150, "gpu tests": 150, "mfu": 150,
             "peer": 240}
    mfu_argv = (*probe_argv, "--ceilings", os.path.join(out_dir, CEILINGS_FILE)) if out_dir else probe_argv
    # a smoke run (CPU, independent programs) runs the probes side by side too; a GPU runs one at a time
    steps = [Step("environment", boxes["environment"], (*probe_argv, "environment")),
             # alone, smoke runs too: the MFU steps after it read what it measured
             Step("ceilings", boxes["ceilings"], (*probe_argv, "ceilings"))]
    steps += [Step(f"mfu: {c.name}", boxes["mfu"], (*mfu_argv, f"mfu:{i}"), parallel=True)
              for i, c in enumerate(CASES)]
    if os.path.exists(PEER):
        # its own budget inside the step's box: a fallback that would outlast it is not started
        steps.append(Step("peer: maxtext", boxes["peer"], (python, PEER, "--result", "{result}", "--budget",
                                                           str(boxes["peer"] - 10), *smoke_flag), parallel=smoke))
    steps += [Step(f"mfu: {c.name}", boxes["mfu"], (*mfu_argv, f"mfu:{len(CASES) + i}"), parallel=True)
              for i, c in enumerate(VARIANTS)]
    steps += [Step("predictions", boxes["predictions"], (*probe_argv, "predictions"), parallel=smoke),
              Step("attention", boxes["attention"], (*probe_argv, "attention"), parallel=smoke),
              Step("gpu tests", boxes["gpu tests"],
                   (python, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider", "-o", "addopts=",
                    "--junitxml={result}", *gpu_test_files()), junit=True, parallel=smoke)]
    return steps


def install_wheels(wheel_dir: str, log, target: str | None = None) -> dict:
    """pip-install the wheels of ``wheel_dir`` (no index, no dependencies) into ``target``, a folder the steps
    get on their PYTHONPATH."""
    wheels = sorted(glob.glob(os.path.join(wheel_dir, "*.whl")))
    if not wheels:
        return {"status": "none found", "dir": wheel_dir}
    target = target or os.path.join(tempfile.gettempdir(), "jaxtron-gpu-wheels")
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
           "--no-cache-dir", "--upgrade", "--target", target, *wheels]
    log.write(f"\n===== wheels: {' '.join(cmd)}\n")
    log.flush()
    rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, timeout=300, check=False).returncode
    names = [os.path.basename(w) for w in wheels]
    if rc != 0:
        return {"status": f"pip failed (exit {rc}); the steps run without them", "dir": wheel_dir, "wheels": names}
    return {"status": "installed", "dir": wheel_dir, "target": target, "wheels": names}


def child_env(smoke: bool, wheels_target: str | None) -> dict[str, str]:
    """The environment of every step: the GPU preset (a variable already set wins), the source tree and the
    installed wheels on PYTHONPATH. A smoke run uses one CPU device, as the GPU run uses one GPU."""
    env = dict(os.environ)
    for name, (value, _) in gpu_preset.ENV.items():
        env.setdefault(name, value)
    flags = " ".join(f for f in (gpu_preset.xla_flags(), env.get("XLA_FLAGS", "")) if f)
    if smoke:
        env["JAX_PLATFORMS"] = "cpu"
        flags = " ".join(f for f in flags.split() if not f.startswith("--xla_force_host_platform_device_count"))
    else:
        env.setdefault("JAX_PLATFORMS", "cuda")  # the tests' conftest falls back to the CPU otherwise
    env["XLA_FLAGS"] = flags
    paths = [REPO, *([wheels_target] if wheels_target else []), env.get("PYTHONPATH", "")]
    env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    env["PYTHONUNBUFFERED"] = "1"
    if not smoke:  # a second run on the same machine (tuning) skips compiling and autotuning what it has seen
        env.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(tempfile.gettempdir(), "jaxtron-jax-cache"))
    return env


def _commit(given: str | None) -> str:
    if given:
        return given
    try:
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True,
                             timeout=30, check=False).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                               capture_output=True, text=True, timeout=30, check=False).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return (sha + (" with local changes" if dirty else "")) if sha else "unknown"


def _fmt(x, digits: int = 4) -> str:
    return "n/a" if x is None else f"{x:.{digits}g}"


def _of_peak(tflops: float, peak: float | None) -> str:
    if peak is None:
        return "no datasheet peak"
    return f"{100 * tflops / (peak / 1e12):.1f}% of the {peak / 1e12:g} dense peak"


def markdown(report: dict) -> str:
    """The results as markdown: header lines, then one table per kind of result."""
    env = next((s.get("result") for s in report["steps"] if s["name"] == "environment"), None) or {}
    device = env.get("device_kind", "unknown device")
    lines = [f"### {device}, {report['date'][:10]}, commit {report['commit']}", "",
             f"`{report['command']}`", ""]
    if env:
        mem = env.get("device_memory_bytes")
        lines.append(
            f"jax {env.get('jax')}, jaxlib {env.get('jaxlib')}, cuDNN {env.get('cudnn') or 'n/a'}, CUDA runtime "
            f"{env.get('cuda_runtime') or 'n/a'}, Python {env.get('python')}; {env.get('device_count')} x {device}"
            + (f" ({mem / 2**30:.1f} GiB usable)" if mem else "")
            + (f"; nvidia-smi: {env['nvidia_smi']}" if env.get("nvidia_smi") else "")
            + f"; XLA_FLAGS `{env.get('xla_flags') or '(none)'}`"
            + (f", unknown to this jaxlib: {env['xla_flags_unknown']}" if env.get("xla_flags_unknown") else "")
            + ".")
        lines.append("")
    wheels = report.get("wheels", {})
    lines += [f"Wheels from {wheels.get('dir', '.whl')}: {wheels.get('status', 'n/a')}"
              + (f" ({', '.join(w.split('-')[0] for w in wheels['wheels'])})" if wheels.get("wheels") else "") + ".",
              ""]
    ceil = next((s.get("result") for s in report["steps"] if s["name"] == "ceilings"), None)
    if ceil:
        n = ceil["matmul_size"]
        bf, f8, cp, rd = ceil["bf16_matmul"], ceil["fp8_matmul"], ceil["hbm_copy"], ceil["ragged_dot"]
        peak = {p: peak_flops(device, p)[0] for p in ("bfloat16", "fp8")}
        lines += ["| ceiling | best | median | note |", "|---|---|---|---|",
                  (f"| bf16 {n}^3 matmul | {_fmt(bf['tflops'])} TFLOP/s | {_fmt(2 * n ** 3 / bf['median_s'] / 1e12)} "
                  f"TFLOP/s | {_of_peak(bf['tflops'], peak['bfloat16'])} |"),
                  (f"| fp8 {n}^3 matmul | {_fmt(f8['tflops'])} TFLOP/s | {_fmt(2 * n ** 3 / f8['median_s'] / 1e12)} "
                  f"TFLOP/s | {_of_peak(f8['tflops'], peak['fp8'])}; cuBLASLt FP8 GEMM in the HLO: "
                  f"{'yes' if f8['cublaslt_fp8_gemm'] else 'no'} |"),
                  (f"| HBM copy ({_fmt(cp['bytes'] / 2**30, 3)} GiB read + written) | {_fmt(cp['tb_per_s'])} TB/s | "
                  f"{_fmt(cp['bytes'] / cp['median_s'] / 1e12)} TB/s | |")]
        for name, v in rd.items():
            if isinstance(v, dict):
                value = v.get("error") or f"{v['over_dense']:.2f}x one dense GEMM of the same FLOPs"
                lines.append(f"| ragged_dot, {rd['groups']} groups, {name} | {value} | | "
                             f"~1x: grouped; ~{rd['groups']}x: dense expansion |")
        lines.append("")
    att = next((s.get("result") for s in report["steps"] if s["name"] == "attention"), None)
    if att:
        lines += [(f"| causal attention, {att['heads']} heads ({att['kv_heads']} kv) x {att['head_dim']}, forward + "
                  f"backward | {att['reference']} | blockwise (XLA) | blockwise / {att['reference']} | "
                  "largest difference |"), "|---|---|---|---|---|"]
        for length, r in att["lengths"].items():
            lines.append(f"| {length} tokens | {_fmt(r['whole']['best_s'])} s, {_fmt(r['whole']['tflops'])} TFLOP/s | "
                         f"{_fmt(r['blockwise']['best_s'])} s, {_fmt(r['blockwise']['tflops'])} TFLOP/s | "
                         f"{r['blockwise_over_whole']:.2f}x | {r['max_abs_difference']:.2e} |")
        lines.append("")
        lines += [("| latent attention (DeepSeek-V3 head sizes), forward + backward | kernel | time | "
                  "largest difference from XLA (fp32) |"), "|---|---|---|---|"]
        r = att.get("latent")
        if r:
            result = (r["error"], "") if "error" in r else (f"{_fmt(r['best_s'])} s", f"{r['max_abs_difference']:.2e}")
            lines.append(f"| {r['heads']} heads, {r['length']} tokens, head size {r['head_dim']} | "
                         f"{r['implementation']} | {result[0]} | {result[1]} |")
        lines.append("")
        ch = att.get("chunks")
        if ch:
            lines += [(f"| one device of sequence={ch['shards']}, forward + backward | blockwise (XLA) | "
                      f"{ch['kernel']} by chunks | chunks / blockwise | largest difference |"), "|---|---|---|---|---|"]

            def cell(r):
                return r["error"] if "error" in r else f"{_fmt(r['best_s'])} s, {_fmt(r['tflops'])} TFLOP/s"
            for length, r in ch["lengths"].items():
                ratio = f"{r['chunks_over_blockwise']:.2f}x" if "chunks_over_blockwise" in r else ""
                diff = f"{r['max_abs_difference']:.2e}" if "max_abs_difference" in r else ""
                lines.append(f"| {length} tokens | {cell(r['blockwise'])} | {cell(r['chunks'])} | {ratio} | {diff} |")
            lines.append("")
    predictions = next((s.get("result") for s in report["steps"] if s["name"] == "predictions"), None)
    if predictions:
        lines += predictions_markdown(predictions)
    tests = next((s.get("result") for s in report["steps"] if s["name"] == "gpu tests"), None)
    if tests and tests.get("tests"):
        lines += ["| GPU test | outcome |", "|---|---|"]
        lines += [f"| {t['name']} | {t['outcome']}{': ' + t['message'] if t['message'] else ''} |"
                  for t in tests["tests"]]
        lines.append("")
    rows = [s for s in report["steps"] if s["name"].startswith("mfu: ")]
    if rows:
        predicted = (next((s.get("result") for s in report["steps"] if s["name"] == "predictions"), None)
                     or {}).get("cases", {})
        lines += [("| case | precision | attention | remat | seq | batch | step s (min-max) | tokens/s | "
                  "TFLOP/s | MFU | of ceiling | budget s | step / budget | peak mem | target's peak |"),
                  "|" + "---|" * 15]
        for s in rows:
            r = s.get("result")
            if not r:
                lines.append(f"| {s['name'][5:]} | {s['status']}: {s.get('error', '')} |" + " |" * 12)
                continue
            spent = r.get("budget")
            mem = r.get("peak_memory_bytes")
            mfu = f"{100 * r['mfu']:.1f}%" + ("" if r["mfu_basis"] == "dense datasheet peak" else "*")
            lines.append(" | ".join([
                f"| {r['case']}", r["precision"], r["attention"], r["remat"], str(r["seq_len"]),
                str(r["global_batch_size"]),
                f"{r['step_time_median_s']:.4f} ({r['step_time_min_s']:.4f}-{r['step_time_max_s']:.4f})",
                _fmt(r["tokens_per_sec"]), _fmt(r["tflops_per_device"]), mfu,
                f"{100 * r['fraction_of_matmul_ceiling']:.1f}%",
                f"{spent['seconds']:.4f}" if spent else "n/a",
                f"{r['step_over_budget']:.2f}" if spent else "n/a",
                "n/a" if mem is None else f"{mem / 2**30:.1f} GiB",
                _predicted_peak(predicted.get(r["case"]))]) + " |")
        lines.append("")
        lines.append("MFU: model FLOPs (causal attention counted once, no recompute) against the dense bf16 peak "
                     "(FP8 rows: the FLOP-weighted peak); * no datasheet peak for this device, MFU against the "
                     "matmul measured in the same process. \"of ceiling\": against the bf16 matmul that process "
                     "measured. \"budget\": the lower bound of the very program timed, each kernel at the ceiling "
                     "that binds it as this run measured them (jaxtron/metrics/budget.py).")
        lines.append("")
        lines += peer_markdown(report)
    lines += ["| step | status | seconds |", "|---|---|---|"]
    lines += [f"| {s['name']} | {s['status']}{': ' + s['error'] if s.get('error') else ''} | {s['seconds']} |"
              for s in report["steps"]]
    return "\n".join(lines) + "\n"


def peer_markdown(report: dict) -> list[str]:
    """The peer's row beside jaxtron's case of the same shape: tokens/s of each and their ratio."""
    peer = next((s for s in report["steps"] if s["name"].startswith("peer: ")), None)
    if peer is None:
        return []
    r = peer.get("result") or {}
    if peer["status"] != "ok" or "tokens_per_s" not in r:
        return [f"Peer {peer['name'][6:]}: {peer['status']}: {peer.get('error') or r.get('error', '')}", ""]
    ours = next((s.get("result") for s in report["steps"] if s["name"] == f"mfu: {PEER_BESIDE}"), None)
    lines = ["| same shape | tokens/s | step s | settings |", "|---|---|---|---|",
             (f"| {peer['name'][6:]} {r.get('maxtext_version', '')} | {_fmt(r['tokens_per_s'])} | "
              f"{_fmt(r.get('median_step_s'))} | remat {r.get('remat_policy')}, {r.get('attention')} attention"
              + (f" (fell back from {r['fallback_from']['attention']}, {r['fallback_from']['remat_policy']})"
                 if r.get("fallback_from") else "") + " |")]
    if ours:
        lines.append(f"| jaxtron ({ours['case']}) | {_fmt(ours['tokens_per_sec'])} | "
                     f"{_fmt(ours['step_time_median_s'])} | remat {ours['remat']}, {ours['attention']} attention |")
        lines += ["", f"jaxtron / {peer['name'][6:]} tokens/s: {ours['tokens_per_sec'] / r['tokens_per_s']:.2f}"]
    return lines + [""]


def _predicted_peak(prediction: dict | None) -> str:
    if not prediction:
        return "n/a"
    return prediction.get("error", "")[:80] or f"{prediction['peak_bytes'] / 2**30:.1f} GiB"


def predictions_markdown(result: dict) -> list[str]:
    """The predictions step as a table: each case's compiled peak, kernels and matmul FLOPs on the H100 target."""
    lines = [("| case (compiled for 1 x H100, no GPU) | peak | matmul TFLOP/step | GEMMs with float8 operands | "
              "kernels |"), "|---|---|---|---|---|"]
    for name, p in result.get("cases", {}).items():
        if "error" in p:
            lines.append(f"| {name} | {p['error'][:200]} | | | |")
            continue
        kernels = describe(p["kernels"])
        lines.append(f"| {name} | {p['peak_bytes'] / 2**30:.2f} GiB | {p['flops'] / 1e12:.4g} | {p['float8_gemms']} | "
                     f"{kernels} |")
    return lines + [""]


def write(out_dir: str, report: dict) -> None:
    for name, text in (("suite.json", json.dumps(report, indent=2, default=str)), ("table.md", markdown(report))):
        tmp = os.path.join(out_dir, f".{name}.tmp")
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, os.path.join(out_dir, name))


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="benchmarks/gpu_suite.py", description=__doc__.split("\n")[0])
    parser.add_argument("--out", help="folder for suite.json, table.md and log.txt (required)")
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny shapes: the same code paths in ~1 minute")
    parser.add_argument("--budget", type=float, default=None,
                        help="seconds for the whole suite (default 480, smoke 150); a step gets what is left")
    parser.add_argument("--only", default=None,
                        help="comma-separated step names or prefixes to run (e.g. 'ceilings,mfu: llama3_8b')")
    parser.add_argument("--jobs", type=int, default=None,
                        help="MFU cases run at a time (default 1; smoke: 2, the CPU's cores compile side by side)")
    parser.add_argument("--commit", default=None, help="the commit to record when the tree has no .git")
    parser.add_argument("--wheels", default=os.path.join(REPO, ".whl"), help="folder of wheels to install first")
    args = parser.parse_args(argv)
    if not args.out:
        print("error: --out DIR is required: the folder that receives the results.", file=sys.stderr)
        return 2
    budget = args.budget if args.budget is not None else (150.0 if args.smoke else 480.0)
    if budget <= 0 or not math.isfinite(budget):
        print(f"error: --budget must be a positive number of seconds, not {args.budget}.", file=sys.stderr)
        return 2
    if args.jobs is not None and args.jobs < 1:
        print(f"error: --jobs must be at least 1, not {args.jobs}.", file=sys.stderr)
        return 2
    steps = plan_steps(args.smoke, sys.executable, os.path.abspath(args.out))
    if args.only:
        wanted = [w.strip() for w in args.only.split(",") if w.strip()]
        steps = [s for s in steps if any(s.name.startswith(w) for w in wanted)]
        if not steps:
            print(f"error: --only {args.only!r} matches no step; the steps are "
                  f"{', '.join(s.name for s in plan_steps(args.smoke, sys.executable))}.", file=sys.stderr)
            return 2
    deadline = START + budget
    os.makedirs(args.out, exist_ok=True)
    report = {"date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
              "command": " ".join(["python3", "benchmarks/gpu_suite.py", *argv]), "commit": _commit(args.commit),
              "smoke": args.smoke, "budget_s": budget, "host": platform.node(), "steps": []}
    with open(os.path.join(args.out, "log.txt"), "w") as log:
        report["wheels"] = install_wheels(args.wheels, log)
        env = child_env(args.smoke, report["wheels"].get("target"))

        # this run's ceilings replace an earlier run's in the same folder (an MFU step run alone reuses those)
        written = []

        def done(records):
            report["steps"] = records
            write(args.out, report)
            measured = next((r.get("result") for r in records if r["name"] == "ceilings" and r["status"] == "ok"), None)
            if measured and not written:
                with open(os.path.join(args.out, CEILINGS_FILE), "w") as f:
                    json.dump(measured, f)
                written.append(True)

        run_steps(steps, env, log, deadline, args.jobs or (2 if args.smoke else 1), done)
    failed = [s["name"] for s in report["steps"] if s["status"] != "ok"]
    print(markdown(report))
    print(f"results in {args.out}: suite.json, table.md, log.txt"
          + (f"; not ok: {', '.join(failed)}" if failed else "; every step ok"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
