"""Two real processes (4 CPU devices each, gloo collectives) train exactly like one process with 8 devices."""

import os
import socket
import subprocess
import sys

import numpy as np
import pytest
from conftest import REPO, cpu_xla_flags
from helpers import metrics_lines

pytestmark = pytest.mark.integration  # crosses a process boundary: .ci/run's tier, not the README's

TINY = ["--config.data.source=synthetic", "--config.model.num_layers=1", "--config.model.embed_dim=64",
        "--config.model.attention.num_heads=4", "--config.model.attention.num_kv_heads=4", "--config.model.mlp_dim=128",
        "--config.data.seq_len=32", "--config.train.global_batch_size=8", "--config.train.steps=3",
        "--config.train.log_every=1", "--config.train.eval_batches=0"]


def _env(devices: int, **extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_")}
    env.update(XLA_FLAGS=cpu_xla_flags(devices), JAX_PLATFORMS="cpu", **extra)
    return env


def _losses(workdir) -> list[float]:
    return [record["loss"] for record in metrics_lines(workdir)]


@pytest.fixture(scope="session")  # once per test process (tests/conftest.py)
def one_process(tmp_path_factory):
    workdir = str(tmp_path_factory.mktemp("one"))
    subprocess.run([sys.executable, "train.py", *TINY, "--config.mesh.fsdp=8", f"--workdir={workdir}"],
                   cwd=REPO, env=_env(8), check=True, capture_output=True, timeout=300)
    return _losses(workdir)


def _two_processes(args: list[str], workdir) -> list[str]:
    """Runs train.py as two processes of 4 CPU devices; returns their outputs once both exited 0."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [subprocess.Popen([sys.executable, "train.py", *args, f"--workdir={workdir}"], cwd=REPO,
                              env=_env(4, JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}", JAX_NUM_PROCESSES="2",
                                       JAX_PROCESS_ID=str(i)),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(2)]
    outputs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs
    return outputs


@pytest.mark.slow
@pytest.mark.parametrize("mesh", [["--config.mesh.sequence=2", "--config.mesh.tensor=4", "--config.mesh.fsdp=1"],
                                  ["--config.mesh.data=2", "--config.mesh.fsdp=2", "--config.mesh.tensor=2"]],
                         ids=["sequence_across_processes", "data_across_processes"])
def test_two_processes_equal_one(mesh, one_process, tmp_path):
    outputs = _two_processes([*TINY, *mesh], tmp_path)
    assert "process 1 of 2 joined" in outputs[1]
    np.testing.assert_allclose(_losses(tmp_path), one_process, rtol=1e-5)  # written once, by process 0
    assert sorted(f for f in os.listdir(tmp_path) if not f.startswith("events")) == \
        ["checkpoints", "collectives.json", "config.json", "metrics.jsonl", "run.lock"]  # the lock: process 0's
    assert os.listdir(tmp_path / "checkpoints") == ["3"]  # one checkpoint, written together by both processes


@pytest.mark.slow
def test_pipeline_stages_on_two_processes_equal_one_process(tmp_path):
    """The pipeline axis is the outermost, so each process holds one stage: the activations cross processes."""
    args = [*TINY, "--config.model.num_layers=4", "--config.checkpoint.every=0"]
    subprocess.run([sys.executable, "train.py", *args, "--config.mesh.fsdp=8", f"--workdir={tmp_path / 'one'}"],
                   cwd=REPO, env=_env(8), check=True, capture_output=True, timeout=300)
    outputs = _two_processes([*args, "--config.mesh.pipeline=2", "--config.mesh.fsdp=2", "--config.mesh.tensor=2",
                              "--config.pipeline.microbatches=2", "--config.pipeline.virtual_stages=2"],
                             tmp_path / "two")
    assert "pipeline: fill_drain schedule, 2 stages x 2 virtual stages, 2 microbatches; bubble fraction 0.200" in \
        outputs[0]
    np.testing.assert_allclose(_losses(tmp_path / "two"), _losses(tmp_path / "one"), rtol=1e-5)


def test_partial_coordinator_environment_is_an_error(tmp_path):
    out = subprocess.run([sys.executable, "train.py", *TINY, f"--workdir={tmp_path}"], cwd=REPO, text=True,
                         env=_env(8, JAX_COORDINATOR_ADDRESS="127.0.0.1:1"), capture_output=True, timeout=120,
                         check=False)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert out.stderr.startswith("error: JAX_COORDINATOR_ADDRESS set but JAX_NUM_PROCESSES, JAX_PROCESS_ID not")


@pytest.mark.slow
def test_a_signal_to_one_process_stops_both_after_the_same_step(tmp_path):
    import re
    import signal
    import time
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    args = [*TINY, "--config.train.steps=100000", "--config.checkpoint.every=0", "--config.mesh.data=2",
            "--config.mesh.fsdp=4"]
    procs = [subprocess.Popen([sys.executable, "train.py", *args, f"--workdir={tmp_path}"], cwd=REPO,
                              env=_env(4, JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}", JAX_NUM_PROCESSES="2",
                                       JAX_PROCESS_ID=str(i)),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(2)]
    metrics = tmp_path / "metrics.jsonl"
    deadline = time.time() + 240
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3) and time.time() < deadline:
        assert all(p.poll() is None for p in procs)
        time.sleep(0.05)
    procs[1].send_signal(signal.SIGTERM)  # only one of them: like a signal that reaches the nodes at different steps
    outputs = [p.communicate(timeout=120)[0] for p in procs]
    assert [p.returncode for p in procs] == [75, 75], outputs
    stopped = [re.findall(r"checkpointed step (\d+) after (.+?); exiting", out) for out in outputs]
    assert stopped[1][0][1] == "SIGTERM" and stopped[0][0][1] == "a stop request from another process", stopped
    assert stopped[0][0][0] == stopped[1][0][0]
    assert os.listdir(tmp_path / "checkpoints") == [stopped[0][0][0]]  # written once, by both together
