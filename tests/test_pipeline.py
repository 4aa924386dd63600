"""Pipeline parallelism: the schedule gives the layers-in-order result (forward and gradients) for any stage,
virtual-stage and microbatch count; training on pipeline meshes equals one device; checkpoints move between
pipeline degrees; impossible schedules are refused in one sentence."""

import json
import os
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import losses, tiny_config
from jax.sharding import NamedSharding, PartitionSpec

from jaxtron.config.schema import ConfigError
from jaxtron.parallel import timetable
from jaxtron.parallel.checks import check_devices
from jaxtron.parallel.mesh import make_mesh
from jaxtron.parallel.stages import reorder, storage_order, to_natural
from jaxtron.training.loop import run
from jaxtron.training.pipeline.fill_drain import Schedule, bubble_fraction


def _body(h, layer, extras):
    """One period: tanh(h w + b) shifted by the row's positions (extras travel with their microbatch)."""
    (positions,) = extras
    h = jnp.tanh(h @ layer["w"] + layer["b"]) + 0.01 * positions[..., None]
    return h, {"mean": jnp.mean(h)}


def _loss(out):
    return jnp.sum(jnp.sin(out) * jnp.arange(out.size, dtype=out.dtype).reshape(out.shape) / out.size)


def _stored(array, order):
    """A natural stack in a storage order, identity periods (-1) as zeros."""
    padded = np.concatenate([array, np.zeros((1, *array.shape[1:]), array.dtype)])
    return padded[np.where(order >= 0, order, len(array))]


@pytest.mark.parametrize("stages,virtual,microbatches,periods", [
    (2, 1, 2, 4), (4, 1, 4, 8), (4, 1, 6, 8), (2, 2, 3, 8), (4, 2, 5, 16), (2, 3, 2, 12),
    (2, 1, 2, 3), (4, 2, 4, 14), (2, 3, 3, 5), (4, 1, 4, 5)])  # the last four: uneven splits (identity periods)
def test_the_schedule_equals_the_layers_in_order(stages, virtual, microbatches, periods):
    rows = microbatches * (8 // stages)  # each microbatch splits over data
    keys = jax.random.split(jax.random.key(stages * 100 + virtual * 10 + microbatches), 3)
    params = {"w": jax.random.normal(keys[0], (periods, 16, 16)) * 0.4,
              "b": jax.random.normal(keys[1], (periods, 16)) * 0.1}
    x = jax.random.normal(keys[2], (rows, 4, 16))
    positions = jnp.broadcast_to(jnp.arange(4, dtype=jnp.float32) + jnp.arange(rows)[:, None], (rows, 4))
    order = storage_order(periods, stages, virtual)
    pads = -periods % (stages * virtual)
    assert sorted(order[order >= 0]) == list(range(periods))
    # the identity periods: on the last stages, in their last slots, at most one more on a stage than on another
    on_stage = (order.reshape(stages, -1) < 0).sum(axis=1)
    assert on_stage.sum() == pads and np.all(np.diff(on_stage) >= 0) and on_stage.max() - on_stage.min() <= 1
    assert all(np.all(np.diff(row < 0) >= 0) for row in order.reshape(stages, -1))
    assert virtual > 1 or list(order[order >= 0]) == list(range(periods))

    def reference(params, x, positions=positions):  # the periods in their natural order, the batch at once
        return jax.lax.scan(lambda h, layer: _body(h, layer, (positions,)), x, params)

    want, _ = reference(params, x)
    want_grads = jax.grad(lambda p, x: _loss(reference(p, x)[0]), argnums=(0, 1))(params, x)

    schedule = Schedule(stages, microbatches, virtual, pads=pads)
    mesh = make_mesh({"pipeline": stages, "data": 8 // stages})
    stacked = jax.device_put({k: _stored(np.asarray(v), order) for k, v in params.items()},
                             NamedSharding(mesh, PartitionSpec("pipeline")))
    x_on_mesh = jax.device_put(x, NamedSharding(mesh, PartitionSpec("data")))
    with jax.set_mesh(mesh):
        forward = jax.jit(lambda st, x: schedule(_body, x, st, (positions,)))
        got, stats = forward(stacked, x_on_mesh)
        grads = jax.jit(jax.grad(lambda st, x: _loss(schedule(_body, x, st, (positions,))[0]), argnums=(0, 1)))(
            stacked, x_on_mesh)
        hlo = forward.lower(stacked, x_on_mesh).compile().as_text()
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    for k in params:  # the gradient of the stored stack is that of each period, in storage order; none for pads
        np.testing.assert_allclose(grads[0][k], _stored(np.asarray(want_grads[0][k]), order), rtol=1e-5, atol=1e-5)
        assert not np.any(np.asarray(grads[0][k])[order < 0])
    np.testing.assert_allclose(grads[1], want_grads[1], rtol=1e-5, atol=1e-5)
    # stats per period in the model's order, each the mean over the microbatches (rows j, j + M, ...)
    per_micro = [reference(params, x[j::microbatches], positions[j::microbatches])[1]["mean"]
                 for j in range(microbatches)]
    assert stats["mean"].shape == (periods,)
    np.testing.assert_allclose(stats["mean"], np.mean(per_micro, axis=0), rtol=1e-5, atol=1e-6)
    assert "collective-permute" in hlo  # activations move between stages by permutes


def _compiled_gradient(schedule, periods, microbatches, width=256, stages=2):
    """The compiled gradient program of ``schedule`` over a stack of ``periods`` [width, width] matmuls."""
    params = {"w": jnp.zeros((periods, width, width)), "b": jnp.zeros((periods, width))}
    x, positions = jnp.zeros((microbatches * 4, 2, width)), jnp.zeros((microbatches * 4, 2))
    mesh = make_mesh({"pipeline": stages, "data": 8 // stages})
    stacked = jax.device_put(params, NamedSharding(mesh, PartitionSpec("pipeline")))
    with jax.set_mesh(mesh):
        grad = jax.jit(jax.grad(lambda st, x: _loss(schedule(_body, x, st, (positions,))[0])))
        return grad.lower(stacked, jax.device_put(x, NamedSharding(mesh, PartitionSpec("data")))).compile()


def test_the_stages_split_the_rows_of_the_work_outside_the_schedule(monkeypatch):
    """Embedding, output head and loss run once per row over the whole mesh, not once per stage: with a 16384-token
    vocabulary the head is most of the step, and the split halves it per device on 2 stages (the rows of 4
    data-parallel shards split over the 2 stages too), and the logits with it."""
    import contextlib

    from jaxtron.planning.dry_run import dry_run
    cfg = tiny_config(dict(pipeline=2, data=4, fsdp=1), model=dict(vocab_size=16384),
                      train=dict(global_batch_size=16), pipeline=dict(microbatches=2))
    split = dry_run(cfg)
    monkeypatch.setattr(Schedule, "outside", lambda self, rows: contextlib.nullcontext())
    whole = dry_run(cfg)  # every stage runs the head on its data shard's rows
    head = 6 * 16 * cfg.data.seq_len * cfg.model.embed_dim * cfg.model.vocab_size  # forward and backward, all rows
    assert whole.flops - split.flops == pytest.approx(head / 4 / 2, rel=0.1)
    assert split.flops < 0.6 * whole.flops and split.peak_bytes < whole.peak_bytes
    logits = 16 * cfg.data.seq_len * cfg.model.vocab_size * 4 / 8  # float32 logits of a device's rows
    assert whole.peak_bytes - split.peak_bytes > logits


def test_the_backward_pass_keeps_no_copy_of_the_weights_per_iteration():
    # 2 stages x 2 rounds of 2 periods: a round's weights are 512 KiB per stage, its activations 16 KiB; 2 -> 8
    # microbatches add 12 iterations, which would add 6 MiB if each kept the weights it ran (no remat policy:
    # every other value is kept)
    for policy in (None, jax.checkpoint_policies.nothing_saveable):
        temp = [_compiled_gradient(Schedule(2, m, 2, policy), 8, m).memory_analysis().temp_size_in_bytes
                for m in (2, 8)]
        assert temp[1] - temp[0] < 2 * 256 * 256 * 4, (policy, temp)


def test_the_models_remat_policy_holds_under_the_stage_vmap():
    # the stage vmap batches every matmul over the stages; the policy still judges the unbatched dot
    flops = {name: _compiled_gradient(Schedule(2, 2, 1, policy), 4, 2).cost_analysis()["flops"] for name, policy in
             [("none", None), ("full", jax.checkpoint_policies.nothing_saveable),
              ("dots", jax.checkpoint_policies.dots_with_no_batch_dims_saveable)]}
    # (what the dots policy recomputes, the elementwise work, is a sliver of what full recompute adds)
    assert flops["dots"] - flops["none"] < 0.01 * (flops["full"] - flops["none"]), flops


def test_sizes_the_schedule_cannot_run_are_named():
    def refused(match, **pipeline):
        mesh = pipeline.pop("mesh")
        with pytest.raises(ConfigError, match=match):
            check_devices(tiny_config(mesh, **pipeline), 8)

    refused(r"model.num_layers' \(6: 6 layers\) cannot be split into mesh.pipeline=4 stages x "
            r"pipeline.virtual_stages=1; choose stage and virtual stage counts whose product divides it, or set "
            r"--config.pipeline.uneven_stages=True to fill the last stages up with identity layers",
            mesh=dict(pipeline=4, data=2, fsdp=1), model=dict(num_layers=6))
    refused(r"model.num_layers' \(3: 3 layers\) would leave a stage of mesh.pipeline=4 x pipeline.virtual_stages=1 "
            r"with only identity layers", mesh=dict(pipeline=4, data=2, fsdp=1), model=dict(num_layers=3),
            pipeline=dict(uneven_stages=True))
    # 2, 1, 1, 1 real layers on the stages
    check_devices(tiny_config(dict(pipeline=4, data=2, fsdp=1), model=dict(num_layers=5),
                              pipeline=dict(uneven_stages=True)), 8)
    refused(r"model.num_layers' \(8: 4 periods of model.moe.every=2 blocks\) cannot be split into mesh.pipeline=2 "
            r"stages x pipeline.virtual_stages=4", mesh=dict(pipeline=2, data=4, fsdp=1),
            model=dict(num_layers=8, moe=dict(num_experts=4, every=2)), pipeline=dict(virtual_stages=4))
    refused(r"'pipeline.microbatches' \(2\) cannot keep mesh.pipeline=4 stages busy; set "
            r"--config.pipeline.microbatches to at least 4", mesh=dict(pipeline=4, data=2, fsdp=1),
            model=dict(num_layers=4), pipeline=dict(microbatches=2))
    refused(r"'pipeline.microbatches' \(4\) times the data-parallel size 4 does not divide the 8 rows of a batch; "
            r"choose a global batch size that is a multiple of 16", mesh=dict(pipeline=2, data=4, fsdp=1),
            pipeline=dict(microbatches=4))
    refused(r"execution.fp8_skip_layers' \(1\) keeps some blocks in 16 bits", mesh=dict(pipeline=2, data=4, fsdp=1),
            model=dict(num_layers=4), execution=dict(fp8=True, fp8_skip_layers=1))
    check_devices(tiny_config(dict(pipeline=2, data=4, fsdp=1), model=dict(num_layers=4),
                              pipeline=dict(virtual_stages=2)), 8)  # microbatches default to the stage count
    check_devices(tiny_config(dict(pipeline=4, data=2, fsdp=1), model=dict(num_layers=7),
                              pipeline=dict(uneven_stages=True)), 8)


def test_the_bubble_shrinks_with_microbatches_and_virtual_stages():
    assert bubble_fraction(1, 8) == 0.0
    assert bubble_fraction(4, 4) == pytest.approx(3 / 7)
    assert bubble_fraction(4, 8) == pytest.approx(3 / 11)
    assert bubble_fraction(4, 4, virtual_stages=2) == pytest.approx(3 / 11)


def test_stacks_move_between_period_orders():
    periods, group = 8, 3  # three blocks per period, as the dense blocks of an MoE period of 4
    natural = np.arange(periods * group * 2, dtype=np.float32).reshape(periods * group, 2)
    a, b = storage_order(periods, 2, 2), storage_order(periods, 4, 2)
    in_a = natural.reshape(periods, group, 2)[a].reshape(natural.shape)
    np.testing.assert_array_equal(to_natural(in_a, a), natural)
    with nnx.use_eager_sharding(False):  # logical names only, as the model's parameters carry them
        tree = {"w": nnx.Param(jnp.asarray(in_a), out_sharding=("layers", None)),
                "head": nnx.Param(jnp.arange(4.0), out_sharding=("vocab",))}
    moved = reorder(tree, a, b)
    np.testing.assert_array_equal(to_natural(np.asarray(moved["w"].get_value()), b), natural)
    np.testing.assert_array_equal(moved["head"].get_value(), jnp.arange(4.0))  # not a stacked parameter
    # an uneven split: 6 periods on 2 x 2 and on 4 x 1 stages, each filled with 2 identity periods (zeros)
    six = natural[:6 * group]
    c, d = storage_order(6, 2, 2), storage_order(6, 4, 1)
    assert list(c) == [0, 1, 4, -1, 2, 3, 5, -1] and list(d) == [0, 1, 2, 3, 4, -1, 5, -1]  # spread over stages
    with nnx.use_eager_sharding(False):
        padded = reorder({"w": nnx.Param(jnp.asarray(six), out_sharding=("layers", None))}, None, c)
    stored = np.asarray(padded["w"].get_value())
    assert stored.shape == (8 * group, 2) and not stored.reshape(8, group, 2)[c < 0].any()
    np.testing.assert_array_equal(to_natural(stored, c), six)
    np.testing.assert_array_equal(to_natural(np.asarray(reorder(padded, c, d)["w"].get_value()), d), six)
    np.testing.assert_array_equal(reorder(padded, c, None)["w"].get_value(), six)  # identity periods dropped


BASE = dict(model=dict(num_layers=4), train=dict(global_batch_size=16))


@pytest.fixture(scope="session")  # once per test process (tests/conftest.py)
def one_device(tmp_path_factory):
    return run(tiny_config(dict(fsdp=1), **BASE), str(tmp_path_factory.mktemp("one")), use_tqdm=False,
               devices=jax.devices()[:1])


PIPELINE_MESHES = {
    "pipeline2_data4": (dict(pipeline=2, data=4, fsdp=1), dict(microbatches=2), {}),
    "pipeline2_fsdp2_tensor2_virtual2": (dict(pipeline=2, fsdp=2, tensor=2), dict(microbatches=4, virtual_stages=2),
                                         {}),
    "pipeline4_data2_remat": (dict(pipeline=4, data=2, fsdp=1), dict(microbatches=4),
                              dict(execution=dict(remat="full"))),
    "pipeline2_sequence2_tensor2_accumulation": (dict(pipeline=2, fsdp=1, sequence=2, tensor=2), dict(microbatches=2),
                                                 dict(train=dict(global_batch_size=16, microbatches=2))),
}


@pytest.mark.slow
@pytest.mark.xdist_group("one_device")  # one worker builds the reference for these and the 1F1B one
@pytest.mark.parametrize("name", list(PIPELINE_MESHES))
def test_pipeline_meshes_train_like_one_device(name, one_device, tmp_path):
    mesh, pipeline, extra = PIPELINE_MESHES[name]
    summary = run(tiny_config(mesh, pipeline=pipeline, **{**BASE, **extra}), str(tmp_path), use_tqdm=False)
    expected = losses(one_device)
    assert len(expected) == 3 and np.all(np.diff(expected) != 0)
    np.testing.assert_allclose(losses(summary), expected, rtol=1e-5)
    # the stages hold their own layers: the stacked axis is split over the pipeline axis
    wq = summary.state.params["layers"]["attn"]["wq"]["weight"].get_value()
    assert wq.sharding.shard_shape(wq.shape)[0] == 4 // mesh["pipeline"]
    assert summary.history[-1]["pipeline_bubble"] == pytest.approx(
        bubble_fraction(mesh["pipeline"], pipeline["microbatches"], pipeline.get("virtual_stages", 1)))
    # after three updates the parameters (back in natural order) are those of one device: gradients agree
    order = storage_order(4, mesh["pipeline"], pipeline.get("virtual_stages", 1))
    got = nnx.to_pure_dict(summary.state.params)["layers"]["mlp"]["wo"]["weight"]
    want = nnx.to_pure_dict(one_device.state.params)["layers"]["mlp"]["wo"]["weight"]
    # (Adam divides by sqrt(v): near-zero gradients amplify rounding; 2e-4 is 2% of one lr=1e-2 update)
    np.testing.assert_allclose(to_natural(np.asarray(got), order), np.asarray(want), rtol=1e-4, atol=2e-4)


MOE = dict(model=dict(num_layers=4, moe=dict(num_experts=4, every=2)), train=dict(global_batch_size=16))


@pytest.fixture(scope="session")  # once per test process (tests/conftest.py)
def moe_one_device(tmp_path_factory):
    """The MoE model on one device with 4 pipeline microbatches (the routing stats are per microbatch)."""
    return run(tiny_config(dict(fsdp=1), pipeline=dict(microbatches=4), **MOE),
               str(tmp_path_factory.mktemp("moe_one")), use_tqdm=False, devices=jax.devices()[:1])


@pytest.mark.slow
@pytest.mark.xdist_group("moe_one_device")  # one worker builds the reference for both schedules
def test_experts_in_pipeline_stages_train_like_one_device(moe_one_device, tmp_path):
    """MoE blocks inside the stages, experts split over their own axis; the routing stats are per pipeline
    microbatch, so one device runs the same microbatches."""
    ref = moe_one_device
    got = run(tiny_config(dict(pipeline=2, fsdp=2, expert=2), pipeline=dict(microbatches=4), **MOE),
              str(tmp_path / "pipe"), use_tqdm=False)
    for key in ("loss", "moe_aux_loss", "moe_max_load"):
        np.testing.assert_allclose([h[key] for h in got.history], [h[key] for h in ref.history], rtol=1e-5)


@pytest.mark.slow
@pytest.mark.extended  # the pipeline's equality with one device on one more family (the first tier: Llama, MoE)
def test_deepseek_trains_pipelined_like_one_device(tmp_path, deepseek_one_device):
    """DeepSeek-style: latent attention, a dense first block and a prediction module (both outside the
    schedule, whole on every stage), three MoE blocks on 2 stages x 2 virtual stages (stored stage-major, an
    identity period in the last slot), each block's router bias moved by its own load. One device runs the same
    two pipeline microbatches (the 1F1B schedules' reference run)."""
    ref = deepseek_one_device
    got = run(tiny_config(dict(pipeline=2, fsdp=2, expert=2), model=_deepseek_style(),
                          pipeline=dict(microbatches=2, virtual_stages=2, uneven_stages=True), train=DEEPSEEK_TRAIN),
              str(tmp_path / "pipe"), use_tqdm=False)
    expected = losses(ref)
    assert len(expected) == 3 and np.all(np.diff(expected) != 0)
    np.testing.assert_allclose(losses(got), expected, rtol=1e-5)
    for key in ("mtp_loss", "moe_bias_spread"):
        np.testing.assert_allclose([h[key] for h in got.history], [h[key] for h in ref.history], rtol=1e-5)
    # routing is discrete: a near-tie between two experts' scores may go the other way under another reduction
    # order; at most one assignment a step (1 / (tokens x k) of a block's load, averaged over the 4 MoE blocks)
    model = _deepseek_style()
    tokens = 16 * tiny_config(dict(fsdp=1)).data.seq_len
    one = model["moe"]["num_experts"] / (tokens * model["moe"]["experts_per_token"] * 4)
    np.testing.assert_allclose([h["moe_max_load"] for h in got.history],
                               [h["moe_max_load"] for h in ref.history], rtol=0, atol=1.01 * one)
    params, want = nnx.to_pure_dict(got.state.params), nnx.to_pure_dict(ref.state.params)
    stored = np.asarray(params["moe_layers"]["mlp"]["router_bias"])
    reference = np.asarray(want["moe_layers"]["mlp"]["router_bias"])
    assert len({tuple(b) for b in reference}) == 3  # each block's bias went its own way
    np.testing.assert_array_equal(to_natural(stored, storage_order(3, 2, 2)), reference)
    np.testing.assert_array_equal(params["mtp"]["block"]["mlp"]["router_bias"],
                                  want["mtp"]["block"]["mlp"]["router_bias"])
    # the dense block and the prediction module are whole on every stage; the MoE blocks split over them
    prefix = got.state.params["layers"]["mlp"]["wi_up"]["weight"].get_value()
    assert prefix.sharding.shard_shape(prefix.shape)[0] == 1
    moe_bias = got.state.params["moe_layers"]["mlp"]["router_bias"].get_value()
    assert moe_bias.sharding.shard_shape(moe_bias.shape)[0] == 2


# --- the 1F1B schedule (jaxtron/training/pipeline/one_f_one_b.py) ---

ONE_F_ONE_B = {  # name -> (mesh, pipeline microbatches, model, schedule fields, the one-device run to match)
    "pipeline2_sequence2_tensor2": (dict(pipeline=2, fsdp=1, sequence=2, tensor=2), 4, "dense", {}, "one_device"),
    # data parallel with fsdp gathered once a step (pipeline.fsdp_gather='step'): a stage's backward runs each
    # device's rows apart, their weight gradients summed after the loop
    "pipeline2_data2_fsdp2_gather_once": (dict(pipeline=2, data=2, fsdp=2), 4, "dense", dict(fsdp_gather="step"),
                                          "one_device"),
    # MoE blocks with their experts over their own axis, and the DeepSeek-style model: latent attention, a dense
    # first block run before the schedule, three MoE blocks on two stages (an uneven split: one identity block),
    # the balancing bias and the prediction module (run with the head, a microbatch at a time; ``_deepseek_style``)
    "moe_pipeline2_fsdp2_expert2": (dict(pipeline=2, fsdp=2, expert=2), 4, "moe", {}, "moe_one_device"),
    "deepseek_pipeline2_fsdp2_expert2_uneven": (dict(pipeline=2, fsdp=2, expert=2), 2, "deepseek",
                                                dict(uneven_stages=True), "deepseek_one_device"),
    # the interleaved schedule: two chunks of layers a stage, microbatches through chunk 0 then chunk 1 of every
    # stage in groups of two; the MoE model's two periods and the DeepSeek-style model's three blocks on 2 x 2
    # slots (identity periods in the last slots of each stage)
    "interleaved_pipeline2_sequence2_tensor2_virtual2": (dict(pipeline=2, fsdp=1, sequence=2, tensor=2), 4, "dense",
                                                         dict(virtual_stages=2), "one_device"),
    "interleaved_moe_pipeline2_fsdp2_expert2_uneven": (dict(pipeline=2, fsdp=2, expert=2), 4, "moe",
                                                       dict(virtual_stages=2, uneven_stages=True), "moe_one_device"),
    "interleaved_deepseek_pipeline2_data2_expert2_uneven": (dict(pipeline=2, data=2, fsdp=1, expert=2), 2, "deepseek",
                                                            dict(virtual_stages=2, uneven_stages=True),
                                                            "deepseek_one_device"),
}


def _deepseek_style():
    """A dense first block run before the schedule, then three MoE blocks and a prediction module (an MoE block of
    its own, balanced by its own bias)."""
    from test_training import QWEN3_STYLE
    return dict(QWEN3_STYLE["deepseek_v3"], num_layers=4)


DEEPSEEK_TRAIN = dict(global_batch_size=16, router_bias_rate=0.003)


@pytest.fixture(scope="session")  # once per test process (tests/conftest.py)
def deepseek_one_device(tmp_path_factory):
    """The DeepSeek-style model of the 1F1B schedules on one device, with their 2 pipeline microbatches."""
    return run(tiny_config(dict(fsdp=1), model=_deepseek_style(), pipeline=dict(microbatches=2),
                           train=DEEPSEEK_TRAIN), str(tmp_path_factory.mktemp("deepseek_one")), use_tqdm=False,
               devices=jax.devices()[:1])


# the DeepSeek-style cases repeat what the MoE cases check with the prediction module and a dense first block added,
# and the interleaved MoE case what the interleaved dense case and the plain MoE case check apart, and plain 1F1B on
# pipeline2_sequence2_tensor2 what its interleaved twin on the same mesh checks, and 1F1B's MoE case what the
# experts-in-stages check and the dense 1F1B cases check apart: the extended tier (.ci/run), not the README's
EXTENDED = ("moe_pipeline2_fsdp2_expert2", "deepseek_pipeline2_fsdp2_expert2_uneven",
            "interleaved_deepseek_pipeline2_data2_expert2_uneven",
            "interleaved_moe_pipeline2_fsdp2_expert2_uneven", "pipeline2_sequence2_tensor2")


@pytest.mark.slow
@pytest.mark.parametrize("name", [
    pytest.param(name, marks=[pytest.mark.xdist_group(reference)] + [pytest.mark.extended] * (name in EXTENDED))
    for name, (*_, reference) in ONE_F_ONE_B.items()])
def test_the_1f1b_schedules_train_like_one_device(name, tmp_path, request):
    """'1f1b' and 'interleaved': fp32 losses of 3 steps equal one device's to 1e-5 (the MoE models' with the same
    microbatches: their routing stats are per microbatch), and so do the parameters after them; MoE's losses and
    loads too. The MoE models run with the distributed optimizer (their moments split as their weights are: the
    dense ones over fsdp x expert)."""
    mesh, microbatches, kind, schedule, reference = ONE_F_ONE_B[name]
    model = {"dense": BASE["model"], "moe": MOE["model"], "deepseek": _deepseek_style()}[kind]
    extra = dict(train=DEEPSEEK_TRAIN if kind == "deepseek" else dict(global_batch_size=16))
    distributed = dict(optimizer=dict(distributed=True)) if kind == "moe" else {}
    ref = request.getfixturevalue(reference)
    virtual = schedule.get("virtual_stages", 1)
    pipeline = dict(microbatches=microbatches, schedule="interleaved" if virtual > 1 else "1f1b", **schedule)
    got = run(tiny_config(mesh, model=model, pipeline=pipeline, **extra, **distributed), str(tmp_path / "pipe"),
              use_tqdm=False)
    if distributed:  # the attention's weights split over fsdp x expert, their moments with them
        mu = optax.tree_utils.tree_get(got.state.opt_state, "mu")["layers"]["attn"]["wq"]["weight"].get_value()
        wq = got.state.params["layers"]["attn"]["wq"]["weight"].get_value()
        assert wq.sharding.shard_shape(wq.shape)[1] == wq.shape[1] // (mesh["fsdp"] * mesh["expert"])
        assert mu.sharding.shard_shape(mu.shape) == wq.sharding.shard_shape(wq.shape)
    expected = losses(ref)
    assert len(expected) == 3 and np.all(np.diff(expected) != 0)
    np.testing.assert_allclose(losses(got), expected, rtol=1e-5)
    bubble = bubble_fraction(mesh["pipeline"], microbatches, virtual)
    assert got.history[-1]["pipeline_bubble"] == pytest.approx(bubble)
    if kind != "dense":
        for key in ("moe_aux_loss",) + (("moe_bias_spread", "mtp_loss") if kind == "deepseek" else ()):
            np.testing.assert_allclose([h[key] for h in got.history], [h[key] for h in ref.history], rtol=1e-5)
    # the staged stack's output projections after three updates, back in natural order (Adam divides by sqrt(v):
    # near-zero gradients amplify rounding; 2e-4 is 2% of one lr=1e-2 update)
    stack = "moe_layers" if kind == "deepseek" else "layers"

    def wo(params):  # the routed experts' down projections, or the dense MLP's
        down = nnx.to_pure_dict(params)[stack]["mlp"]["wo"]
        return np.asarray(down if stack == "moe_layers" else down["weight"])

    want, got_wo = wo(ref.state.params), wo(got.state.params)
    np.testing.assert_allclose(to_natural(got_wo, storage_order(want.shape[0], mesh["pipeline"], virtual)), want,
                               rtol=1e-4, atol=2e-4)


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["1f1b", "interleaved"])
def test_the_1f1b_schedules_hold_the_same_memory_whatever_the_microbatch_count(schedule):
    """Compiled temporaries per device on pipeline=2 x fsdp=4, 4 rows a microbatch: the 1F1B schedules' stay
    within 15% from 8 to 32 microbatches (a stage keeps at most 2 x stages - 1 microbatches' inputs; interleaved,
    2 x V x stages - 1 chunks' of 1/V of a stage), where fill-drain's grow with them (every microbatch's
    activations are alive when the backward starts; benchmarks/pipeline_schedules.md has all three at 8 to 64)."""
    from jaxtron.planning.dry_run import dry_run

    temp = {}
    for m in (8, 32):
        cfg = tiny_config(dict(pipeline=2, fsdp=4), model=dict(num_layers=4, embed_dim=256, mlp_dim=512),
                          pipeline=dict(microbatches=m, schedule=schedule,
                                        virtual_stages=2 if schedule == "interleaved" else 1),
                          train=dict(global_batch_size=4 * m))
        temp[m] = dry_run(cfg).temp_bytes
    assert temp[32] <= 1.15 * temp[8], temp  # 1F1B: 8.5 MiB at both; fill-drain's: 23.5 and 68.6


@pytest.mark.slow
def test_the_1f1b_head_runs_each_stages_share_of_the_tokens(monkeypatch):
    """The 1F1B schedules run the head and the loss in each forward phase on every stage (one program): each stage takes
    every S-th token of the finished microbatch, not all of them. On pipeline=2 x fsdp=4 with a 4096-token
    vocabulary the step's matmul FLOPs per device fall by half the head's (the head whole on both stages: the
    same program with one piece). GPT-3 175B's published layout on 128 H100 targets: the head's GEMMs 2.54 ->
    0.39 s of a 71.7 s budget."""
    from jaxtron.planning.dry_run import dry_run
    from jaxtron.training.pipeline import one_f_one_b

    m_, rows, seq, embed, vocab = 4, 8, 32, 64, 4096
    cfg = tiny_config(dict(pipeline=2, fsdp=4), model=dict(num_layers=2, vocab_size=vocab),
                      pipeline=dict(microbatches=m_, schedule="1f1b"), train=dict(global_batch_size=rows * m_))
    spread = dry_run(cfg).flops
    monkeypatch.setattr(one_f_one_b, "head_pieces", lambda *args: 1)
    whole = dry_run(cfg).flops
    # the head's forward and both gradients (6 FLOPs a token and weight) of a device's rows, each iteration that
    # runs the forward phase (the drain's run none; the budget counts them so, metrics/hlo.py taken)
    iterations = timetable.forward_iterations(2, m_)
    head = iterations * 6 * (rows // 4) * seq * embed * vocab
    assert whole - spread >= 0.45 * head, (whole, spread, head)


def test_the_router_bias_moves_in_the_stored_order():
    """A stage-major stack with an identity period: each stored block's bias follows its own block's load; the
    identity period's stays zero."""
    from jaxtron.training.step import balance_router_bias
    load = jnp.asarray([[0.5, 0.5, 0.0], [0.0, 0.5, 0.5], [0.5, 0.0, 0.5]])  # blocks 0, 1, 2 in the model's order
    params = nnx.State({"moe_layers": {"mlp": {"router_bias": nnx.Param(jnp.zeros((4, 3)))}}})
    moved, spread = balance_router_bias(params, load, 0.1, order=[0, 2, 1, -1])
    np.testing.assert_allclose(moved["moe_layers"]["mlp"]["router_bias"][...],
                               [[-0.1, -0.1, 0.1], [-0.1, 0.1, -0.1], [0.1, -0.1, -0.1], [0, 0, 0]], atol=1e-7)
    assert float(spread) == pytest.approx(0.2)
    assert not np.any(params["moe_layers"]["mlp"]["router_bias"][...])  # the old state is left as it was


@pytest.mark.slow
@pytest.mark.extended  # resuming a pipeline: the first tier's uneven-split check; on other meshes: test_checkpoint's
def test_a_checkpoint_resumes_on_other_pipeline_degrees(tmp_path):
    """Saved with 2 stages x 2 virtual stages (a stage-major stack), resumed with 1 and 4 stages."""
    base = dict(model=dict(num_layers=4), train=dict(global_batch_size=16, steps=4),
                checkpoint=dict(every=2, async_save=False))
    first = run(tiny_config(dict(pipeline=2, data=4, fsdp=1), pipeline=dict(microbatches=2, virtual_stages=2),
                            **base), str(tmp_path / "run"), use_tqdm=False)
    with open(tmp_path / "run" / "checkpoints" / "2" / "config" / "metadata") as f:
        assert json.load(f)["layer_order"] == [0, 2, 1, 3]
    # export reads the stage-major stack back in the model's order, whole (load) and parameter by parameter
    from jaxtron.interop.convert import _run_config, _Slices, load
    stored = np.asarray(nnx.to_pure_dict(first.state.params)["layers"]["mlp"]["wo"]["weight"])
    natural = to_natural(stored, [0, 2, 1, 3])
    assert not np.array_equal(stored, natural)
    np.testing.assert_array_equal(load(str(tmp_path / "run"))[1]["layers.mlp.wo.weight"], natural)
    run_cfg, step_dir = _run_config(str(tmp_path / "run"))
    slices = _Slices(str(tmp_path / "run"), run_cfg.model, step_dir)
    np.testing.assert_array_equal(slices.get("layers.mlp.wo.weight", ()), natural)
    for mesh, microbatches in ((dict(fsdp=8), 1), (dict(pipeline=4, data=2, fsdp=1), 4)):
        workdir = tmp_path / f"resume{mesh.get('pipeline', 1)}"
        shutil.copytree(tmp_path / "run", workdir)
        shutil.rmtree(workdir / "checkpoints" / "4")
        resumed = run(tiny_config(mesh, pipeline=dict(microbatches=microbatches), **base), str(workdir),
                      use_tqdm=False)
        assert [h["step"] for h in resumed.history] == [3, 4]
        np.testing.assert_allclose(losses(resumed), losses(first)[2:], rtol=1e-5)


@pytest.mark.slow
@pytest.mark.extended  # uneven splits train as one device in the first tier (the schedules' cases); here also resume
def test_an_uneven_split_trains_and_resumes_like_one_device(tmp_path):
    """3 layers on 2 stages (the last filled with an identity layer) train as one device does; checkpoints move
    between runs with and without the identity layer, and export never sees it."""
    base = dict(model=dict(num_layers=3), train=dict(global_batch_size=16, steps=4),
                checkpoint=dict(every=2, async_save=False))
    uneven = dict(pipeline=dict(microbatches=2, uneven_stages=True))
    one = run(tiny_config(dict(fsdp=1), **base), str(tmp_path / "one"), use_tqdm=False, devices=jax.devices()[:1])
    pipe = run(tiny_config(dict(pipeline=2, data=4, fsdp=1), **uneven, **base), str(tmp_path / "pipe"),
               use_tqdm=False)
    assert len(losses(one)) == 4 and np.all(np.diff(losses(one)) != 0)
    np.testing.assert_allclose(losses(pipe), losses(one), rtol=1e-5)
    stored = np.asarray(nnx.to_pure_dict(pipe.state.params)["layers"]["mlp"]["wo"]["weight"])
    assert stored.shape[0] == 4 and not stored[3].any()  # the identity layer stays zero: it gets no gradient
    with open(tmp_path / "pipe" / "checkpoints" / "2" / "config" / "metadata") as f:
        assert json.load(f)["layer_order"] == [0, 1, 2, -1]
    from jaxtron.interop.convert import load
    np.testing.assert_array_equal(load(str(tmp_path / "pipe"))[1]["layers.mlp.wo.weight"], stored[:3])
    # resume the pipeline's step 2 on one stage (identity layer dropped), one device's on two (added)
    for source, mesh, extra, name in (("pipe", dict(fsdp=8), {}, "to_one"),
                                      ("one", dict(pipeline=2, data=4, fsdp=1), uneven, "to_pipe")):
        shutil.copytree(tmp_path / source, tmp_path / name)
        shutil.rmtree(tmp_path / name / "checkpoints" / "4")
        resumed = run(tiny_config(mesh, **extra, **base), str(tmp_path / name), use_tqdm=False)
        assert [h["step"] for h in resumed.history] == [3, 4]
        np.testing.assert_allclose(losses(resumed), losses(one)[2:], rtol=1e-5)


@pytest.mark.integration
@pytest.mark.slow
def test_train_py_refuses_an_impossible_schedule_in_one_sentence(tmp_path):
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8", "JAX_PLATFORMS": "cpu"}
    done = subprocess.run([sys.executable, "train.py", "--config=configs/default.py", "--config.mesh.pipeline=4",
                           "--config.mesh.fsdp=2", "--config.pipeline.microbatches=2", f"--workdir={tmp_path}"],
                          cwd=repo, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1] == (
        "error: config field 'pipeline.microbatches' (2) cannot keep mesh.pipeline=4 stages busy; set "
        "--config.pipeline.microbatches to at least 4.")
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize("stages,microbatches,virtual", [(2, 4, 1), (4, 8, 1), (2, 4, 2), (4, 8, 3), (3, 3, 2)])
def test_the_1f1b_timetable_runs_each_unit_once_after_what_it_needs(stages, microbatches, virtual):
    """parallel/timetable.py: each stage runs every (microbatch, chunk) forward once and backward once; a forward
    comes one iteration after the stage before it ran it (chunk 0 on stage 0 embeds; a later chunk on stage 0 takes
    the last stage's previous chunk), a backward one iteration after the stage after it (the last stage: its own
    forward of the last chunk, in the same iteration, or stage 0's later chunk), and the kept inputs are not
    written over before they are read."""
    from jaxtron.parallel import timetable as tt

    done_f, done_b = {}, {}  # (stage, microbatch, chunk) -> iteration
    for t in range(tt.iterations(stages, microbatches, virtual)):
        for s in range(stages):
            if t < tt.forward_iterations(stages, microbatches, virtual):
                ok, m, c = tt.unit(tt.forward_unit(t, s), stages, microbatches, virtual)
                if ok:
                    assert (s, m, c) not in done_f
                    done_f[s, m, c] = t
            if t >= tt.first_backward(stages, virtual):
                ok, m, c = tt.unit(tt.backward_unit(t, s, stages, virtual), stages, microbatches, virtual, True)
                if ok:
                    assert (s, m, c) not in done_b
                    done_b[s, m, c] = t
    every = {(s, m, c) for s in range(stages) for m in range(microbatches) for c in range(virtual)}
    assert set(done_f) == set(done_b) == every
    last = stages - 1
    for s, m, c in every:
        if s > 0:
            assert done_f[s, m, c] == done_f[s - 1, m, c] + 1
        elif c > 0:
            assert done_f[0, m, c] == done_f[last, m, c - 1] + 1
        if s < last:
            assert done_b[s, m, c] == done_b[s + 1, m, c] + 1
        elif c < virtual - 1:
            assert done_b[last, m, c] == done_b[0, m, c + 1] + 1
        else:
            assert done_b[last, m, c] == done_f[last, m, c]
        # the stash slot of this unit's inputs is not written again before its backward reads it
        k = tt.forward_unit(done_f[s, m, c], s)
        j = tt.backward_unit(done_b[s, m, c], s, stages, virtual)
        assert tt.forward_unit_of_backward(j, stages, virtual) == k
        assert done_b[s, m, c] - done_f[s, m, c] < tt.kept(stages, virtual)
