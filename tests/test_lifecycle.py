"""A run's lifecycle as a user at a terminal meets it: the Python API (``jaxtron.train`` with a ``Hook``), Ctrl-C,
one run per workdir, and the small refusals and texts of the other commands."""

import hashlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import jax
import pytest
from conftest import REPO
from helpers import metrics_lines, tiny_config
from test_checkpoint import _final_state, _train, _wait_for_step, uninterrupted  # noqa: F401 - a fixture
from test_multiprocess import TINY, _env

from jaxtron import cli
from jaxtron.checkpoint.train_state import CHECKPOINT_DIR
from jaxtron.common.files import write_json
from jaxtron.training.loop import run
from jaxtron.training.preemption import PREEMPTED_EXIT_CODE, PreemptionWatcher
from jaxtron.training.workdir_lock import LOCK_FILE

STEPS4 = ["--config.train.steps=4", "--config.train.log_every=1"]


@pytest.mark.slow
@pytest.mark.integration
def test_a_script_outside_the_package_trains_with_a_hook_as_train_py_does(tmp_path):
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(f"""
        import json, sys
        import jaxtron

        seen = []
        metrics = jaxtron.train("default", workdir=sys.argv[1], overrides={STEPS4!r},
                                hooks=[jaxtron.Hook(every=2, run=lambda step, m: seen.append([step, m["loss"]]))])
        print(json.dumps({{"seen": seen, "loss": metrics["loss"], "preempted": metrics["preempted"]}}))
    """))
    env = _env(1)
    api = subprocess.run([sys.executable, str(script), str(tmp_path / "api")], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=600, check=False)
    assert api.returncode == 0, api.stderr[-3000:]
    cmd = subprocess.run([sys.executable, "train.py", *STEPS4, f"--workdir={tmp_path / 'cmd'}"], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=600, check=False)
    assert cmd.returncode == 0, cmd.stderr[-3000:]
    out = json.loads(api.stdout.strip().splitlines()[-1])
    losses = {line["step"]: line["loss"] for line in metrics_lines(tmp_path / "cmd") if "loss" in line}
    assert [step for step, _ in out["seen"]] == [2, 4]
    assert {step: loss for step, loss in out["seen"]} == {2: losses[2], 4: losses[4]}  # bit-identical
    api_losses = {line["step"]: line["loss"] for line in metrics_lines(tmp_path / "api") if "loss" in line}
    assert api_losses == losses and out["loss"] == losses[4] and out["preempted"] is None


@pytest.mark.integration
@pytest.mark.slow
def test_ctrl_c_checkpoints_exits_as_sigterm_does_and_resumes_bit_exactly(uninterrupted, tmp_path):  # noqa: F811
    whole = uninterrupted
    proc = _train(tmp_path / "cut", "--config.checkpoint.every=0")
    _wait_for_step(tmp_path / "cut", 4, proc)
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=120) == PREEMPTED_EXIT_CODE
    assert "Traceback" not in proc.stderr.read()
    saved = [int(s) for s in os.listdir(tmp_path / "cut" / CHECKPOINT_DIR) if s.isdigit()]
    assert len(saved) == 1 and saved[0] >= 4
    assert _train(tmp_path / "cut").wait(timeout=300) == 0
    for a, b in zip(_final_state(tmp_path / "cut"), _final_state(whole), strict=True):
        assert (a == b).all()
    losses = lambda w: {line["step"]: line["loss"] for line in metrics_lines(w) if "loss" in line}
    assert losses(tmp_path / "cut") == losses(whole)


@pytest.mark.first_tier  # signals itself, starts no process
def test_a_second_ctrl_c_is_the_systems_and_ends_the_process_at_once():
    previous = signal.getsignal(signal.SIGINT)
    watcher = PreemptionWatcher()
    try:
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.1)
        assert watcher.requested == "SIGINT"
        assert signal.getsignal(signal.SIGINT) is signal.SIG_DFL
    finally:
        watcher.close()
    assert signal.getsignal(signal.SIGINT) is previous


def _snapshot(workdir) -> dict[str, tuple[int, str]]:
    """Every file under ``workdir``: its modification time and content digest."""
    out = {}
    for folder, _, files in os.walk(workdir):
        for name in files:
            path = os.path.join(folder, name)
            with open(path, "rb") as f:
                out[os.path.relpath(path, workdir)] = (os.stat(path).st_mtime_ns, hashlib.sha256(f.read()).hexdigest())
    return out


def _holder(workdir) -> subprocess.Popen:
    """A process that takes the workdir's lock and keeps it until it is killed."""
    code = ("import sys, time; from jaxtron.training.workdir_lock import WorkdirLock; "
            "WorkdirLock(sys.argv[1]).acquire(); print('held', flush=True); time.sleep(600)")
    proc = subprocess.Popen([sys.executable, "-c", code, str(workdir)], env=_env(1), stdout=subprocess.PIPE,
                            text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


@pytest.mark.slow
@pytest.mark.integration
def test_a_second_run_on_a_held_workdir_is_refused_naming_the_holder_and_changes_nothing(tmp_path, capsys):
    workdir = tmp_path / "run"
    run(tiny_config(train=dict(steps=2)), str(workdir), use_tqdm=False, devices=jax.devices()[:1])
    holder = _holder(workdir)
    before = _snapshot(workdir)  # the holder's lock file included
    try:
        code = cli.run("train", [*TINY, "--config.train.steps=4", f"--workdir={workdir}"])
        err = capsys.readouterr().err
        assert code == 2 and "Traceback" not in err
        assert f"workdir '{workdir}' is in use by another run (process {holder.pid} on " in err
        assert _snapshot(workdir) == before
    finally:
        holder.kill()
        holder.wait()


@pytest.mark.slow
@pytest.mark.integration
def test_a_lock_left_by_a_killed_holder_is_taken_over(tmp_path, caplog):
    workdir = tmp_path / "run"
    holder = _holder(workdir)
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    assert os.path.getsize(workdir / LOCK_FILE) > 0  # it says who held it, but nobody holds it now
    with caplog.at_level("INFO", logger="jaxtron.training.workdir_lock"):
        summary = run(tiny_config(train=dict(steps=2)), str(workdir), use_tqdm=False, devices=jax.devices()[:1])
    assert summary.history[-1]["step"] == 2
    assert f"took over the lock of workdir {workdir} from process {holder.pid} on" in caplog.text
    assert os.path.getsize(workdir / LOCK_FILE) == 0  # given back at the end


@pytest.mark.parametrize("limit", ["0", "-1", "x"])
def test_lm_eval_refuses_a_limit_that_is_no_positive_number_before_loading(limit, capsys, monkeypatch):
    from jaxtron.inference import harness

    monkeypatch.setattr(harness, "register", lambda: pytest.fail("lm-eval was loaded"))
    assert cli.run("lm-eval", ["--model", "jaxtron", "--tasks", "x", "--limit", limit]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"error: option '--limit' is {limit!r}; pass a count of documents per task (1 or more) or a "
                   "fraction of them between 0 and 1.")
    assert cli.run("lm-eval", ["--model", "jaxtron", f"--limit={limit}"]) == 2


def test_generate_explains_its_sampling_options_and_refuses_an_empty_prompt_before_loading(capsys, monkeypatch,
                                                                                          tmp_path):
    from jaxtron.inference import generate

    assert cli.run("generate", ["--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    for words in ("--top-k", "0, all tokens", "--top-p", "sum to P", "--seed", "same seed gives the same text",
                  "--max-new-tokens", "tokens to add to each prompt"):
        assert words in text, words
    monkeypatch.setattr(generate, "load_model", lambda *a: pytest.fail("the model was loaded"))
    monkeypatch.setattr(generate, "_check_directory", lambda path: None)
    assert cli.run("generate", ["--run", str(tmp_path), "--prompt", "", "--tokenizer", "byte"]) == 2
    assert "an empty prompt has nothing to continue" in capsys.readouterr().err


def test_files_written_aside_get_the_mode_of_the_umask(tmp_path):
    old = os.umask(0o022)
    try:
        write_json(str(tmp_path / "config.json"), {"a": 1})
    finally:
        os.umask(old)
    assert os.stat(tmp_path / "config.json").st_mode & 0o777 == 0o644


def test_the_last_line_says_what_its_loss_is_a_mean_of(tmp_path, caplog):
    cfg = tiny_config(train=dict(steps=6, log_every=4))
    with caplog.at_level("INFO"):
        run(cfg, str(tmp_path / "run"), use_tqdm=False, devices=jax.devices()[:1])
    done = [r.getMessage() for r in caplog.records if r.getMessage().startswith("done: ")]
    assert len(done) == 1 and "nats/token (mean of the last 2 steps)" in done[0], done


def test_the_plan_explains_the_words_of_its_mesh_column(capsys):
    assert cli.run("plan", [f"--config={REPO}/configs/llama3_8b.py", "--gpus=8", "--top=3"]) == 0
    out = capsys.readouterr().out
    assert " dopt" in out and "  dopt: the distributed optimizer (its state split over the data axes)" in out
    assert "save_dots_attention" in out and "the rematerialisation policy (execution.remat) the row assumes" in out
