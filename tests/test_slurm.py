"""A real Slurm cluster (scripts/slurm/local_cluster.sh): srun -n 2, 2 processes x 4 CPU devices.

The processes find each other from srun's environment alone, train like one process with 8 devices, write
each checkpoint once, and the run resumes under another process count. When one task is killed, the other
exits by itself (no hang) and a new srun resumes from the last checkpoint; under sbatch, the job script
requeues the job and it resumes. CI starts the cluster and sets JAXTRON_REQUIRE_SLURM=1, so there these tests
cannot be skipped.
"""

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import REPO
from helpers import metrics_lines
from test_multiprocess import TINY, _env, _losses

from jaxtron.parallel.launch import PEER_LOST_EXIT_CODE

REQUIRED = os.environ.get("JAXTRON_REQUIRE_SLURM") == "1"


def _slurm_up() -> bool:
    if not shutil.which("srun") or not shutil.which("sinfo"):
        return False
    out = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True, timeout=30, check=False)
    return out.returncode == 0 and any(s in ("idle", "mixed", "allocated") for s in out.stdout.split())


pytestmark = [pytest.mark.slow, pytest.mark.integration,
              pytest.mark.xdist_group("slurm"),  # one job at a time on the one-node cluster
              pytest.mark.skipif(not REQUIRED and not _slurm_up(),
                                 reason="no local Slurm cluster; start one with sudo scripts/slurm/local_cluster.sh")]

ARGS = [*TINY, "--config.train.steps=5", "--config.checkpoint.every=3"]
TWO_PROCESSES = ["--config.mesh.data=2", "--config.mesh.fsdp=4"]


def _srun(workdir, *extra, **popen):
    env = {k: v for k, v in _env(4).items() if not k.startswith("SLURM_")}
    # --kill-on-bad-exit=0: Slurm leaves the survivors of a dead task running, for jaxtron to end them
    command = ["srun", "-n", "2", "--overcommit", "--kill-on-bad-exit=0", "--time=10", sys.executable, "-u",
               "train.py", *ARGS, *TWO_PROCESSES, "--config.distributed.heartbeat_timeout_s=20", *extra,
               f"--workdir={workdir}"]
    return subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            **popen)


def _one_process(workdir, *extra):
    return subprocess.run([sys.executable, "train.py", *ARGS, "--config.mesh.fsdp=8", *extra, f"--workdir={workdir}"],
                          cwd=REPO, env=_env(8), capture_output=True, text=True, timeout=300, check=False)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("one")
    out = _one_process(workdir)
    assert out.returncode == 0, out.stderr[-3000:]
    return _losses(workdir)


def test_srun_trains_like_one_process_and_resumes_on_another_count(reference, tmp_path):
    proc = _srun(tmp_path)
    output = proc.communicate(timeout=400)[0]
    assert proc.returncode == 0, output[-4000:]
    assert "process 1 of 2 joined the run at" in output and "(slurm: Slurm job" in output
    np.testing.assert_allclose(_losses(tmp_path), reference, rtol=1e-5)
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["3", "5"]  # each written once, by both together
    shutil.rmtree(tmp_path / "checkpoints" / "5")  # as if the job had died after step 3
    again = _one_process(tmp_path)  # now one process with 8 devices
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resumed from the checkpoint of step 3" in again.stderr
    lines = metrics_lines(tmp_path)
    assert [line["step"] for line in lines] == [1, 2, 3, 4, 5]
    np.testing.assert_allclose([line["loss"] for line in lines], reference, rtol=1e-5)


def test_srun_pipeline_stages_one_per_process_train_like_one_process(tmp_path):
    """srun -n 2 with the pipeline axis across the two processes (stage 0 on one, stage 1 on the other)."""
    layers = "--config.model.num_layers=2"
    one = _one_process(tmp_path / "one", layers)
    assert one.returncode == 0, one.stderr[-3000:]
    proc = _srun(tmp_path / "two", layers, "--config.mesh.pipeline=2", "--config.mesh.data=1",
                 "--config.pipeline.microbatches=2")
    output = proc.communicate(timeout=400)[0]
    assert proc.returncode == 0, output[-4000:]
    assert "'pipeline': 2, 'data': 1, 'fsdp': 4" in output and "(slurm: Slurm job" in output
    np.testing.assert_allclose(_losses(tmp_path / "two"), _losses(tmp_path / "one"), rtol=1e-5)


def _recorded(workdir, step: int) -> bool:
    """Whether both processes recorded the checksums of their files of checkpoint ``step`` (they do so after the
    save is committed, in the background): a process killed before that leaves a checkpoint that counts as
    damaged, and a run whose only checkpoint it is cannot resume."""
    return all((workdir / "checkpoints" / str(step) / f"integrity.process_{i}.json").exists() for i in range(2))


def _task_pid(workdir, rank: int, timeout=60) -> int:
    deadline = time.time() + timeout
    while time.time() < deadline:
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
                environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            except OSError:
                continue
            if f"--workdir={workdir}".encode() in cmdline and any(a.endswith(b"train.py") for a in cmdline) and \
                    f"SLURM_PROCID={rank}".encode() in environ and cmdline[0] != b"srun":
                return int(pid)
        time.sleep(0.5)
    raise AssertionError(f"no task {rank} of the srun step found")


def test_a_killed_task_ends_the_step_and_a_new_srun_resumes(tmp_path):
    proc = _srun(tmp_path, "--config.train.steps=100000", "--config.checkpoint.every=4")
    deadline = time.time() + 300
    while not _recorded(tmp_path, 4):
        assert proc.poll() is None and time.time() < deadline, proc.communicate()[0][-4000:]
        time.sleep(0.2)
    time.sleep(3)
    os.kill(_task_pid(tmp_path, 1), signal.SIGKILL)
    killed = time.time()
    output = proc.communicate(timeout=180)[0]
    assert time.time() - killed < 120, "the surviving process did not stop within 2 minutes"
    if "gloo::EnforceNotMet" in output:
        # about one kill in seven lands while gloo (the CPU collectives; GPUs use NCCL) is mid-transfer with
        # the dead process, and gloo aborts the survivor on the spot, before anything else can notice
        assert "task 0: Aborted" in output, output[-4000:]
    else:
        # process 0's peer monitor: one sentence naming the dead process, and the exit code for "restart me"
        assert f"task 0: Exited with exit code {PEER_LOST_EXIT_CODE}" in output, output[-4000:]
        lines = [line for line in output.splitlines() if line.startswith("error:")]
        assert len(lines) == 1 and "error: process 1 of 2 stopped sending heartbeats" in lines[0], output[-4000:]
        assert "process 0 stops after step" in lines[0] and "Traceback" not in output and "Fatal" not in output
    saved = max(int(s) for s in os.listdir(tmp_path / "checkpoints") if s.isdigit())
    again = _srun(tmp_path)  # the requeued job: train.steps=5 from ARGS
    output = again.communicate(timeout=400)[0]
    if saved >= 5:
        assert again.returncode == 0 and "already reached train.steps" in output, output[-3000:]
    else:
        assert again.returncode == 0 and f"resumed from the checkpoint of step {saved}" in output, output[-3000:]


def _job_field(job: str, field: str) -> str:
    out = subprocess.run(["scontrol", "show", "job", job], capture_output=True, text=True, timeout=30,
                         check=False).stdout
    for token in out.split():
        if token.startswith(field + "="):
            return token.split("=", 1)[1]
    return ""


def test_sbatch_requeues_a_job_that_lost_a_process_and_it_resumes(tmp_path):
    """scripts/slurm/train.sbatch as users run it: a task dies, the job is requeued and resumes."""
    env = {k: v for k, v in _env(4).items() if not k.startswith("SLURM_")}
    env.update(JAXTRON_REPO=str(REPO), JAXTRON_MAX_RESTARTS="1")
    workdir = tmp_path / "run"
    submit = subprocess.run(
        ["sbatch", "--parsable", "--ntasks-per-node=2", "--gpus-per-node=0", "--overcommit", "--time=15",
         f"--chdir={tmp_path}", os.path.join(REPO, "scripts", "slurm", "train.sbatch"), *ARGS, *TWO_PROCESSES,
         "--config.train.steps=40", "--config.checkpoint.every=4", "--config.distributed.heartbeat_timeout_s=20",
         f"--workdir={workdir}"],
        env=env, capture_output=True, text=True, timeout=60, check=False)
    assert submit.returncode == 0, submit.stderr
    job = submit.stdout.strip().split(";")[0]
    try:
        deadline = time.time() + 300
        while not _recorded(workdir, 4):
            assert time.time() < deadline and _job_field(job, "JobState") in ("PENDING", "RUNNING"), \
                _job_field(job, "JobState")
            time.sleep(0.5)
        os.kill(_task_pid(workdir, 1), signal.SIGKILL)
        # the script requeues the job; Slurm starts it again once its credentials expired (cred_expire=20 on
        # the local cluster, 120 s by default)
        while _job_field(job, "JobState") not in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"):
            assert time.time() < deadline + 300, _job_field(job, "JobState")
            time.sleep(1)
    finally:
        subprocess.run(["scancel", job], timeout=30, check=False)
    log = (tmp_path / f"jaxtron-{job}.out").read_text()
    # on failure: every line but process 0's step lines, so that the other task's last words show
    events = "\n".join(line for line in log.splitlines() if " INFO step " not in line and "[Gloo]" not in line)
    assert _job_field(job, "JobState") == "COMPLETED", events[-6000:]
    assert "attempt 1," in log and f"requeueing job {job}" in log and "attempt 2," in log, log[-4000:]
    resumed = [int(line.rsplit("resumed from the checkpoint of step ", 1)[1].split()[0])
               for line in log.splitlines() if "resumed from the checkpoint of step" in line]
    assert resumed and resumed[0] >= 4, log[-4000:]
    assert log.rstrip().splitlines()[-1].startswith("jaxtron: train.py exited with 0"), log[-4000:]
    steps = [line["step"] for line in metrics_lines(workdir)]
    assert steps == list(range(1, 41))  # the lines after the checkpoint were dropped and written again
