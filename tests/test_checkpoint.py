"""Checkpoints: exact resume (also after SIGKILL of a real process), preemption, resharding, bad checkpoints."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from conftest import REPO
from flax import nnx
from helpers import metrics_lines, tiny_config
from test_multiprocess import TINY, _env

from jaxtron.checkpoint.train_state import CHECKPOINT_DIR, Checkpointer, CheckpointError, _check_compatible
from jaxtron.parallel.checks import check_devices
from jaxtron.parallel.mesh import make_mesh
from jaxtron.training import state as state_lib
from jaxtron.training.loop import run
from jaxtron.training.preemption import PREEMPTED_EXIT_CODE


def _leaves(state):
    return [np.asarray(x) for x in jax.tree.leaves(nnx.to_pure_dict(state.params))] + \
        [np.asarray(x) for x in jax.tree.leaves(state.opt_state)]


@pytest.mark.slow
def test_resume_from_an_earlier_checkpoint_is_bit_exact(tmp_path):
    cfg = tiny_config(dict(fsdp=4, tensor=2), train=dict(steps=6), checkpoint=dict(every=2))
    first = run(cfg, str(tmp_path), use_tqdm=False)
    assert sorted(os.listdir(tmp_path / CHECKPOINT_DIR)) == ["2", "4", "6"]
    for step in ("4", "6"):  # as if the run had died right after saving step 2
        shutil.rmtree(tmp_path / CHECKPOINT_DIR / step)
    second = run(cfg, str(tmp_path), use_tqdm=False)
    assert [h["step"] for h in second.history] == [3, 4, 5, 6]
    assert [h["loss"] for h in second.history] == [h["loss"] for h in first.history[2:]]
    for a, b in zip(_leaves(second.state), _leaves(first.state), strict=True):
        np.testing.assert_array_equal(a, b)
    lines = metrics_lines(tmp_path)
    assert [l["step"] for l in lines] == [1, 2, 3, 4, 5, 6]  # the lost steps were logged again, once


@pytest.mark.slow
def test_a_finished_run_is_not_trained_again(tmp_path):
    cfg = tiny_config(train=dict(steps=2), checkpoint=dict(every=0))
    run(cfg, str(tmp_path), use_tqdm=False, devices=jax.devices()[:1])
    again = run(cfg, str(tmp_path), use_tqdm=False, devices=jax.devices()[:1])
    assert again.history == [] and sorted(os.listdir(tmp_path / CHECKPOINT_DIR)) == ["2"]


@pytest.mark.slow
def test_a_checkpoint_restores_onto_other_meshes_with_identical_values(tmp_path):
    """Saved by the distributed optimizer (moments split over data too), restored without it on other meshes and
    with it on another: every value identical, each placed as the restoring run's shardings say."""
    cfg = tiny_config(dict(data=4, fsdp=2), optimizer=dict(distributed=True))
    mesh = make_mesh(check_devices(cfg, 8))
    setup = state_lib.setup(cfg, "xla")
    with jax.set_mesh(mesh):
        state = state_lib.init_state(cfg, "xla", state_lib.state_shardings(mesh, setup.abstract_state, True))
    ckpt = Checkpointer(str(tmp_path), keep=1, async_save=False)
    ckpt.save(1, state, {"step": 1}, cfg.to_dict())
    ckpt.close()
    for sizes, devices, distributed in ((dict(data=2, fsdp=2, tensor=2), jax.devices(), False),
                                        (dict(fsdp=4), jax.devices()[:4], False),
                                        (dict(data=8), jax.devices(), True)):
        other = tiny_config(sizes, optimizer=dict(distributed=distributed))
        mesh2 = make_mesh(check_devices(other, len(devices)), devices)
        shardings = state_lib.state_shardings(mesh2, setup.abstract_state, distributed)
        restored, data = Checkpointer(str(tmp_path), keep=1).restore(1, setup.abstract_state, shardings, other)
        assert data == {"step": 1}
        wq = restored.params["layers"]["attn"]["wq"]["weight"].get_value()
        assert wq.sharding.is_equivalent_to(shardings.params["layers"]["attn"]["wq"]["weight"], wq.ndim)
        assert len(wq.sharding.device_set) == len(devices)
        for got, want in zip(jax.tree.leaves(restored.opt_state), jax.tree.leaves(shardings.opt_state), strict=True):
            assert got.sharding.is_equivalent_to(want, got.ndim)
        for a, b in zip(_leaves(restored), _leaves(state), strict=True):
            np.testing.assert_array_equal(a, b)


@pytest.mark.slow
def test_a_checkpoint_of_another_model_architecture_is_refused(tmp_path):
    run(tiny_config(train=dict(steps=1)), str(tmp_path), use_tqdm=False, devices=jax.devices()[:1])
    other = tiny_config(train=dict(steps=2), model=dict(num_layers=3))
    with pytest.raises(CheckpointError,
                       match=r"another model architecture \(model.num_layers 2 != 3\); use the config"):
        run(other, str(tmp_path), use_tqdm=False, devices=jax.devices()[:1])
    # how the model runs is not its architecture: the same model resumes in bfloat16 with remat and another name
    same = tiny_config(train=dict(steps=2), execution=dict(dtype="bfloat16", remat="full"), model=dict(name="b"))
    summary = run(same, str(tmp_path), use_tqdm=False, devices=jax.devices()[:1])
    assert [h["step"] for h in summary.history] == [2]


def test_compatibility_compares_every_architecture_field_and_reads_older_layouts():
    cfg = tiny_config()
    saved = cfg.to_dict()
    # a checkpoint of the older layout: execution fields and router losses inside 'model', no 'execution' section
    saved["model"].update(dtype="bfloat16", remat="full", router_aux_loss=0.5, router_z_loss=0.0)
    del saved["execution"]
    _check_compatible(saved, cfg, "old")
    renamed = {**saved, "model": {**saved["model"], "name": "other", "init_std": 0.5}}
    _check_compatible(renamed, cfg, "renamed")  # a label and the initialisation are not the architecture
    for path, value in (("rope.theta", 1234.0), ("norm_eps", 1e-3), ("moe.router_renormalize", False),
                        ("rope.factor", 8.0), ("activation", "gelu"), ("attention.num_kv_heads", 4)):
        changed = json.loads(json.dumps(saved))
        *groups, name = path.split(".")
        target = changed["model"]
        for group in groups:
            target = target[group]
        target[name] = value
        with pytest.raises(CheckpointError, match=rf"another model architecture \(model\.{re.escape(path)} "):
            _check_compatible(changed, cfg, "changed")
    fewer = {**saved, "model": {k: v for k, v in saved["model"].items() if k not in ("moe", "mtp")}}
    _check_compatible(fewer, cfg, "older")  # fields added since have their defaults
    # the flat layout of the model fields, before they were grouped: read where they live now
    m = cfg.model
    flat = {**saved, "model": {k: v for k, v in saved["model"].items() if k not in ("rope", "attention", "moe", "mtp")}}
    flat["model"].update(rope_theta=m.rope.theta, num_heads=m.attention.num_heads,
                         num_kv_heads=m.attention.num_kv_heads, num_experts=0)
    _check_compatible(flat, cfg, "flat")
    with pytest.raises(CheckpointError, match=r"another model architecture \(model\.attention\.num_kv_heads 4 != 2\)"):
        _check_compatible({**flat, "model": {**flat["model"], "num_kv_heads": 4}}, cfg, "flat")


ARGS = [*TINY, "--config.train.steps=12", "--config.checkpoint.every=3", "--config.checkpoint.keep=2"]


def _train(workdir, *extra) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "train.py", *ARGS, *extra, f"--workdir={workdir}"], cwd=REPO,
                            env=_env(8), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def _wait_for_step(workdir, step, proc, timeout=240):
    deadline = time.time() + timeout
    path = os.path.join(workdir, "metrics.jsonl")
    while time.time() < deadline and proc.poll() is None:
        if os.path.exists(path):
            steps = [json.loads(l)["step"] for l in Path(path).read_text().splitlines() if l.strip()]
            if steps and max(steps) >= step:
                return
        time.sleep(0.02)
    raise AssertionError(f"the run did not reach step {step}: {proc.poll()} {proc.stderr.read()[-2000:]}")


def _final_state(workdir):
    import orbax.checkpoint as ocp
    tree = ocp.PyTreeCheckpointer().restore(os.path.join(workdir, CHECKPOINT_DIR, "12", "state"))
    return [np.asarray(x) for x in jax.tree.leaves(tree)]


@pytest.fixture(scope="session")  # once per test process (tests/conftest.py)
def uninterrupted(tmp_path_factory):
    workdir = str(tmp_path_factory.mktemp("whole"))
    assert _train(workdir).wait(timeout=300) == 0
    return workdir


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.parametrize("kill_at", [4, 8])
def test_sigkill_then_restart_ends_bit_exact(kill_at, uninterrupted, tmp_path):
    proc = _train(tmp_path, "--config.checkpoint.async_save=true")
    _wait_for_step(tmp_path, kill_at, proc)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
    assert _train(tmp_path).wait(timeout=300) == 0
    for a, b in zip(_final_state(tmp_path), _final_state(uninterrupted), strict=True):
        np.testing.assert_array_equal(a, b)
    losses = lambda w: {line["step"]: line["loss"] for line in metrics_lines(w)}
    assert losses(tmp_path) == losses(uninterrupted)


@pytest.mark.integration
@pytest.mark.slow
def test_sigterm_checkpoints_at_the_next_step_and_exits_with_the_preemption_code(tmp_path):
    proc = _train(tmp_path, "--config.train.steps=100000", "--config.checkpoint.every=0")
    _wait_for_step(tmp_path, 2, proc)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=120) == PREEMPTED_EXIT_CODE
    saved = [int(s) for s in os.listdir(tmp_path / CHECKPOINT_DIR) if s.isdigit()]
    logged = max(line["step"] for line in metrics_lines(tmp_path))
    assert len(saved) == 1 and saved[0] >= logged >= 2


@pytest.mark.slow
def test_a_save_cut_off_midway_is_removed_and_a_corrupted_one_set_aside(tmp_path, caplog):
    cfg = tiny_config(train=dict(steps=2), checkpoint=dict(every=1))
    run(cfg, str(tmp_path), use_tqdm=False, devices=jax.devices()[:1])
    # a later save that died while writing: orbax's temporary directory with partial contents
    partial = tmp_path / CHECKPOINT_DIR / "3.orbax-checkpoint-tmp-1700000000"
    (partial / "state").mkdir(parents=True)
    (partial / "state" / "garbage").write_bytes(b"\x00" * 10)
    more = tiny_config(train=dict(steps=3), checkpoint=dict(every=1))
    with caplog.at_level("WARNING"):
        summary = run(more, str(tmp_path), use_tqdm=False, devices=jax.devices()[:1])
    assert "removed 3.orbax-checkpoint-tmp-1700000000, a save cut off while being written" in caplog.text
    assert not partial.exists()  # its disk space is free again
    assert [h["step"] for h in summary.history] == [3]  # resumed from the complete step 2
    # flip bytes in the array data of the newest checkpoint: named, set aside, and the run resumes from step 2
    data_files = [os.path.join(d, f) for d, _, fs in os.walk(tmp_path / CHECKPOINT_DIR / "3" / "state" / "d")
                  for f in fs]
    blob = bytearray(Path(data_files[0]).read_bytes())
    blob[len(blob) // 2:] = bytes(b ^ 0xFF for b in blob[len(blob) // 2:])
    Path(data_files[0]).write_bytes(blob)
    caplog.clear()
    with caplog.at_level("WARNING"):
        summary = run(tiny_config(train=dict(steps=4)), str(tmp_path), use_tqdm=False, devices=jax.devices()[:1])
    name = os.path.relpath(data_files[0], tmp_path / CHECKPOINT_DIR / "3")
    damaged = f"checkpoint 3 in {tmp_path / CHECKPOINT_DIR} is damaged: {name} checksum mismatch; falling back"
    assert damaged in caplog.text
    assert [h["step"] for h in summary.history] == [3, 4]
    assert os.path.isdir(tmp_path / "checkpoints_damaged" / "3")


OLD_CHECKPOINTS = os.path.join(REPO, "tests", "fixtures", "checkpoints")


def _resume_fixture(fixture: str, workdir) -> object:
    """Resumes the run of a kept fixture (its config.json, its step-2 checkpoint copied into ``workdir``)."""
    shutil.copytree(os.path.join(fixture, "checkpoints"), os.path.join(workdir, CHECKPOINT_DIR))
    from jaxtron.config.loader import from_mapping
    with open(os.path.join(fixture, "config.json")) as f:
        cfg = from_mapping(json.load(f))
    return run(cfg, str(workdir), use_tqdm=False)


def _assert_as_expected(summary, fixture: str) -> None:
    """Step 3's loss and every parameter's fingerprint equal those the fixture's version reached."""
    with open(os.path.join(fixture, "expected.json")) as f:
        expected = json.load(f)
    assert [h["step"] for h in summary.history] == [3]
    np.testing.assert_allclose(summary.history[0]["loss"], expected["losses"]["3"], rtol=1e-6)
    # the fixtures name parameters in the layout of their version (jaxtron/checkpoint/layouts.py: all are layout 1)
    from jaxtron.checkpoint.layouts import older
    flat = jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(summary.state.params))[0]
    got = {}
    for path, value in flat:
        x = np.asarray(value, np.float64).ravel()
        got[tuple(str(p.key) for p in path)] = [x.sum(), (x * np.sin(np.arange(x.size))).sum()]
    assert {"/".join(older(path)) for path in got} == set(expected["params"])
    for path, fingerprint in got.items():  # a module's dropout seed is each of its projections' now
        np.testing.assert_allclose(fingerprint, expected["params"]["/".join(older(path))], rtol=1e-5, atol=1e-6,
                                   err_msg="/".join(path))


@pytest.mark.slow
@pytest.mark.parametrize("name", ["llama_pipeline", "qwen3_moe", pytest.param("deepseek", marks=pytest.mark.extended),
                                  "llama_interleaved"])  # DeepSeek's: one more MoE family, the extended tier
def test_checkpoints_written_by_an_earlier_version_still_restore(name, tmp_path, caplog):
    """Checkpoints kept from earlier versions (tests/fixtures/make_old_checkpoints.py; commit.txt names the version,
    or <name>/commit.txt a later one's), with that version's config field names: each resumes at step 2 and trains
    step 3 to the loss and parameters that version reached."""
    fixture = os.path.join(OLD_CHECKPOINTS, name)
    _assert_as_expected(_resume_fixture(fixture, tmp_path), fixture)


def _store_fixture(name: str, tmp_path, monkeypatch, again: bool) -> str:
    """The fixture copied into a working directory of its own (its paths are relative to it), its store prepared
    again by today's `jaxtron prepare` from the same text when ``again``; returns the fixture's directory."""
    fixture = os.path.join(OLD_CHECKPOINTS, name)
    shutil.copy(os.path.join(fixture, "corpus.jsonl"), tmp_path)
    if again:
        from jaxtron.data.prepare import main as prepare_main
        monkeypatch.chdir(tmp_path)
        assert prepare_main(["--input", "corpus.jsonl", "--tokenizer", "byte", "--output", "store"]) == 0
    else:
        shutil.copytree(os.path.join(fixture, "store"), tmp_path / "store")
        monkeypatch.chdir(tmp_path)
    return fixture


@pytest.mark.slow
@pytest.mark.parametrize("again", [False, True], ids=["its_own_store", "store_prepared_again"])
@pytest.mark.parametrize("name", ["store_9384506", pytest.param("store_820e9f2", marks=pytest.mark.extended),
                                  pytest.param("store_fef83a9", marks=pytest.mark.extended)])
def test_a_checkpoint_of_an_earlier_version_resumes_on_a_store_of_the_same_tokens(name, again, tmp_path, monkeypatch):
    """A run on a token store, kept from an earlier version (tests/fixtures/make_store_checkpoints.py), resumes on
    the store that version prepared and on one today's prepare writes again from the same text, whose manifest
    has gained fields since (9384506 recorded the manifest's digest, later versions the tokens'), and trains
    step 3 to that version's loss and parameters."""
    fixture = _store_fixture(name, tmp_path, monkeypatch, again)
    _assert_as_expected(_resume_fixture(fixture, tmp_path / "run"), fixture)


@pytest.mark.parametrize("name", ["store_9384506", "store_fef83a9"])
def test_a_checkpoint_is_refused_on_a_store_of_other_tokens(name, tmp_path, monkeypatch):
    """The same text with one word changed, prepared again: its tokens differ, so the checkpoint is refused."""
    fixture = _store_fixture(name, tmp_path, monkeypatch, again=False)
    text = (tmp_path / "corpus.jsonl").read_text()
    (tmp_path / "corpus.jsonl").write_text(text.replace("store", "stone", 1))
    shutil.rmtree(tmp_path / "store")
    from jaxtron.data.prepare import main as prepare_main
    assert prepare_main(["--input", "corpus.jsonl", "--tokenizer", "byte", "--output", "store"]) == 0
    from jaxtron.data.errors import DataError
    with pytest.raises(DataError, match="another data setup .*data.path differs"):
        _resume_fixture(fixture, tmp_path / "run")
    assert not os.path.exists(tmp_path / "run" / "metrics.jsonl")


@pytest.mark.slow
def test_a_lora_checkpoint_and_a_converted_model_of_an_earlier_version_load(tmp_path, monkeypatch):
    """A LoRA run with adapter dropout on a converted model, both kept from fef83a9
    (tests/fixtures/make_lora_checkpoint.py): the converted model scores the tokens as transformers did, and the
    run resumes at step 2 and trains step 3 to that version's loss and parameters, its dropout masks the same."""
    fixture = os.path.join(OLD_CHECKPOINTS, "lora_fef83a9")
    shutil.copytree(os.path.join(fixture, "base"), tmp_path / "base")
    monkeypatch.chdir(tmp_path)
    from jaxtron.interop.score import main as score
    hf = os.path.join(REPO, "tests", "fixtures", "hf", "llama")
    assert score(["--checkpoint", "base", "--tokens", os.path.join(os.path.dirname(hf), "tokens.npy"),
                  "--output", "logits.npy"]) == 0
    np.testing.assert_allclose(np.load("logits.npy"), np.load(os.path.join(hf, "logits.npy")), atol=1e-4)
    _assert_as_expected(_resume_fixture(fixture, tmp_path / "run"), fixture)


def test_a_failure_while_building_the_run_closes_what_it_had_opened(tmp_path, monkeypatch):
    """The step compiles inside the try that closes the run's parts: a failure there leaves no checkpointer (with
    its background threads) or loader open."""
    from jaxtron.training import loop

    closed = []
    for cls in (loop.Checkpointer, loop.BatchIterator):
        monkeypatch.setattr(cls, "close", lambda self, real=cls.close: (closed.append(type(self).__name__),
                                                                       real(self)))

    def fail(*args, **kwargs):
        raise RuntimeError("compilation failed")

    monkeypatch.setattr(loop, "compile_train_step", fail)
    with pytest.raises(RuntimeError, match="compilation failed"):
        run(tiny_config(train=dict(steps=1)), str(tmp_path), use_tqdm=False, devices=jax.devices()[:1])
    assert sorted(closed) == ["BatchIterator", "Checkpointer"]
