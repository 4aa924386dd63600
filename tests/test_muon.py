"""optimizer.name='muon': the blocks' matrices orthogonalized whole, per layer and per expert; AdamW for the rest;
the same run on a mesh as on one device; bad settings refused."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import losses, tiny_config
from optax.contrib import muon as plain_muon

from jaxtron.checkpoint.train_state import CheckpointError
from jaxtron.config.schema import ConfigError, OptimizerConfig
from jaxtron.models import build_model
from jaxtron.parallel.sharding import logical_names
from jaxtron.training.loop import run
from jaxtron.training.optimizer import learning_rate_schedule, make_optimizer, muon_dimensions

MOE = dict(num_layers=2, moe=dict(num_experts=4, experts_per_token=2))


def _params(model_fields):
    cfg = tiny_config(model=model_fields)
    return nnx.state(build_model(cfg.model, cfg.execution, 0), nnx.Param)


def _is_variable(x):
    return isinstance(x, nnx.Variable)


def test_muon_reads_each_weight_as_the_matrices_it_is():
    """Stacked layers and experts are batches; an output projection's inputs are all its axes but embed, any other
    weight's its first; the embedding, norms and routers are no block matrix (AdamW's)."""
    params = _params(MOE)
    dims = {"/".join(str(getattr(k, "key", k)) for k in path): muon_dimensions(v) for path, v in
            jax.tree_util.tree_leaves_with_path(params, is_leaf=_is_variable)}
    got = {k: None if d is None else (tuple(d.reduction_axis), tuple(d.output_axis)) for k, d in dims.items()}
    assert got["moe_layers/attn/wq/weight"] == ((1,), (2, 3))  # [layers, embed, heads, head_dim]
    assert got["moe_layers/attn/wo/weight"] == ((1, 2), (3,))  # [layers, heads, head_dim, embed]
    assert got["moe_layers/mlp/wi_gate"] == ((2,), (3,))  # [layers, experts, embed, mlp]
    assert got["moe_layers/mlp/wo"] == ((2,), (3,))  # [layers, experts, mlp, embed]
    for name in ("embedding", "final_norm/scale", "moe_layers/attn_norm/scale", "moe_layers/mlp/router"):
        assert got[name] is None, name


@pytest.mark.parametrize("model_fields",
                         [dict(num_layers=2), pytest.param(MOE, marks=[pytest.mark.extended, pytest.mark.slow])],
                         ids=["dense", "moe"])
def test_two_muon_steps_equal_optax_muon_on_each_matrix_alone(model_fields):
    """Each layer's (and expert's) weight, flattened to its [inputs, outputs] matrix and given to optax's plain
    Muon as a parameter of its own (Moonlight's RMS matching: 0.2 x sqrt(max(fan in, fan out)), the same weight
    decay), moves as it does inside the model's optimizer; the others move as AdamW moves them."""
    params = _params(model_fields)
    opt = OptimizerConfig(name="muon", learning_rate=0.02, warmup_steps=0, min_lr_ratio=1.0, weight_decay=0.1,
                          clip_norm=0.0)
    tx = make_optimizer(opt, 10, params)
    state = tx.init(params)
    leaves = jax.tree_util.tree_leaves_with_path(params, is_leaf=_is_variable)
    grads = [jax.tree.map(lambda v, i=i: jax.random.normal(jax.random.key(i), v.shape), params, is_leaf=_is_variable)
             for i in range(2)]
    got = []
    for g in grads:
        updates, state = tx.update(g, state, params)
        got.append(updates)
    matrices, rest = {}, {}
    for path, v in leaves:
        dims = muon_dimensions(v)
        (matrices if dims else rest)[path] = (v, dims)
    reference = plain_muon(0.02, ns_steps=5, beta=0.95, eps=1e-8, weight_decay=0.1, consistent_rms=0.2)
    adamw = optax.adamw(0.02, b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1)
    assert matrices and rest

    def as_matrices(x, dims):  # [batch..., inputs, outputs] -> [batch, fan in, fan out]
        batch = [i for i in range(x.ndim) if i not in (*dims.reduction_axis, *dims.output_axis)]
        order = batch + list(dims.reduction_axis) + list(dims.output_axis)
        shape = [math.prod(x.shape[i] for i in batch), math.prod(x.shape[i] for i in dims.reduction_axis), -1]
        return jnp.transpose(x, order).reshape(shape)

    for path, (v, dims) in matrices.items():
        w = as_matrices(v[...], dims)
        weights = {i: w[i] for i in range(w.shape[0])}
        ref_state = reference.init(weights)
        for step, g in enumerate(grads):
            gm = as_matrices(_at(g, path)[...], dims)
            want, ref_state = reference.update({i: gm[i] for i in range(w.shape[0])}, ref_state, weights)
            mine = as_matrices(_at(got[step], path)[...], dims)
            for i in range(w.shape[0]):
                np.testing.assert_allclose(mine[i], want[i], rtol=2e-4, atol=1e-6, err_msg=str(path))
    for path, (v, _) in rest.items():
        decays = not ({"norm", "bias"} & set(logical_names(v)))
        tx_ref = adamw if decays else optax.adam(0.02, b1=0.9, b2=0.95, eps=1e-8)
        ref_state = tx_ref.init(v[...])
        for step, g in enumerate(grads):
            want, ref_state = tx_ref.update(_at(g, path)[...], ref_state, v[...])
            np.testing.assert_allclose(_at(got[step], path)[...], want, rtol=1e-5, atol=1e-7, err_msg=str(path))


def _at(tree, path):
    for key in path:
        tree = tree[getattr(key, "key", key)]
    return tree


MESHES = {  # name -> (mesh, model, other sections)
    "fsdp2_expert2_tensor2": (dict(fsdp=2, expert=2, tensor=2), MOE, {}),
    "data2_fsdp2_tensor2": (dict(data=2, fsdp=2, tensor=2), dict(num_layers=2), {}),
    "fsdp2_sequence2_tensor2": (dict(fsdp=2, sequence=2, tensor=2), dict(num_layers=2), {}),
    "pipeline2_fsdp2_tensor2": (dict(pipeline=2, fsdp=2, tensor=2), dict(num_layers=4),
                                dict(pipeline=dict(microbatches=2))),
    "data2_fsdp4_distributed": (dict(data=2, fsdp=4), dict(num_layers=2),
                                dict(optimizer=dict(name="muon", learning_rate=0.02, warmup_steps=1,
                                                    distributed=True))),
    # 3 layers on 4 devices: the stack padded with a zero matrix to divide
    "fsdp4_tensor2_three_layers": (dict(fsdp=4, tensor=2), dict(num_layers=3), {}),
}


@pytest.mark.slow
@pytest.mark.extended
@pytest.mark.parametrize("name", list(MESHES))
def test_muon_losses_on_a_mesh_equal_one_devices(name, tmp_path):
    """3 float32 steps with the matrices split over fsdp, tensor, expert, stacked over pipeline stages, or their
    momentum split over data too (the distributed optimizer): each matrix is orthogonalized whole, so the losses
    equal one device's to 1e-5, and so do the parameters after them (within float32 rounding)."""
    mesh, model, other = MESHES[name]
    sections = dict(dict(optimizer=dict(name="muon", learning_rate=0.02, warmup_steps=1)), **other)
    one = dict(sections, pipeline=dict(microbatches=2)) if "pipeline" in mesh else sections
    single = run(tiny_config(dict(fsdp=1), model=model, **one), str(tmp_path / "one"), use_tqdm=False,
                 devices=jax.devices()[:1])
    split = run(tiny_config(mesh, model=model, **sections), str(tmp_path / "mesh"), use_tqdm=False)
    want = losses(single)
    assert len(want) == 3 and np.all(np.diff(want) != 0)
    np.testing.assert_allclose(losses(split), want, rtol=1e-5)
    if "pipeline" not in mesh:  # (a pipeline stores its layers stage by stage)
        # within 1% of the largest step AdamW could take over the run (the sum of its learning rates; Muon's
        # updates have AdamW's RMS): float32 sums in another order move a few elements by ~3e-5, where a matrix
        # orthogonalized in pieces would move them by its whole update
        config = tiny_config(dict(fsdp=1), model=model, **one)
        schedule = learning_rate_schedule(config.optimizer, config.train.steps)
        room = 0.01 * sum(float(schedule(step)) for step in range(config.train.steps))
        for got, ref in zip(jax.tree.leaves(split.state.params), jax.tree.leaves(single.state.params), strict=True):
            assert np.max(np.abs(np.asarray(got) - np.asarray(ref))) <= room


@pytest.mark.parametrize("field, value", [("name", "sgd"), ("muon_momentum", 1.0), ("muon_steps", 0),
                                          ("muon_rms", 0.0), ("muon_dtype", "float16")])
def test_bad_muon_settings_are_refused_in_one_sentence(field, value):
    with pytest.raises(ConfigError, match=rf"optimizer\.{field}"):
        dataclasses.replace(OptimizerConfig(name="muon"), **{field: value})


@pytest.mark.slow
@pytest.mark.extended
def test_a_muon_run_resumes_bit_exactly(tmp_path):
    """On fsdp=2 x expert=2 x tensor=2 (an MoE model: expert matrices too), killed after its step-2 save: the
    resumed run logs the same losses, bit for bit, and ends with the same state (momentum included)."""
    import os
    import shutil

    cfg = tiny_config(dict(fsdp=2, expert=2, tensor=2), model=MOE, train=dict(steps=4),
                      checkpoint=dict(every=2, async_save=False), optimizer=dict(name="muon", learning_rate=0.02))
    first = run(cfg, str(tmp_path), use_tqdm=False)
    shutil.rmtree(tmp_path / "checkpoints" / "4")
    second = run(cfg, str(tmp_path), use_tqdm=False)
    assert [h["step"] for h in second.history] == [3, 4] and os.path.isdir(tmp_path / "checkpoints" / "4")
    assert [h["loss"] for h in second.history] == [h["loss"] for h in first.history[2:]]
    for a, b in zip(jax.tree.leaves(second.state), jax.tree.leaves(first.state), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.slow
@pytest.mark.extended
def test_a_run_does_not_resume_with_another_optimizer(tmp_path):
    """The moments of one optimizer are not another's: a resume with another optimizer.name is refused, naming
    both, and the run's config.json is left as it was."""
    first = tiny_config(train=dict(steps=2), checkpoint=dict(every=2, async_save=False))
    run(first, str(tmp_path), use_tqdm=False, devices=jax.devices()[:1])
    other = tiny_config(train=dict(steps=4), checkpoint=dict(every=2, async_save=False), optimizer=dict(name="muon"))
    before = (tmp_path / "config.json").read_bytes()
    with pytest.raises(CheckpointError, match=r"optimizer\.name 'adamw' != 'muon'"):
        run(other, str(tmp_path), use_tqdm=False, devices=jax.devices()[:1])
    assert (tmp_path / "config.json").read_bytes() == before


def test_the_planners_newton_schulz_flops_are_the_ones_xla_counts():
    """``planning.muon.newton_schulz_flops`` against XLA's own count of optax's iterations on a wide and a tall
    matrix (XLA adds the elementwise FLOPs, about 7 per element of the matrix an iteration: 2% of these)."""
    from optax.contrib._muon import orthogonalize_via_newton_schulz

    from jaxtron.planning.muon import newton_schulz_flops

    coefficients = jnp.asarray((3.4445, -4.775, 2.0315))
    for shape in ((128, 384), (384, 128)):
        x = jax.ShapeDtypeStruct(shape, jnp.float32)
        compiled = jax.jit(lambda m: orthogonalize_via_newton_schulz(m, coefficients, 5)).lower(x).compile()
        counted = compiled.cost_analysis()["flops"]
        assert newton_schulz_flops(*shape, 5) == pytest.approx(counted, rel=0.03), shape


@pytest.mark.slow
@pytest.mark.extended
@pytest.mark.parametrize("layers", [8, 6])
def test_the_planner_prices_muons_moves_as_the_program_makes_them(layers):
    """fsdp=8 on XLA:CPU: Muon's program moves each matrix stack by two all-to-alls (8 layers divide over the
    devices; 6 are padded to 8) and gathers no more than AdamW's; the planner counts those bytes within 10%."""
    from jaxtron.planning.dry_run import dry_run
    from jaxtron.planning.estimate import estimate
    from jaxtron.planning.gpus import GPUS

    model = dict(embed_dim=128, mlp_dim=256, num_layers=layers)
    configs = {name: tiny_config(dict(fsdp=8), model=model, optimizer=dict(name=name)) for name in ("adamw", "muon")}
    compiled = {name: {k: v["bytes"] for k, v in dry_run(cfg).collectives.items()} for name, cfg in configs.items()}
    assert compiled["muon"]["all-gather"] <= 1.01 * compiled["adamw"]["all-gather"], compiled
    moved = compiled["muon"]["all-to-all"] - compiled["adamw"]["all-to-all"]
    planned = estimate(configs["muon"], dict(fsdp=8), GPUS["h100"], cpu_program=True).collectives["all-to-all"]
    assert planned == pytest.approx(moved, rel=0.1), compiled
