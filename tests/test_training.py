"""Training is the same computation on every mesh, and microbatch accumulation equals one large batch."""

import json
import os
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx
from helpers import MESHES, losses, metrics_lines, tiny_config
from jax.sharding import NamedSharding

from jaxtron.parallel.checks import check_devices
from jaxtron.parallel.sharding import logical_to_spec
from jaxtron.training.loop import run


@pytest.fixture(scope="session")  # once per test process (tests/conftest.py)
def single_device_run(tmp_path_factory):
    cfg = tiny_config(dict(fsdp=1))
    return run(cfg, str(tmp_path_factory.mktemp("single")), use_tqdm=False, devices=jax.devices()[:1])


@pytest.mark.slow
@pytest.mark.parametrize("mesh_name", list(MESHES))
def test_losses_match_single_device(mesh_name, single_device_run, tmp_path):
    summary = run(tiny_config(MESHES[mesh_name]), str(tmp_path), use_tqdm=False)
    expected = losses(single_device_run)
    assert len(expected) == 3 and np.all(np.diff(expected) != 0)
    np.testing.assert_allclose(losses(summary), expected, rtol=1e-5)
    # the run really used the requested mesh and the rules' sharding
    wq = summary.state.params["layers"]["attn"]["wq"]["weight"].get_value()
    mesh = wq.sharding.mesh
    assert {a: s for a, s in mesh.shape.items() if s > 1} == {a: s for a, s in MESHES[mesh_name].items() if s > 1}
    assert wq.sharding.is_equivalent_to(
        NamedSharding(mesh, logical_to_spec(("layers", "embed", "heads", "head_dim"))), wq.ndim)


@pytest.mark.slow
def test_microbatches_equal_one_large_batch(single_device_run, tmp_path):
    cfg = tiny_config(dict(fsdp=1), train=dict(microbatches=4))
    summary = run(cfg, str(tmp_path), use_tqdm=False, devices=jax.devices()[:1])
    np.testing.assert_allclose(losses(summary), losses(single_device_run), rtol=1e-5)
    got = jax.tree.leaves(nnx.to_pure_dict(summary.state.params))
    want = jax.tree.leaves(nnx.to_pure_dict(single_device_run.state.params))
    for a, b in zip(got, want, strict=True):  # Adam divides by sqrt(v): near-zero gradients amplify rounding a little
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-4)  # 1% of one lr=1e-2 update


@pytest.mark.slow
def test_accumulated_gradients_equal_large_batch_gradients():
    from jaxtron.data.loader import SyntheticSource
    from jaxtron.training import state as state_lib
    from jaxtron.training.step import gradients
    cfg = tiny_config(dict(fsdp=1))
    batch = {k: jax.numpy.asarray(v) for k, v in SyntheticSource(256, 32, 0).rows(np.arange(8)).items()}
    results = []
    for k in (1, 4):
        setup = state_lib.setup(tiny_config(dict(fsdp=1), train=dict(microbatches=k)), "xla")
        state = state_lib.init_state(cfg, "xla", None)
        grads, ce_sum, count, _ = jax.jit(lambda p, b, setup=setup: gradients(setup, p, b))(state.params, batch)
        results.append((nnx.to_pure_dict(grads), float(ce_sum), float(count)))
    (g1, ce1, n1), (g4, ce4, n4) = results
    assert n1 == n4 == 8 * 32 and ce1 == pytest.approx(ce4, rel=1e-6)
    # float32 sums: error relative to the tensor's scale
    for a, b in zip(jax.tree.leaves(g4), jax.tree.leaves(g1), strict=True):
        a, b = np.asarray(a), np.asarray(b)
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5 * np.abs(b).max())



@pytest.mark.slow
def test_metrics_file_has_the_contract_fields(single_device_run, tmp_path):
    summary = run(tiny_config(dict(fsdp=8)), str(tmp_path), use_tqdm=False)
    lines = metrics_lines(tmp_path)
    assert [l["step"] for l in lines] == [1, 2, 3]
    assert lines[0]["compile_time_s"] == summary.compile_time_s > 0  # logged once, with the first step
    assert "compile_time_s" not in lines[1]
    for line in lines:
        for key in ("step", "loss", "grad_norm", "learning_rate", "step_time_s", "tokens_per_sec",
                    "tflops_per_device", "mfu"):
            assert key in line, key
        assert line["mfu"] is None  # a CPU has no dense peak: null, never a made-up number
        assert line["tokens_per_sec"] == pytest.approx(8 * 32 / line["step_time_s"], rel=1e-6)
    # learning rate: warmup reaches the peak at its last step (here the first), then the cosine
    # comes down to min_lr_ratio * peak exactly at the last step
    assert lines[0]["learning_rate"] == pytest.approx(1e-2)
    assert lines[1]["learning_rate"] == pytest.approx(1e-3 + 0.5 * 9e-3 * (1 + np.cos(np.pi * 0.5)), rel=1e-5)
    assert lines[2]["learning_rate"] == pytest.approx(1e-3, rel=1e-5)
    assert any(f.startswith("events.out.tfevents") for f in os.listdir(tmp_path))
    assert json.loads(Path(tmp_path, "config.json").read_text())["mesh"]["fsdp"] == 8


@pytest.mark.slow
def test_z_loss_changes_the_update_but_not_the_reported_loss(single_device_run, tmp_path):
    cfg = tiny_config(dict(fsdp=1), train=dict(z_loss=1e-1))
    got = losses(run(cfg, str(tmp_path), use_tqdm=False, devices=jax.devices()[:1]))
    expected = losses(single_device_run)
    assert got[0] == pytest.approx(expected[0], rel=1e-6)  # same params, z-loss not in the logged loss
    assert abs(got[2] - expected[2]) > 1e-6  # but it changed the gradients


def _optimizer_and_params(**optimizer):
    from jaxtron.training import state as state_lib
    cfg = tiny_config(dict(fsdp=1), optimizer=dict(warmup_steps=0, **optimizer))
    setup = state_lib.setup(cfg, "xla")
    return setup.tx, state_lib.init_state(cfg, "xla", None).params


@pytest.mark.slow
def test_weight_decay_shrinks_matrices_but_never_norms():
    tx, params = _optimizer_and_params(learning_rate=1e-2, weight_decay=0.5)
    zeros = jax.tree.map(jax.numpy.zeros_like, params)
    updates, _ = tx.update(zeros, tx.init(params), params)
    flat = {jax.tree_util.keystr(k): np.asarray(v) for k, v in jax.tree_util.tree_flatten_with_path(updates)[0]}
    values = {jax.tree_util.keystr(k): np.asarray(v) for k, v in jax.tree_util.tree_flatten_with_path(params)[0]}
    assert any("norm" in k for k in flat) and any("norm" not in k for k in flat)
    for key, update in flat.items():
        if "norm" in key:
            assert not update.any(), key
        else:  # decoupled decay: the update is -lr * wd * param
            np.testing.assert_allclose(update, -1e-2 * 0.5 * values[key], rtol=1e-5, atol=1e-12)


def test_a_model_too_large_for_the_devices_is_refused_before_allocating(tmp_path):
    from conftest import REPO

    from jaxtron.config.loader import load_config
    from jaxtron.config.schema import ConfigError
    from jaxtron.planning.remat import resolve_for_devices
    cfg = load_config(os.path.join(REPO, "configs", "llama3_70b.py"))  # ~790 GiB of fp32 state on a CPU host
    with pytest.raises(ConfigError, match=r"config field 'mesh' leaves \d+\.\d GiB of parameters and optimizer "
                                          r"state in all but this host has"):
        # remat 'auto' resolved as `jaxtron train` does (no policy fits: full), then the state alone is refused
        run(cfg, str(tmp_path / "w"), use_tqdm=False, resolve_remat=resolve_for_devices)
    assert not os.path.exists(tmp_path / "w")  # refused before touching the workdir


def test_state_bytes_per_device_follow_the_shardings():
    from jaxtron.parallel.mesh import make_mesh
    from jaxtron.training import state as state_lib
    cfg = tiny_config(dict(fsdp=8))
    setup = state_lib.setup(cfg, "xla")
    total = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(setup.abstract_state))
    one = state_lib.state_bytes_per_device(setup.abstract_state, state_lib.state_shardings(
        make_mesh(check_devices(tiny_config(), 1), jax.devices()[:1]), setup.abstract_state))
    eight = state_lib.state_bytes_per_device(setup.abstract_state, state_lib.state_shardings(
        make_mesh(check_devices(cfg, 8)), setup.abstract_state))
    assert one == total
    norms = sum(x.size * 4 for p, x in jax.tree_util.tree_flatten_with_path(setup.abstract_state)[0]
                if "norm" in jax.tree_util.keystr(p))  # replicated, so every device holds them whole
    assert eight == pytest.approx((total - norms) / 8 + norms, rel=1e-3)


@pytest.mark.slow
def test_microbatches_on_a_sharded_mesh_with_the_distributed_optimizer(single_device_run, tmp_path):
    """2 accumulation microbatches (each device's rows accumulating apart, summed over data once a step) and
    optimizer.distributed on data=2 x fsdp=2 x tensor=2: the moments split over data where fsdp splits them,
    besides tensor (the norms' over data and fsdp), the float32 weights (masters) split as the moments are, and the
    run equal to one
    device's (losses to 1e-5; parameters to 1% of the largest update AdamW could have made over the run, but for
    one in a thousand whose gradient near zero rounding can flip: those within twice that update)."""
    import optax

    from jaxtron.training import state as state_lib
    cfg = tiny_config(MESHES["data2_fsdp2_tensor2"], optimizer=dict(distributed=True), train=dict(microbatches=2))
    summary = run(cfg, str(tmp_path), use_tqdm=False)
    np.testing.assert_allclose(losses(summary), losses(single_device_run), rtol=1e-5)
    got = jax.tree.leaves(nnx.to_pure_dict(summary.state.params))
    want = jax.tree.leaves(nnx.to_pure_dict(single_device_run.state.params))
    largest_update = sum(line["learning_rate"] for line in summary.history)
    for a, b in zip(got, want, strict=True):
        apart = np.abs(np.asarray(a) - np.asarray(b))
        # AdamW moves a weight by about its rate a step, so no weight can drift further than both runs' moves
        assert apart.max() <= 2 * largest_update, apart.max()
        # and all but the rare weight whose gradient sits near zero (its sign left to rounding) stay within 1% of
        # one such move: 1 of 16384 weights was 1.3% apart on one 2-core Xeon, with equal losses
        assert np.mean(apart > 0.01 * largest_update) <= 1e-3, np.sort(apart.ravel())[-5:]
    mu = optax.tree_utils.tree_get(summary.state.opt_state, "mu")
    wq = summary.state.params["layers"]["attn"]["wq"]["weight"].get_value()
    wq_mu = mu["layers"]["attn"]["wq"]["weight"].get_value()
    # [layers, embed / (fsdp data), heads / tensor, head_dim]: embed over data too, beside fsdp, so one
    # reduce-scatter sums the gradient onto the moments' shard; the masters are split as the moments are (each
    # step gathers its working copy over data, training/working_copy.py)
    assert wq_mu.sharding.shard_shape(wq.shape) == (2, 16, 2, 16)
    assert wq.sharding.shard_shape(wq.shape) == (2, 16, 2, 16)
    norm_mu = mu["final_norm"]["scale"].get_value()
    assert norm_mu.sharding.shard_shape(norm_mu.shape) == (16,)  # 64 over data x fsdp
    setup = state_lib.setup(cfg, "xla")
    mesh = wq.sharding.mesh
    plain, distributed = (state_lib.state_bytes_per_device(
        setup.abstract_state, state_lib.state_shardings(mesh, setup.abstract_state, d)) for d in (False, True))
    params = sum(x.size for x in jax.tree.leaves(setup.abstract_state.params))
    # half of both moments and of the masters (/ 4 before): 3 float32 copies of a device's share, halved
    assert plain - distributed == pytest.approx(3 * 4 * params / 4 / 2, rel=0.05)


def test_learning_rate_schedule_hits_peak_and_floor_exactly():
    from jaxtron.config.schema import OptimizerConfig
    from jaxtron.training.optimizer import learning_rate_schedule
    lr = learning_rate_schedule(OptimizerConfig(learning_rate=1.0, warmup_steps=10, min_lr_ratio=0.1), 100)
    values = np.array([float(lr(s)) for s in range(100)])
    np.testing.assert_allclose(values[:10], np.arange(1, 11) / 10, rtol=1e-6)  # no step wasted at lr 0
    assert values[9] == pytest.approx(1.0) and values[99] == pytest.approx(0.1)
    assert np.all(np.diff(values[9:]) < 0) and values[54] == pytest.approx(0.55, rel=1e-6)  # cosine midpoint
    assert float(lr(150)) == pytest.approx(0.1)  # past the end: stays at the floor
    no_warmup = learning_rate_schedule(OptimizerConfig(learning_rate=1.0, warmup_steps=0, min_lr_ratio=0.0), 11)
    assert float(no_warmup(0)) == pytest.approx(1.0) and float(no_warmup(10)) == pytest.approx(0.0, abs=1e-7)


@pytest.mark.slow
def test_learned_positions_train_on_documents_longer_than_the_position_table(tmp_path):
    """Rows that start inside a long document count positions from the row start: every position is inside the
    learned table, and no step is skipped (document offsets used to reach past it and give NaN losses)."""
    import dataclasses

    from jaxtron.config.schema import DataConfig
    from jaxtron.data.prepare import prepare
    for i in range(4):  # documents of about 2,000 byte tokens, 60 times the position table
        (tmp_path / f"doc{i}.txt").write_text(f"document {i} goes on and on. " * 70)
    prepare([str(p) for p in sorted(tmp_path.glob("doc*.txt"))], "byte", str(tmp_path / "store"))
    cfg = tiny_config(train=dict(steps=3, max_nonfinite_in_row=1))
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, position_embedding="learned", max_seq_len=32),
                              data=DataConfig(source="store", path=str(tmp_path / "store"), seq_len=32,
                                              validation_fraction=0.0))
    summary = run(cfg, str(tmp_path / "run"), use_tqdm=False, devices=jax.devices()[:1])
    assert all(np.isfinite(h["loss"]) for h in summary.history)
    assert summary.history[-1]["nonfinite_steps"] == 0


@pytest.fixture(scope="session")  # once per test process (tests/conftest.py)
def packed_text(tmp_path_factory):
    """Real text in short documents, several to a row: the lines of a few standard-library modules."""
    import sysconfig

    from jaxtron.data.prepare import prepare
    root = tmp_path_factory.mktemp("packed")
    docs = []
    for name in ("textwrap.py", "bisect.py", "colorsys.py"):
        with open(os.path.join(sysconfig.get_paths()["stdlib"], name), encoding="utf-8") as f:
            docs += [line for line in f.read().splitlines() if line.strip()]
    with open(root / "docs.jsonl", "w") as f:
        f.writelines(json.dumps({"text": d}) + "\n" for d in docs)
    prepare([str(root / "docs.jsonl")], "byte", str(root / "store"), workers=1)
    return str(root / "store")


def _packed_config(mesh, store):
    return tiny_config(mesh, data=dict(source="store", path=store, seq_len=64, validation_fraction=0.05))


@pytest.fixture(scope="session")  # once per test process (tests/conftest.py)
def packed_single_device_run(packed_text, tmp_path_factory):
    return run(_packed_config(dict(fsdp=1), packed_text), str(tmp_path_factory.mktemp("packed1")), use_tqdm=False,
               devices=jax.devices()[:1])


SEQUENCE_MESHES = {
    "sequence8": dict(fsdp=1, sequence=8),
    "data2_sequence2_tensor2": dict(data=2, fsdp=1, sequence=2, tensor=2),
    "fsdp2_sequence4": dict(fsdp=2, sequence=4),
}


@pytest.mark.slow
@pytest.mark.parametrize("mesh_name", list(SEQUENCE_MESHES))
def test_context_parallel_losses_on_packed_text_match_single_device(mesh_name, packed_text,
                                                                    packed_single_device_run, tmp_path, caplog):
    """A sharded sequence runs blockwise attention over gathered keys on the load-balanced layout, with the
    residual stream split over the tensor group; one device runs XLA attention on rows in order."""
    from jaxtron.data.loader import make_sources
    rows = make_sources(_packed_config(dict(fsdp=1), packed_text))[0].rows(np.arange(8))
    assert (rows["segment_ids"].max(axis=1) >= 2).mean() > 0.5  # most rows pack several documents
    cfg = _packed_config(SEQUENCE_MESHES[mesh_name], packed_text)
    with caplog.at_level("INFO", logger="jaxtron.training.loop"):
        summary = run(cfg, str(tmp_path), use_tqdm=False)
    assert "attention blockwise" in caplog.text
    expected = losses(packed_single_device_run)
    assert len(expected) == 3 and np.all(np.diff(expected) != 0)
    np.testing.assert_allclose(losses(summary), expected, rtol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("mesh_name", ["data2_sequence2_tensor2", "fsdp2_sequence4"])
def test_cudnn_by_chunks_losses_on_packed_text_match_single_device(mesh_name, packed_text, packed_single_device_run,
                                                                   tmp_path, caplog, monkeypatch):
    """'cudnn' on a sharded sequence runs by chunks of the loader's layout (``ops/chunked.py``): the same calls
    in the XLA kernel here (cuDNN needs a GPU), through the loader, the rules table and the model."""
    from jaxtron.ops import attention as attention_ops
    from jaxtron.ops import chunked

    monkeypatch.setattr(attention_ops, "cudnn_unsupported", lambda *a: None)
    monkeypatch.setattr(chunked, "CUDNN", chunked.XlaKernel(block_q=16, block_k=16))
    cfg = tiny_config(SEQUENCE_MESHES[mesh_name], execution=dict(attention="cudnn"),
                      data=dict(source="store", path=packed_text, seq_len=64, validation_fraction=0.05))
    with caplog.at_level("INFO", logger="jaxtron.training.loop"):
        summary = run(cfg, str(tmp_path), use_tqdm=False)
    assert "attention cudnn" in caplog.text
    np.testing.assert_allclose(losses(summary), losses(packed_single_device_run), rtol=1e-5)


QWEN3_STYLE = {  # per-head query and key norms, head size not embed / heads (16); the MoE one with 4 experts
    "qwen3": dict(attention=dict(qk_norm=True, head_dim=32)),
    "qwen3_moe": dict(attention=dict(qk_norm=True, head_dim=32),
                      moe=dict(num_experts=4, experts_per_token=2, router_renormalize=True)),
    # latent attention with a low-rank query and YaRN (its softmax correction too), a dense block, then two MoE
    # blocks of 8 experts of width 32 in 4 groups plus a shared one, and a multi-token prediction module (an MoE
    # block of its own); the balancing biases move every step
    "deepseek_v3": dict(num_layers=3,
                        attention=dict(num_kv_heads=4, head_dim=16, qk_rope_head_dim=8, v_head_dim=12, q_lora_rank=32,
                                       kv_lora_rank=24),
                        rope=dict(scaling="yarn", factor=4.0, original_max_len=16, mscale=1.0, mscale_all_dim=1.0),
                        moe=dict(num_experts=8, experts_per_token=2, expert_dim=32, shared_experts=1,
                                 first_dense_layers=1, router="sigmoid", router_groups=4, router_top_groups=2,
                                 router_scale=2.5),
                        mtp=dict(depth=1)),
}


def _family_config(family, mesh):
    # routing is discrete: a larger rate (0.01) brings biased scores close enough for the tensor-parallel mesh's
    # rounding to flip one token's expert in step 3 (a 2e-5 loss difference); 0.003 leaves no near tie here
    train = dict(router_bias_rate=0.003) if family == "deepseek_v3" else {}
    return tiny_config(mesh, model=QWEN3_STYLE[family], train=train)


@pytest.fixture(scope="session")  # once per test process (tests/conftest.py)
def qwen3_single_device_runs(tmp_path_factory):
    """Each family's one-device run, made when a test first asks for it (the first tier asks for Qwen3's only)."""
    runs = {}

    def of(family: str):
        if family not in runs:
            runs[family] = run(_family_config(family, dict(fsdp=1)), str(tmp_path_factory.mktemp(family)),
                               use_tqdm=False, devices=jax.devices()[:1])
        return runs[family]
    return of


@pytest.mark.slow
# the first tier: Qwen3 on the mesh that splits what it adds (per-head norms over tensor); the extended tier the
# other meshes, and the experts over expert (Qwen3-MoE's are Qwen3's norms and experts as DeepSeek-V3's split)
@pytest.mark.parametrize("family,mesh_name", [
    ("qwen3", "data2_fsdp2_tensor2"),
    *(pytest.param(family, mesh, marks=pytest.mark.extended) for family, mesh in (
        ("deepseek_v3", "fsdp4_expert2"), ("qwen3_moe", "fsdp4_expert2"), ("qwen3", "fsdp8"),
        ("qwen3", "fsdp2_sequence2_tensor2"),
        ("qwen3_moe", "data2_fsdp2_tensor2"),
        ("deepseek_v3", "data2_fsdp2_tensor2")))])
def test_new_families_losses_match_single_device(family, mesh_name, qwen3_single_device_runs, tmp_path):
    summary = run(_family_config(family, MESHES[mesh_name]), str(tmp_path), use_tqdm=False)
    expected = losses(qwen3_single_device_runs(family))
    assert len(expected) == 3 and np.all(np.diff(expected) != 0)
    np.testing.assert_allclose(losses(summary), expected, rtol=1e-5)
    if family == "deepseek_v3":  # the balancing bias moved the same way on every mesh
        bias = summary.state.params["moe_layers"]["mlp"]["router_bias"].get_value()
        reference = qwen3_single_device_runs(family).state.params["moe_layers"]["mlp"]["router_bias"].get_value()
        assert np.abs(np.asarray(bias)).max() > 0 and np.array_equal(np.asarray(bias), np.asarray(reference))
        return
    stack = summary.state.params["moe_layers" if family == "qwen3_moe" else "layers"]
    assert stack["attn"]["q_norm"]["scale"].get_value().shape == (2, 32)  # one scale per layer, of the head size


def test_a_hook_runs_at_its_cadence_and_as_told_after_the_last_step():
    from jaxtron.training.hooks import Hook

    def steps(**kw):
        hook = Hook(run=lambda done, metrics: None, name="h", **kw)
        return [done for done in range(1, 11) if hook.due(done, 10)]

    assert steps(every=3) == [3, 6, 9]
    assert steps(every=3, last=True) == [3, 6, 9, 10]
    assert steps(every=5, last=False) == [5]  # the run's end does that step's work
    assert steps(every=0, last=True) == [10] and steps(every=0) == []
