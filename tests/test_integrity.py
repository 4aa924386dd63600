"""Checkpoint integrity: checksums at save, verification and fallback at restore, the verify CLI."""

import functools
import json
import operator
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from conftest import REPO
from flax import nnx
from helpers import metrics_lines, tiny_config

from jaxtron import cli
from jaxtron.checkpoint import integrity
from jaxtron.checkpoint.params import restore_params
from jaxtron.checkpoint.train_state import CHECKPOINT_DIR, Checkpointer, CheckpointError
from jaxtron.parallel.checks import check_devices
from jaxtron.parallel.mesh import make_mesh
from jaxtron.training import state as state_lib
from jaxtron.training.loop import run

CFG = tiny_config(train=dict(steps=3), checkpoint=dict(every=1, keep=5))


def _saved_leaves(workdir, step):
    tree = ocp.PyTreeCheckpointer().restore(os.path.join(workdir, CHECKPOINT_DIR, str(step), "state"))
    return [np.asarray(x) for x in jax.tree.leaves(tree)]


def _leaves(state):
    return [np.asarray(x) for x in jax.tree.leaves(nnx.to_pure_dict(state.params))] + \
        [np.asarray(x) for x in jax.tree.leaves(state.opt_state)]


def _abstract():
    mesh = make_mesh(check_devices(CFG, 1), jax.devices()[:1])
    setup = state_lib.setup(CFG, "xla")
    shardings = state_lib.state_shardings(mesh, setup.abstract_state)
    # what a checkpoint holds: the state without its reference model
    return state_lib.saved_part(setup.abstract_state), state_lib.saved_part(shardings, setup.abstract_state)


@pytest.fixture(scope="session")  # once per test process (tests/conftest.py)
def trained(tmp_path_factory):
    """A run of 3 steps with a checkpoint after each: its workdir, each step's restored state, the losses."""
    workdir = str(tmp_path_factory.mktemp("trained"))
    summary = run(CFG, workdir, use_tqdm=False, devices=jax.devices()[:1])
    ckpt = Checkpointer(workdir, keep=5)
    states = {s: ckpt.restore(s, *_abstract(), CFG)[0] for s in (1, 2, 3)}
    ckpt.close()
    return workdir, states, summary.history


@pytest.fixture
def workdir(trained, tmp_path):
    shutil.copytree(trained[0], tmp_path / "run")
    return str(tmp_path / "run")


def _largest(step_dir):
    files = [os.path.join(d, f) for d, _, fs in os.walk(step_dir) for f in fs if not f.startswith("integrity.")]
    return max(files, key=os.path.getsize)


def damage(workdir, step, kind) -> str:
    """Damages a checkpoint the way disks and killed jobs do; returns the reason verification must give."""
    step_dir = os.path.join(workdir, CHECKPOINT_DIR, str(step))
    path = _largest(step_dir)
    rel, size = os.path.relpath(path, step_dir), os.path.getsize(path)
    if kind == "truncated":
        os.truncate(path, size // 2)
        return f"{rel} truncated ({size // 2} of {size} bytes)"
    if kind == "bit_flip":  # a few bytes of the array data: orbax would load them without complaint
        with open(path, "r+b") as f:
            f.seek(size // 2)
            flipped = bytes(b ^ 0x10 for b in f.read(4))
            f.seek(size // 2)
            f.write(flipped)
        return f"{rel} checksum mismatch"
    if kind == "deleted":
        os.remove(path)
        return f"{rel} missing"
    os.remove(os.path.join(step_dir, "integrity.process_0.json"))
    return integrity.NO_MANIFEST


KINDS = ["truncated", "bit_flip", "deleted", "no_manifest"]


def _restore_latest(workdir):
    ckpt = Checkpointer(workdir, keep=5)
    try:
        restored = ckpt.restore_latest(*_abstract(), CFG)
        return restored, ckpt.latest_step()
    finally:
        ckpt.close()


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_damage_in_the_latest_checkpoint_falls_back_to_the_previous_one(kind, trained, workdir, caplog, capsys):
    reason = damage(workdir, 3, kind)
    if kind == "no_manifest":  # the newest without checksums: a run killed between its save and them
        assert cli.main(["verify", workdir]) == 0
        assert capsys.readouterr().out.splitlines()[2:] == [
            ("step 3: unfinished: the run stopped before its checksums were recorded; never loaded (a resumed run "
             "starts from the step before)"), f"2 of 2 checkpoints intact in {os.path.join(workdir, CHECKPOINT_DIR)}"]
    with caplog.at_level("WARNING"):
        (state, data), latest = _restore_latest(workdir)
    assert data["step"] == 2 and latest == 2  # the rest of the data state is not ours
    for a, b in zip(_leaves(state), _leaves(trained[1][2]), strict=True):
        np.testing.assert_array_equal(a, b)
    ckpts = os.path.join(workdir, CHECKPOINT_DIR)
    said = ("is unfinished: the run stopped before its checksums were recorded" if kind == "no_manifest" else
            f"is damaged: {reason}")
    assert f"checkpoint 3 in {ckpts} {said}; falling back to an earlier one" in caplog.text
    moved = os.path.join(workdir, integrity.DAMAGED_DIR, "3")
    assert f"moved damaged checkpoint 3 to {moved}" in caplog.text
    assert integrity.steps_in(ckpts) == [1, 2] and os.path.isdir(moved)  # kept, out of the way of a new step 3


def test_a_lone_checkpoint_cut_before_its_checksums_is_a_save_never_made(workdir, caplog, capsys):
    """A run killed between its first save and that save's checksums starts again from step 0 (the cut save kept
    aside); any other lone damage is refused."""
    ckpts = os.path.join(workdir, CHECKPOINT_DIR)
    for step in (1, 2):
        shutil.rmtree(os.path.join(ckpts, str(step)))
    damage(workdir, 3, "no_manifest")
    assert cli.main(["verify", workdir]) == 0
    assert "step 3: unfinished: the run stopped before its checksums were recorded; never loaded (a resumed run " \
        "starts from step 0)" in capsys.readouterr().out
    with caplog.at_level("WARNING"):
        restored, latest = _restore_latest(workdir)
    assert restored is None and latest is None
    assert f"checkpoint 3 in {ckpts} is unfinished: the run stopped before its checksums were recorded; the run " \
        "starts from step 0" in caplog.text
    assert integrity.steps_in(ckpts) == [] and os.path.isdir(os.path.join(workdir, integrity.DAMAGED_DIR, "3"))


def test_a_lone_damaged_checkpoint_is_refused(workdir):
    ckpts = os.path.join(workdir, CHECKPOINT_DIR)
    for step in (1, 2):
        shutil.rmtree(os.path.join(ckpts, str(step)))
    reason = damage(workdir, 3, "truncated")
    with pytest.raises(CheckpointError, match=re.escape(f"step 3: {reason}")):
        _restore_latest(workdir)
    assert integrity.steps_in(ckpts) == [3]


@pytest.mark.parametrize("kind", KINDS)
def test_damage_in_an_older_checkpoint_is_reported_and_the_latest_restored(kind, trained, workdir, capsys):
    reason = damage(workdir, 1, kind)
    assert cli.main(["verify", workdir]) == 2
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"step 1: damaged: {reason}"
    assert [re.fullmatch(r"step (\d): intact \(\d+ files, 1\.\d MB\)", l)[1] for l in lines[1:3]] == ["2", "3"]
    assert lines[3] == f"2 of 3 checkpoints intact in {os.path.join(workdir, CHECKPOINT_DIR)}"
    (state, data), latest = _restore_latest(workdir)
    assert data["step"] == 3 and latest == 3
    for a, b in zip(_leaves(state), _leaves(trained[1][3]), strict=True):
        np.testing.assert_array_equal(a, b)
    assert not os.path.exists(os.path.join(workdir, integrity.DAMAGED_DIR))  # nothing newer was damaged


def test_a_run_resumes_bit_exactly_from_the_newest_intact_checkpoint(trained, workdir):
    damage(workdir, 3, "bit_flip")
    summary = run(CFG, workdir, use_tqdm=False, devices=jax.devices()[:1])
    assert [h["step"] for h in summary.history] == [3]
    assert summary.history[0]["loss"] == trained[2][2]["loss"]
    for a, b in zip(_saved_leaves(workdir, 3), _saved_leaves(trained[0], 3), strict=True):
        np.testing.assert_array_equal(a, b)
    assert cli.main(["verify", workdir]) == 0  # the new step 3 has its checksums
    assert [line["step"] for line in metrics_lines(workdir)] == [1, 2, 3]


def test_no_intact_checkpoint_is_an_error_and_nothing_is_moved(workdir):
    for step, kind in ((1, "truncated"), (2, "deleted"), (3, "no_manifest")):
        damage(workdir, step, kind)
    with pytest.raises(CheckpointError, match=r"^none of the 3 checkpoint\(s\) in '.*' is intact \(the newest, step "
                                              r"3: no integrity manifest \(cut off .*\); list them with `"
                                              r"jaxtron verify .*` and start again in a new --workdir.$"):
        run(CFG, workdir, use_tqdm=False, devices=jax.devices()[:1])
    assert integrity.steps_in(os.path.join(workdir, CHECKPOINT_DIR)) == [1, 2, 3]


def test_a_verified_checkpoint_that_orbax_cannot_read_is_damage_too(trained, workdir, caplog):
    step_dir = os.path.join(workdir, CHECKPOINT_DIR, "3")
    path = _largest(step_dir)
    blob = bytearray(Path(path).read_bytes())
    blob[len(blob) // 2:] = bytes(b ^ 0xFF for b in blob[len(blob) // 2:])
    Path(path).write_bytes(blob)
    integrity.record(step_dir)  # checksums of already damaged files: verification passes
    assert integrity.check(step_dir) is None
    with caplog.at_level("WARNING"):
        (_, data), _ = _restore_latest(workdir)
    assert data["step"] == 2
    assert "checkpoint 3 in" in caplog.text and "is damaged: verified but cannot be restored (" in caplog.text


def test_init_from_reads_the_newest_intact_checkpoint_of_a_run(trained, workdir, caplog):
    damage(workdir, 3, "truncated")
    abstract, shardings = _abstract()
    with caplog.at_level("WARNING"):
        params = restore_params(workdir, abstract.params, shardings.params)
    assert "checkpoint 3 in" in caplog.text and "falling back to an earlier one" in caplog.text
    for a, b in zip(jax.tree.leaves(nnx.to_pure_dict(params)), jax.tree.leaves(nnx.to_pure_dict(trained[1][2].params)),
                    strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert integrity.steps_in(os.path.join(workdir, CHECKPOINT_DIR)) == [1, 2, 3]  # another run's: untouched
    for step in (1, 2):
        damage(workdir, step, "bit_flip")
    with pytest.raises(CheckpointError, match=r"none of the 3 checkpoint\(s\) in .* step 3: .* truncated"):
        restore_params(workdir, abstract.params, shardings.params)


@pytest.mark.slow
def test_checksums_of_an_asynchronous_save_are_recorded_off_the_loop(tmp_path, monkeypatch):
    mesh = make_mesh(check_devices(CFG, 1), jax.devices()[:1])
    setup = state_lib.setup(CFG, "xla")
    with jax.set_mesh(mesh):
        state = state_lib.init_state(CFG, "xla", state_lib.state_shardings(mesh, setup.abstract_state))
    record = integrity.record
    slow = 2.5  # seconds a checksum record takes on this slow disk
    monkeypatch.setattr(integrity, "record", lambda *a, **k: (time.sleep(slow), record(*a, **k)))
    ckpt = Checkpointer(str(tmp_path), keep=1)
    start = time.perf_counter()
    ckpt.save(1, state, {"step": 1}, CFG.to_dict())
    returned = time.perf_counter() - start
    manifest = os.path.join(tmp_path, CHECKPOINT_DIR, "1", "integrity.process_0.json")
    # the save came back before its checksums were recorded (a save that waited would take the disk's time)
    assert returned < slow and not os.path.exists(manifest)
    ckpt.save(2, state, {"step": 2}, CFG.to_dict())  # waits for step 1's checksums, before orbax removes step 1
    ckpt.close()  # waits for step 2's
    assert time.perf_counter() - start >= 2 * slow
    assert integrity.steps_in(os.path.join(tmp_path, CHECKPOINT_DIR)) == [2]
    assert integrity.check(os.path.join(tmp_path, CHECKPOINT_DIR, "2")) is None


def test_files_are_attributed_to_their_writer_and_verified_once_by_several_processes(tmp_path):
    files = {"state/_METADATA": 300, "state/d/root": 50, "state/ocdbt.process_0/d/a": 1000,
             "state/ocdbt.process_1/d/b": 900, "state/ocdbt.process_1/manifest.ocdbt": 20,
             "state/array_metadatas/process_1": 30, "commit_success.txt": 10}
    for rel, size in files.items():
        os.makedirs(os.path.dirname(tmp_path / rel) or tmp_path, exist_ok=True)
        (tmp_path / rel).write_bytes(os.urandom(size))
    assert [integrity.writer_of(p) for p in files] == [0, 0, 0, 1, 1, 1, 0]
    assert integrity.check(str(tmp_path)) == integrity.NO_MANIFEST
    integrity.record(str(tmp_path), 0, 2)
    assert integrity.check(str(tmp_path)) == "no integrity manifest of process 1 (integrity.process_1.json)"
    integrity.record(str(tmp_path), 1, 2)
    recorded = [json.loads(Path(tmp_path / f"integrity.process_{i}.json").read_text())["files"] for i in (0, 1)]
    assert sorted([*recorded[0], *recorded[1]]) == sorted(files)  # each file once
    manifest = integrity.read_manifests(str(tmp_path))
    for n in (1, 2, 3):  # restoring with another number of processes: shares are disjoint and cover all
        shares = [integrity.share(manifest, i, n) for i in range(n)]
        assert sorted(functools.reduce(operator.iadd, shares, [])) == sorted(files)
    assert [sum(files[p] for p in s) for s in (integrity.share(manifest, i, 2) for i in (0, 1))] == [1110, 1200]
    with open(tmp_path / "state/ocdbt.process_1/d/b", "r+b") as f:
        f.write(b"\0\0")
    verdicts = [integrity.check(str(tmp_path), i, 2) for i in (0, 1)]
    assert verdicts == [None, "state/ocdbt.process_1/d/b checksum mismatch"]  # b is in process 1's share
    assert integrity.first_reason(verdicts) == "state/ocdbt.process_1/d/b checksum mismatch"  # all agree
    assert integrity.first_reason([None, None]) is None and integrity.agree(None) is None


@pytest.mark.integration
@pytest.mark.slow
def test_the_verify_command_exit_codes(trained, tmp_path):
    verify = [sys.executable, "-m", "jaxtron", "verify"]
    ok = subprocess.run([*verify, trained[0]], cwd=REPO, capture_output=True, text=True, timeout=120, check=False)
    assert ok.returncode == 0 and ok.stdout.splitlines()[-1].startswith("3 of 3 checkpoints intact")
    none = subprocess.run([*verify, str(tmp_path)], cwd=REPO, capture_output=True, text=True, timeout=120, check=False)
    assert none.returncode == 2 and none.stderr == (f"error: '{tmp_path}/checkpoints' holds no checkpoint; point "
                                                    "verify at the --workdir of a run that saved one.\n")
    for path, what in ((tmp_path / "missing", "does not exist"), (Path(trained[0], "metrics.jsonl"), "is a file")):
        bad = subprocess.run([*verify, str(path)], cwd=REPO, capture_output=True, text=True, timeout=120, check=False)
        assert bad.returncode == 2 and bad.stderr == (f"error: '{path}' {what}; point verify at the --workdir of a "
                                                      "run.\n") and not bad.stdout


@pytest.mark.integration
@pytest.mark.slow
def test_two_processes_record_their_own_files_and_fall_back_together(tmp_path):
    from test_multiprocess import TINY, _env

    def train(steps):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        procs = [subprocess.Popen([sys.executable, "train.py", *TINY, "--config.mesh.fsdp=8",
                                   f"--config.train.steps={steps}", "--config.checkpoint.every=1",
                                   f"--workdir={tmp_path}"], cwd=REPO, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True,
                                  env=_env(4, JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}", JAX_NUM_PROCESSES="2",
                                           JAX_PROCESS_ID=str(i))) for i in range(2)]
        outputs = [p.communicate(timeout=300)[0] for p in procs]
        assert [p.returncode for p in procs] == [0, 0], outputs
        return outputs

    train(2)
    step_dir = os.path.join(tmp_path, CHECKPOINT_DIR, "2")
    recorded = [json.loads(Path(step_dir, f"integrity.process_{i}.json").read_text())["files"] for i in (0, 1)]
    assert recorded[1] and all(integrity.writer_of(p) == 1 for p in recorded[1])
    assert any("ocdbt.process_1/" in p for p in recorded[1]) and not set(recorded[0]) & set(recorded[1])
    assert cli.main(["verify", str(tmp_path)]) == 0
    victim = max((p for p in recorded[1] if "ocdbt.process_1/d/" in p), key=lambda p: recorded[1][p]["size"])
    os.truncate(os.path.join(step_dir, victim), 1)
    outputs = train(3)
    for out in outputs:  # both processes give the same verdict and resume from step 1
        assert f"is damaged: {victim} truncated (1 of {recorded[1][victim]['size']} bytes)" in out
    assert [line["step"] for line in metrics_lines(tmp_path)] == [1, 2, 3]
    assert os.path.isdir(tmp_path / integrity.DAMAGED_DIR / "2") and cli.main(["verify", str(tmp_path)]) == 0


def _wait_for(condition, seconds=10.0):
    end = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < end, "the watcher did not read the file's chunks in time"
        time.sleep(0.02)


def test_files_are_hashed_while_written_and_read_again_only_where_needed(tmp_path, monkeypatch):
    """The watcher reads a step's files chunk by chunk while they grow (in orbax's temporary directory,
    through its rename). At the commit a file is completed from its running hash only if its sampled chunks
    still hold what was read; a file written again after it was read, or never read, is hashed whole."""
    chunk = 4096
    monkeypatch.setattr(integrity, "CHUNK_BYTES", chunk)
    checkpoints = tmp_path / "checkpoints"
    step = checkpoints / "7.orbax-checkpoint-tmp-123"
    names = ("state/d/appended", "state/d/first_rewritten", "state/d/shrunk", "state/ocdbt.process_1/d/theirs")
    for rel in names + ("../8/state/d/other_step",):
        (step / rel).parent.mkdir(parents=True, exist_ok=True)
        (step / rel).write_bytes(os.urandom(3 * chunk))
    listed = []
    walk = os.walk
    monkeypatch.setattr(integrity.os, "walk", lambda top: ((listed.append(r), r, d, f)[1:] for r, d, f in walk(top)))
    watcher = integrity.Watcher(str(checkpoints), 7, process_index=0).start()
    progress = lambda rel: watcher.files.get(((st := os.stat(step / rel)).st_dev, st.st_ino))
    _wait_for(lambda: all(progress(rel) is not None and progress(rel).offset == 3 * chunk for rel in names[:3]))
    with open(step / "state/d/appended", "ab") as f:  # grows while watched: two more chunks and a partial one
        f.write(os.urandom(2 * chunk + 100))
    _wait_for(lambda: progress("state/d/appended").offset == 5 * chunk)
    with open(step / "state/d/first_rewritten", "r+b") as f:  # same size, its first chunk written again
        f.write(os.urandom(10))
    (step / "state/d/shrunk").write_bytes(os.urandom(chunk // 2))
    known = watcher.stop()
    assert {p.offset for p in known.values()} == {5 * chunk, 3 * chunk}  # nothing of process 1's or step 8's
    assert listed and not any("process_1" in r for r in listed)  # process 1's folder is not even listed
    os.rename(step, checkpoints / "7")  # orbax's commit
    (checkpoints / "7" / "commit_success.txt").write_text("done")  # written after the watch ended
    whole = []
    hash_file = integrity.hash_file
    monkeypatch.setattr(integrity, "hash_file", lambda p: (whole.append(os.path.basename(p)), hash_file(p))[1])
    manifest = integrity.record(str(checkpoints / "7"), 0, 1, known=known)
    assert sorted(whole) == ["commit_success.txt", "first_rewritten", "shrunk"]
    assert sorted(manifest["files"]) == ["commit_success.txt", "state/d/appended", "state/d/first_rewritten",
                                         "state/d/shrunk"]
    for rel, entry in manifest["files"].items():
        assert entry["hash"] == hash_file(str(checkpoints / "7" / rel)), rel
    assert integrity.check(str(checkpoints / "7")) is None
