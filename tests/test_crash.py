"""Crash consistency: a kill at any moment leaves files that are complete or recognisably incomplete, every reader
copes, a resumed run ends bit for bit where a run never killed ends, and a refused command changes nothing."""

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import REPO
from fault_injection import inject
from helpers import metrics_lines

from jaxtron import cli
from jaxtron.common import files

TINY = ["--config.data.source=synthetic", "--config.model.num_layers=1", "--config.model.embed_dim=64",
        "--config.model.attention.num_heads=4", "--config.model.attention.num_kv_heads=4",
        "--config.model.mlp_dim=128", "--config.data.seq_len=32", "--config.train.global_batch_size=8",
        "--config.train.log_every=1", "--config.train.eval_batches=0", "--config.checkpoint.every=2"]


def _tree(path) -> dict[str, str]:
    """Every file and directory under ``path`` with its content's digest: a byte-for-byte picture."""
    out = {}
    for root, dirs, names in os.walk(path):
        for d in dirs:
            out[os.path.relpath(os.path.join(root, d), path) + "/"] = ""
        for n in names:
            out[os.path.relpath(os.path.join(root, n), path)] = hashlib.sha256(Path(root, n).read_bytes()).hexdigest()
    return out


def test_whole_files_appear_complete_or_not_at_all(tmp_path):
    target = tmp_path / "config.json"
    files.write_json(str(target), {"a": 1})
    with pytest.raises(RuntimeError), files.atomic_path(str(target)) as aside:
        Path(aside).write_text('{"a": ')  # a writer that fails midway
        raise RuntimeError
    assert json.loads(target.read_text()) == {"a": 1} and os.listdir(tmp_path) == ["config.json"]
    out = tmp_path / "model"
    with pytest.raises(RuntimeError), files.staged_directory(str(out)) as staging:
        Path(staging, "part").write_text("x")
        raise RuntimeError
    assert os.listdir(tmp_path) == ["config.json"]
    with files.staged_directory(str(out)) as staging:
        Path(staging, "whole").write_text("x")
    assert os.listdir(out) == ["whole"] and sorted(os.listdir(tmp_path)) == ["config.json", "model"]


def test_a_cut_last_line_of_a_log_is_dropped_and_nothing_else(tmp_path, caplog):
    log = tmp_path / "metrics.jsonl"
    log.write_text('{"step": 1}\n{"step": 2}\n{"step": 3, "lo')
    assert files.jsonl_lines(str(log)) == ['{"step": 1}', '{"step": 2}'] and "is cut" in caplog.text
    log.write_text('{"step": 1}\n{"step": 2}')  # whole but for its newline: kept
    assert files.jsonl_lines(str(log)) == ['{"step": 1}', '{"step": 2}']
    log.write_text('{"step": 1}\n{"step": 2}\n{"st')
    assert files.drop_cut_tail(str(log)) == '{"st' and log.read_text() == '{"step": 1}\n{"step": 2}\n'
    assert files.drop_cut_tail(str(log)) == ""


@pytest.mark.integration
@pytest.mark.slow
def test_report_and_resume_cope_with_a_cut_metrics_line_and_a_restart_logs_no_step_twice(tmp_path, capsys):
    workdir = str(tmp_path / "run")
    assert cli.main(["train", *TINY, "--config.train.steps=3", f"--workdir={workdir}"]) == 0
    path = os.path.join(workdir, "metrics.jsonl")
    with open(path, "a") as f:
        f.write('{"step": 4, "grad_norm": 0.7, "lo')  # as a kill while writing step 4's line leaves it
    capsys.readouterr()
    assert cli.main(["report", "--no_plots", workdir]) == 0
    assert "3 of 3 steps" in capsys.readouterr().out
    assert cli.main(["train", *TINY, "--config.train.steps=5", f"--workdir={workdir}"]) == 0
    assert [line["step"] for line in metrics_lines(workdir)] == [1, 2, 3, 4, 5]
    # killed before its first save: a restart begins at step 0 again and logs steps 1.. once
    files.write_atomic(path, Path(path).read_text() + '{"step": 6, "loss": 1.0}\n')
    for name in os.listdir(os.path.join(workdir, "checkpoints")):
        os.rename(os.path.join(workdir, "checkpoints", name), os.path.join(workdir, f"aside{name}"))
    assert cli.main(["train", *TINY, "--config.train.steps=2", f"--workdir={workdir}"]) == 0
    assert [line["step"] for line in metrics_lines(workdir)] == [1, 2]


@pytest.mark.integration
@pytest.mark.slow
def test_a_refused_run_changes_nothing_in_its_workdir(tmp_path, capsys):
    workdir = tmp_path / "run"
    assert cli.main(["train", *TINY, "--config.train.steps=2", f"--workdir={workdir}"]) == 0
    before = _tree(workdir)
    for refused, why in ((["--config.model.num_layers=2"], "another model architecture"),
                         (["--config.data.seq_len=16"], "another data setup"),
                         (["--config.train.seed=3"], "another data setup"),
                         (["--config.lora.rank=0", "--config.lora.targets=q"], "lora.targets"),
                         (["--config.optimizer.learning_rate=-1"], "learning_rate")):
        capsys.readouterr()
        assert cli.main(["train", *TINY, "--config.train.steps=4", *refused, f"--workdir={workdir}"]) == 2, refused
        err = capsys.readouterr().err
        assert why in err and "Traceback" not in err, err
        assert _tree(workdir) == before, refused
    # a new workdir of a refused fine-tuning run is not left behind
    new = tmp_path / "sft"
    assert cli.main(["train", *TINY, f"--config.train.init_from={tmp_path / 'missing'}", f"--workdir={new}"]) == 2
    assert not new.exists()
    empty = tmp_path / "empty"
    empty.mkdir()
    assert cli.main(["train", *TINY, f"--config.train.init_from={tmp_path / 'missing'}", f"--workdir={empty}"]) == 2
    assert os.listdir(empty) == []


@pytest.mark.first_tier
@pytest.mark.slow
def test_sigkill_at_random_moments_then_resume_ends_bit_exact(tmp_path):
    """The quick version of tests/fault_injection.py, in the README's tier (.ci/run runs the longer one, with the
    readers run as commands; here they run in this process)."""
    figures = inject(kills=3, seed=1, root=str(tmp_path), steps=24, log=lambda *_: None, in_process=True)
    # (a run may reach its last step before its kill, when its start-up was quicker than the reference's)
    assert figures["kills"] >= 2 and figures["resumes"] == figures["kills"]
    assert figures["problems"] == []
    assert figures["losses_identical"] and figures["parameters_identical"]


def _env():
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_")}
    return {**env, "JAX_PLATFORMS": "cpu"}


def _killed_then_retried(command: list[str], cwd, seconds: float, output) -> subprocess.CompletedProcess | None:
    """``command`` killed after ``seconds``, then run again unless its ``output`` is there (None: it is, and the
    caller checks it is whole; a retry would rightly refuse to write over it)."""
    proc = subprocess.Popen(command, cwd=cwd, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(seconds)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
    if os.path.exists(output):
        return None
    return subprocess.run(command, cwd=cwd, env=_env(), capture_output=True, text=True, timeout=300, check=False)


def _timed(command: list[str], cwd) -> float:
    started = time.perf_counter()
    done = subprocess.run(command, cwd=cwd, env=_env(), capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    return time.perf_counter() - started


@pytest.mark.integration
@pytest.mark.slow
def test_convert_and_prepare_take_any_path_form_and_a_retry_after_a_kill_succeeds(tmp_path):
    run = tmp_path / "run"
    assert cli.main(["train", *TINY, "--config.train.steps=2", f"--workdir={run}"]) == 0
    jaxtron = [sys.executable, "-m", "jaxtron"]
    # relative paths with a trailing slash, from the run's parent directory
    whole = _timed([*jaxtron, "convert", "to-hf", "run/", "hf/"], tmp_path)
    assert sorted(os.listdir(tmp_path / "hf")) == ["config.json", "model.safetensors"]
    for share in (0.2, 0.6, 0.9):  # start-up, loading, writing
        out = tmp_path / f"hf{share}"
        done = _killed_then_retried([*jaxtron, "convert", "to-hf", "run/", f"{out.name}/"], tmp_path, share * whole,
                                    out)
        assert done is None or done.returncode == 0, done.stderr
        assert sorted(os.listdir(out)) == ["config.json", "model.safetensors"]
        assert not [n for n in os.listdir(tmp_path) if files.ASIDE in n]
    home = tmp_path / "home"
    (home / "hf").mkdir(parents=True)  # empty: taken
    done = subprocess.run([*jaxtron, "convert", "to-hf", str(run), "~/hf"], env={**_env(), "HOME": str(home)},
                          cwd=REPO, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0 and os.listdir(home / "hf"), done.stderr
    (tmp_path / "text.txt").write_text("def f(x):\n    return x\n" * 20000)
    prepare = [*jaxtron, "prepare", "--input", "text.txt", "--tokenizer", "byte", "--output"]
    whole = _timed([*prepare, "store/"], tmp_path)
    for share in (0.3, 0.8):
        done = _killed_then_retried([*prepare, f"store{share}/"], tmp_path, share * whole, tmp_path / f"store{share}")
        assert done is None or done.returncode == 0, done.stderr
        assert subprocess.run([*jaxtron, "verify-data", f"store{share}"], cwd=tmp_path, env=_env(),
                              capture_output=True, timeout=120, check=False).returncode == 0


@pytest.mark.slow
def test_a_byte_level_run_exports_a_tokenizer_hf_loads_that_gives_the_runs_ids(tmp_path):
    transformers = pytest.importorskip("transformers")
    from jaxtron.data.tokenizers import ByteTokenizer

    text = tmp_path / "text.txt"
    text.write_text("for i in range(3):\n    print(i)\n" * 200)
    assert cli.main(["prepare", "--input", str(text), "--tokenizer", "byte", "--output", str(tmp_path / "store")]) == 0
    run = tmp_path / "run"
    assert cli.main(["train", *TINY[1:], "--config.data.source=store", f"--config.data.path={tmp_path / 'store'}",
                     "--config.model.vocab_size=256", "--config.data.validation_fraction=0", "--config.train.steps=1",
                     f"--workdir={run}"]) == 0
    assert cli.main(["convert", "to-hf", str(run), str(tmp_path / "hf")]) == 0
    hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    for sample in ("def f(x):\n    return x  # héllo ✓ 😀\t", "", "\x00\x7f", "a" * 300):
        ids = ByteTokenizer().encode(sample).tolist()
        assert hf(sample, add_special_tokens=False)["input_ids"] == ids
        assert hf.decode(ids) == sample


_KILLED_WHILE_DROPPING = """
import os, sys
import jax.numpy as jnp
from jaxtron.checkpoint.train_state import Checkpointer

ckpt = Checkpointer(sys.argv[1], keep=1, async_save=False)
state = {"w": jnp.arange(4096.0), "b": jnp.ones(7)}
ckpt.save(1, state, {"position": 1}, {"model": {}})
unlink = os.unlink
def killed(*args, **kwargs):  # the first file deleted after step 2's save began is the last thing this process does
    unlink(*args, **kwargs)
    os._exit(9)
os.unlink = killed
ckpt.save(2, state, {"position": 2}, {"model": {}})
"""


@pytest.mark.integration
def test_a_kill_while_an_old_checkpoint_is_dropped_leaves_no_damaged_checkpoint(tmp_path):
    """Checkpoints past `keep` are renamed aside whole before their files are deleted: deleted in place, a kill
    midway left a step directory with some files gone, which `verify` and a resumed run call damaged."""
    workdir = str(tmp_path / "run")
    done = subprocess.run([sys.executable, "-c", _KILLED_WHILE_DROPPING, workdir], cwd=REPO, capture_output=True,
                          text=True, timeout=300, env={**os.environ, "JAX_PLATFORMS": "cpu"}, check=False)
    assert done.returncode == 9, done.stderr[-2000:]  # killed while deleting, as arranged
    verify = subprocess.run([sys.executable, "-m", "jaxtron", "verify", workdir], cwd=REPO, capture_output=True,
                            text=True, timeout=120, check=False)
    assert verify.returncode == 0 and "damaged" not in verify.stdout, verify.stdout + verify.stderr
    assert verify.stdout.splitlines()[-1].startswith("1 of 1 checkpoints intact"), verify.stdout
    from jaxtron.checkpoint.train_state import DROPPED_DIR, Checkpointer
    checkpoints = os.path.join(workdir, "checkpoints")
    assert os.listdir(os.path.join(checkpoints, DROPPED_DIR)) == ["1"]  # the rest of step 1, aside
    Checkpointer(workdir, keep=1).remove_incomplete()  # what a resumed run does first
    assert sorted(os.listdir(checkpoints)) == ["2"]
