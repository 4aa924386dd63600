"""Mixture of experts: routing, dropless and capacity execution against a loop over experts, expert parallelism
on every mesh, auxiliary losses, parameter and FLOP counts of the Mixtral configs."""

import dataclasses
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import REPO
from flax import nnx
from helpers import learning_run, logged_entropy, losses, metrics_lines, tiny_config

from jaxtron.config.loader import load_config
from jaxtron.config.schema import ConfigError, ExecutionConfig, ModelConfig, replace
from jaxtron.data.loader import SyntheticSource
from jaxtron.metrics import flops
from jaxtron.models import build_model
from jaxtron.models.experts import node_rows
from jaxtron.models.moe import ExpertAxes, MoE, capacity, route
from jaxtron.models.projection import fp8_recipe
from jaxtron.ops import fp8, grouped
from jaxtron.parallel import sharding
from jaxtron.parallel.checks import check_devices
from jaxtron.parallel.mesh import make_mesh
from jaxtron.training import state as state_lib
from jaxtron.training.loop import run
from jaxtron.training.step import gradients, train_step

E, K = 8, 2
LAYER_MESHES = {
    "fsdp8": dict(fsdp=8),
    "fsdp2_expert2_tensor2": dict(fsdp=2, expert=2, tensor=2),
    "data2_expert4": dict(data=2, fsdp=1, expert=4),
    "sequence2_expert2_tensor2": dict(fsdp=1, sequence=2, expert=2, tensor=2),
    "expert8": dict(fsdp=1, expert=8),
}


def _layer_cfg(**kw) -> ModelConfig:
    # init_std 0.3 makes outputs O(1), so the tolerances below are relative ones
    base = ModelConfig(embed_dim=32, num_layers=2, attention=dict(num_heads=4, num_kv_heads=2), mlp_dim=48,
                       init_std=0.3, moe=dict(num_experts=E, experts_per_token=K))
    return replace(base, **kw)


def _layer(cfg: ModelConfig, execution: ExecutionConfig | None = None):
    with nnx.use_eager_sharding(False):
        return nnx.split(MoE(cfg, execution or ExecutionConfig(), nnx.Rngs(params=0)))


def _mesh(sizes):
    return make_mesh(tiny_config(sizes).mesh.resolve(8))


def _reference(graphdef, state, x, keep=None, renormalize=True):
    """A plain loop over all experts: every expert runs on every token, weighted by the token's routing."""
    m = nnx.merge(graphdef, state)
    probs = jax.nn.softmax(x @ m.router[...], axis=-1)
    top = jnp.argsort(-probs, axis=-1)[..., :K]  # [b, t, k]
    w = jnp.take_along_axis(probs, top, axis=-1)
    if renormalize:
        w = w / jnp.sum(w, axis=-1, keepdims=True)
    if keep is not None:
        w = w * keep
    combine = jnp.sum(jax.nn.one_hot(top, E) * w[..., None], axis=2)  # [b, t, E]
    out = jnp.zeros_like(x)
    for e in range(E):
        hidden = jax.nn.silu(x @ m.wi_gate[...][e]) * (x @ m.wi_up[...][e])
        out = out + combine[..., e:e + 1] * (hidden @ m.wo[...][e])
    return out


def _apply(graphdef, mesh, state, x):
    """(output, stats) of the MoE layer under jit, on ``mesh`` or without one."""
    fn = jax.jit(lambda s, x: nnx.merge(graphdef, s)(x))
    if mesh is None:
        return fn(state, x)
    with jax.set_mesh(mesh):
        return fn(state, x)


def _close(a, b, rtol):
    a, b = np.asarray(a), np.asarray(b)
    scale = np.abs(b).max()
    assert scale > 0.1  # the comparison is not between two near-zero arrays
    np.testing.assert_allclose(a, b, rtol=0, atol=rtol * scale)


@pytest.mark.slow
@pytest.mark.parametrize("mesh_name", [None] + list(LAYER_MESHES))
def test_dropless_equals_loop_over_experts_with_gradients(mesh_name):
    graphdef, state = _layer(_layer_cfg())
    x = jax.random.normal(jax.random.key(1), (8, 16, 32))
    mesh = _mesh(LAYER_MESHES[mesh_name]) if mesh_name else None
    y, stats = _apply(graphdef, mesh, state, x)
    _close(y, _reference(graphdef, state, x), 1e-5)
    assert float(stats["dropped"]) == 0.0

    def loss(fn):
        return lambda s, x: jnp.sum(jnp.sin(fn(s, x)))  # a loss whose gradient depends on every output

    ours = loss(lambda s, x: nnx.merge(graphdef, s)(x)[0])
    if mesh is None:
        got = jax.jit(jax.grad(ours, argnums=(0, 1)))(state, x)
    else:
        with jax.set_mesh(mesh):
            got = jax.jit(jax.grad(ours, argnums=(0, 1)))(state, x)
    want = jax.grad(loss(lambda s, x: _reference(graphdef, s, x)), argnums=(0, 1))(state, x)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        _close(g, w, 1e-5)


def _loss_and_grads_under(executions: list[ExecutionConfig], mesh_name: str, seed: int,
                          cfg: ModelConfig | None = None) -> list:
    """The MoE layer's loss (whose gradient depends on every output) and its gradients on a mesh, once for each
    execution config, from the same parameters and inputs (the layer ``cfg``, default ``_layer_cfg()``)."""
    x = jax.random.normal(jax.random.key(seed), (8, 16, 32))
    results = []
    for execution in executions:
        graphdef, state = _layer(cfg or _layer_cfg(), execution)

        def loss(s, x, graphdef=graphdef):
            return jnp.sum(jnp.sin(nnx.merge(graphdef, s)(x)[0]))
        with jax.set_mesh(_mesh(LAYER_MESHES[mesh_name])):
            results.append(jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(state, x))
    assert float(results[0][0]) != 0.0
    return results


@pytest.mark.skipif(not grouped.tokamax_installed(), reason=f"tokamax is not installed ({grouped.INSTALL})")
def test_dropless_experts_on_the_tokamax_gemm_equal_the_xla_gemm_on_an_expert_mesh():
    """execution.expert_gemm only changes the kernel: on an expert mesh (the exchange's buffers hold rows past the
    groups) the MoE layer's outputs and gradients with tokamax's grouped GEMM (its XLA implementation on a CPU,
    through jaxtron's VJP, the weight gradient by jaxtron's Pallas kernel, interpreted: float32 sums in another
    order, 1e-5) equal those with jax.lax.ragged_dot."""
    want, got = _loss_and_grads_under([ExecutionConfig(expert_gemm=g) for g in ("xla", "tokamax")],
                                      "fsdp2_expert2_tensor2", 4)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mesh_name", ["fsdp2_expert2_tensor2", "data2_expert4"])
def test_the_ragged_exchange_equals_the_padded_one(mesh_name):
    """execution.moe_exchange=ragged (emulated on a CPU, where XLA lacks ragged_all_to_all; ops/exchange.py) sends
    each expert shard only its rows and brings them home: outputs and gradients equal the padded exchange's."""
    want, got = _loss_and_grads_under([ExecutionConfig(moe_exchange=e) for e in ("padded", "ragged")], mesh_name, 5)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-6)


def test_a_full_receive_buffer_drops_the_rows_past_it_and_counts_them():
    """execution.moe_receive_factor=0.75 on data=2 x expert=4: each device receives at most 0.75 x its own 32
    routed rows. Simulated with numpy from the routing: each receiver takes its peers' chunks in peer order, the
    first rows of a chunk first; the rows past its buffer get no expert output. The layer equals the loop over
    experts without those assignments, and its 'dropped' stat is their share."""
    x = jax.random.normal(jax.random.key(6), (8, 16, 32))
    graphdef, state = _layer(_layer_cfg(), ExecutionConfig(moe_receive_factor=0.75))
    with jax.set_mesh(_mesh(LAYER_MESHES["data2_expert4"])):  # batch rows over (data, fsdp, expert)
        y, stats = jax.jit(lambda s, x: nnx.merge(graphdef, s)(x))(state, x)
    layer = nnx.merge(graphdef, state)
    ids = np.asarray(route(layer.cfg, x @ layer.router[...])[0]).reshape(8, -1)  # [batch row = device, t * k]
    ep, local, room = 4, E // 4, 24
    keep = np.ones(ids.shape, bool)
    for group in (range(4), range(4, 8)):  # the devices of one expert group: one batch row each
        orders = [np.argsort(ids[r], kind="stable") for r in group]
        counts = np.array([[np.sum(ids[r] // local == j) for j in range(ep)] for r in group])
        fits = np.clip(room - (np.cumsum(counts, 0) - counts), 0, counts)
        for source, r in enumerate(group):
            starts = np.cumsum(counts[source]) - counts[source]
            for j in range(ep):
                keep[r, orders[source][starts[j] + fits[source, j]:starts[j] + counts[source, j]]] = False
    assert 0.05 < 1 - keep.mean() < 0.5  # the buffers did fill
    np.testing.assert_allclose(float(stats["dropped"]), 1 - keep.mean(), rtol=1e-6)
    _close(y, _reference(graphdef, state, x, keep=keep.reshape(8, 16, K)), 1e-5)


@pytest.mark.parametrize("mode", ["capacity", "dropless"])
def test_fp8_experts_equal_the_experts_on_the_fp8_grid(mode):
    """execution.fp8: each expert GEMM takes its operands rounded to e4m3 with current scales, one for every token
    row, one for every hidden row and one per expert for the weights (capacity mode's batched GEMMs, ops/fp8.py;
    dropless mode's grouped GEMMs, ops/grouped_fp8.py), the hidden rows weighted by the router. Written out token
    by token with those roundings, the layer's output agrees to 1e-3 of its scale; without FP8 it is over 1% off,
    and with one scale for all experts' weights about 9% (checked once by hand, when the per-expert scales
    came)."""
    x = jax.random.normal(jax.random.key(7), (4, 16, 32))
    graphdef, state = _layer(_layer_cfg(), ExecutionConfig(moe_mode=mode, capacity_factor=8.0))
    layer = nnx.merge(graphdef, state)
    def fp8_layer(s, x):
        with fp8_recipe("tensorwise"):  # as the layer stack opens it around an FP8 layer span
            return nnx.merge(graphdef, s)(x)

    y8, stats = jax.jit(fp8_layer)(state, x)
    y, _ = jax.jit(lambda s, x: nnx.merge(graphdef, s)(x))(state, x)
    assert float(stats["dropped"]) == 0.0  # room for every assignment

    def on_grid(a):
        scale = fp8.current_scale(a, fp8.E4M3)
        return fp8.dequantize(fp8.quantize(a, scale, fp8.E4M3), scale, a.dtype)
    ids, weights, _ = route(layer.cfg, x @ layer.router[...])
    ids, weights = np.asarray(ids).reshape(-1, K), np.asarray(weights).reshape(-1, K)
    rows = on_grid(x.reshape(-1, 32))
    gate, up, down = (jax.vmap(on_grid)(p[...]) for p in (layer.wi_gate, layer.wi_up, layer.wo))
    pairs = [(n, j) for n in range(rows.shape[0]) for j in range(K)]
    # the router weights scale the hidden rows ahead of the down projection, so the hidden values on the grid are
    # the weighted ones
    hidden = on_grid(jnp.stack([weights[n, j] * jax.nn.silu(rows[n] @ gate[ids[n, j]]) * (rows[n] @ up[ids[n, j]])
                                for n, j in pairs]))
    out = jnp.stack([hidden[i] @ down[ids[n, j]] for i, (n, j) in enumerate(pairs)]).reshape(-1, K, 32)
    want = jnp.sum(out, axis=1).reshape(x.shape)
    scale = float(jnp.max(jnp.abs(want)))
    assert float(jnp.max(jnp.abs(y8 - want))) < 1e-3 * scale
    assert float(jnp.max(jnp.abs(y - want))) > 1e-2 * scale


def test_the_ragged_layout_places_every_chunk():
    """Three peers; counts[s, j] rows go from s to j. Device 1 sends its chunks from where they start in its sorted
    rows to where they land in each receiver (after the lower peers' chunks), and finds its own incoming chunks
    packed peer by peer; the way back names where each chunk came from."""
    from jaxtron.ops import exchange

    counts = jnp.array([[2, 0, 3], [1, 4, 2], [0, 5, 1]])
    plan = exchange.layout(counts, jnp.array(1))
    np.testing.assert_array_equal(plan.send_offsets, [0, 1, 5])
    np.testing.assert_array_equal(plan.send_sizes, [1, 4, 2])
    np.testing.assert_array_equal(plan.remote_offsets, [2, 0, 3])  # after peer 0's 2, 0, 3 rows at each receiver
    np.testing.assert_array_equal(plan.recv_offsets, [0, 0, 4])
    np.testing.assert_array_equal(plan.recv_sizes, [0, 4, 5])
    np.testing.assert_array_equal(plan.home_offsets, [2, 1, 0])  # peer 0's chunk for 1 began after its 2 for 0


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["dropless", "capacity"])
@pytest.mark.parametrize("changes", [{"embed": None, "mlp": None}, {"experts": "fsdp", "embed": "expert"}],
                         ids=["experts_split_weights_whole", "every_collective_on_another_axis"])
def test_the_expert_collectives_follow_a_changed_rules_table(monkeypatch, changes, mode):
    """The MoE names no mesh axis: remap its weights in the rules table and it gathers, exchanges and sums over
    the new axes, with the same outputs and gradients as without a mesh."""
    monkeypatch.setattr(sharding, "_RULES", {**sharding._RULES, **changes})
    graphdef, state = _layer(_layer_cfg(), ExecutionConfig(moe_mode=mode))
    x = jax.random.normal(jax.random.key(2), (8, 16, 32))
    mesh = _mesh(dict(fsdp=2, expert=2, tensor=2))
    with jax.set_mesh(mesh):
        axes = ExpertAxes.from_rules()
    want = {"experts_split_weights_whole": ExpertAxes(("expert",), (), ()),
            "every_collective_on_another_axis": ExpertAxes(("fsdp",), ("expert",), ("tensor",))}
    assert axes in want.values()

    def outputs_and_grads(s, x):
        y = nnx.merge(graphdef, s)(x)[0]
        return y, jax.grad(lambda s, x: jnp.sum(jnp.sin(nnx.merge(graphdef, s)(x)[0])), argnums=(0, 1))(s, x)

    reference = jax.jit(outputs_and_grads)(state, x)
    with jax.set_mesh(mesh):
        got = jax.jit(outputs_and_grads)(state, x)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(reference), strict=True):
        _close(g, w, 1e-5)


def test_a_rules_table_the_experts_cannot_follow_is_refused(monkeypatch):
    monkeypatch.setattr(sharding, "_RULES", {**sharding._RULES, "mlp": "fsdp"})
    with pytest.raises(ValueError, match="splits the experts' gate/up weights .* and down weights"):
        ExpertAxes.from_rules()
    monkeypatch.setattr(sharding, "_RULES", {**sharding._RULES, "mlp": "data"})
    with pytest.raises(ValueError, match=r"splits both the tokens and the experts' intermediate width over \['data'\]"):
        ExpertAxes.from_rules()


def _collectives(mesh, graphdef, state, x) -> str:
    with jax.set_mesh(mesh):
        fn = jax.jit(jax.grad(lambda s, x: jnp.sum(nnx.merge(graphdef, s)(x)[0] ** 2), argnums=(0, 1)))
        return fn.lower(state, x).compile().as_text()


@pytest.mark.slow
def test_expert_axis_exchanges_tokens_by_all_to_all():
    x = jax.random.normal(jax.random.key(1), (8, 16, 32))
    graphdef, state = _layer(_layer_cfg())
    hlo = _collectives(_mesh(dict(data=2, fsdp=1, expert=4)), graphdef, state, x)
    # dropless, forward: rows out, per-expert counts, outputs back; backward: the two row exchanges transposed
    exchanges = [line for line in hlo.splitlines() if "all-to-all(" in line]
    assert len(exchanges) == 5
    # each device sends each of the 4 expert shards a fixed buffer of (its 1 row x 16 tokens x top-2) rows, each
    # with its router weight in a column after it (padded to 40 columns), and gets 32-column outputs back
    assert sum("f32[1,32,40]" in line for line in exchanges) == sum("f32[1,32,32]" in line for line in exchanges) == 2
    assert "all-to-all(" not in _collectives(_mesh(dict(fsdp=8)), graphdef, state, x)
    # capacity: slots out (with their router weights) and back, and both transposed; per shard 2 local experts x
    # 1 row x 5 slots
    graphdef, state = _layer(_layer_cfg(), ExecutionConfig(moe_mode="capacity"))
    hlo = _collectives(_mesh(dict(data=2, fsdp=1, expert=4)), graphdef, state, x)
    exchanges = [line for line in hlo.splitlines() if "all-to-all(" in line]
    assert len(exchanges) == 4 and [line.count("f32[1,2,5,40]") + line.count("f32[1,2,5,32]")
                                    for line in exchanges] == [4] * 4


def _keep_reference(ids: np.ndarray, slots: int) -> np.ndarray:
    """Capacity rule by hand: per row, first choices in token order, then second choices, each expert
    taking at most ``slots``."""
    b, t, k = ids.shape
    keep = np.zeros(ids.shape, bool)
    for row in range(b):
        used = np.zeros(E, int)
        for choice in range(k):
            for tok in range(t):
                e = ids[row, tok, choice]
                keep[row, tok, choice] = used[e] < slots
                used[e] += 1
    return keep


def test_capacity_mode_with_room_for_every_token_equals_dropless():
    x = jax.random.normal(jax.random.key(2), (8, 16, 32))
    graphdef, state = _layer(_layer_cfg())
    dropless, _ = _apply(graphdef, None, state, x)
    roomy = ExecutionConfig(moe_mode="capacity", capacity_factor=E / K)  # capacity = the whole row
    assert capacity(_layer_cfg(), roomy.capacity_factor, 16) == 16
    graphdef_c, state_c = _layer(_layer_cfg(), roomy)
    for mesh in (None, _mesh(dict(data=2, fsdp=1, expert=4))):
        y, stats = _apply(graphdef_c, mesh, state_c, x)
        np.testing.assert_allclose(np.asarray(y), np.asarray(dropless), rtol=0, atol=1e-5)
        assert float(stats["dropped"]) == 0.0


@pytest.mark.parametrize("mesh_name", [None, "sequence2_expert2_tensor2", "expert8"])
def test_capacity_mode_drops_by_priority_and_dropped_tokens_pass_through(mesh_name):
    cfg, execution = _layer_cfg(), ExecutionConfig(moe_mode="capacity", capacity_factor=0.25)
    slots = capacity(cfg, execution.capacity_factor, 16)
    assert slots == 1  # ceil(0.25 * 16 * 2 / 8): one token per expert and row
    graphdef, state = _layer(cfg, execution)
    x = jax.random.normal(jax.random.key(3), (8, 16, 32))
    y, stats = _apply(graphdef, _mesh(LAYER_MESHES[mesh_name]) if mesh_name else None, state, x)
    m = nnx.merge(graphdef, state)
    probs = jax.nn.softmax(x @ m.router[...], axis=-1)
    ids = np.asarray(jnp.argsort(-probs, axis=-1)[..., :K])
    keep = _keep_reference(ids, slots)
    assert 0.75 <= 1 - keep.mean() < 1  # 8 slots per row for 32 assignments
    assert float(stats["dropped"]) == pytest.approx(1 - keep.mean(), abs=1e-7)
    _close(y, _reference(graphdef, state, x, keep=jnp.asarray(keep, jnp.float32)), 1e-5)
    fully_dropped = ~keep.any(-1)
    assert fully_dropped.any()
    assert np.all(np.asarray(y)[fully_dropped] == 0.0)  # the block adds nothing: the residual carries them


@pytest.mark.slow
def test_router_weights_and_auxiliarylosses():
    logits = jax.random.normal(jax.random.key(4), (4, 8, E)) * 3
    probs = np.asarray(jax.nn.softmax(logits, axis=-1), np.float64)
    top = np.argsort(-probs, axis=-1)[..., :K]
    picked = np.take_along_axis(probs, top, -1)
    for renormalize in (True, False):
        ids, w, stats = route(_layer_cfg(moe=dict(router_renormalize=renormalize)), logits)
        np.testing.assert_array_equal(np.asarray(ids), top)
        want = picked / picked.sum(-1, keepdims=True) if renormalize else picked
        np.testing.assert_allclose(np.asarray(w), want, rtol=1e-6)
    load = np.bincount(top.reshape(-1), minlength=E) / top.size
    np.testing.assert_allclose(np.asarray(stats["load"]), load, rtol=1e-6)
    assert float(stats["aux_loss"]) == pytest.approx(E * np.sum(load * probs.mean((0, 1))), rel=1e-5)
    log_z = np.log(np.exp(np.asarray(logits, np.float64)).sum(-1))
    assert float(stats["z_loss"]) == pytest.approx(np.mean(log_z ** 2), rel=1e-5)
    # a router that sends every token to the same two experts has the largest loss: experts / k
    skewed = jnp.zeros((4, 8, E)).at[..., :K].set(30.0)
    assert float(route(_layer_cfg(), skewed)[2]["aux_loss"]) == pytest.approx(E / K, rel=1e-4)


@pytest.mark.slow
def test_moe_every_second_block_runs_blocks_in_order():
    config = tiny_config(model=dict(num_layers=4, moe=dict(num_experts=4, experts_per_token=2, every=2), init_std=0.2))
    cfg = config.model
    model = build_model(cfg, config.execution, 0)
    params = nnx.state(model, nnx.Param)
    assert params["layers"]["mlp"]["wi_up"]["weight"].get_value().shape == (2, 64, 128)  # blocks 0 and 2: dense
    assert params["moe_layers"]["mlp"]["wi_up"].get_value().shape == (2, 4, 64, 128)  # blocks 1 and 3: MoE
    assert sum(math.prod(x.shape) for x in jax.tree.leaves(params)) == flops.param_count(cfg)
    tokens = jax.random.randint(jax.random.key(5), (2, 16), 0, cfg.vocab_size)
    out = jax.jit(lambda t: model(t))(tokens)
    x_model, stats = out.hidden, out.stats
    assert stats["load"].shape == (2, 4)
    # by hand: dense 0, MoE 0, dense 1, MoE 1
    dense_def, dense = nnx.split(model.layers)
    moe_def, moe = nnx.split(model.moe_layers)
    positions = jnp.broadcast_to(jnp.arange(16), tokens.shape)
    x = jnp.take(model.embedding[...], tokens, axis=0)
    for i in range(2):
        x, _ = nnx.merge(dense_def, jax.tree.map(lambda a, i=i: a[i], dense))(x, positions, None)
        x, _ = nnx.merge(moe_def, jax.tree.map(lambda a, i=i: a[i], moe))(x, positions, None)
    np.testing.assert_allclose(np.asarray(x_model), np.asarray(model.final_norm(x)), atol=2e-5)


MIXTRAL = {"mixtral_8x7b": (46.7e9, 12.9e9), "mixtral_8x22b": (140.6e9, 39e9)}


@pytest.mark.parametrize("name", list(MIXTRAL))
def test_mixtral_parameter_counts_match_published(name):
    cfg = load_config(os.path.join(REPO, "configs", f"{name}.py"))
    abstract = nnx.eval_shape(lambda: build_model(cfg.model, cfg.execution, 0))
    counted = sum(math.prod(x.shape) for x in jax.tree.leaves(nnx.state(abstract, nnx.Param)))
    total, active = MIXTRAL[name]
    assert counted == flops.param_count(cfg.model) == pytest.approx(total, rel=5e-3)
    assert flops.param_count(cfg.model, active=True) == pytest.approx(active, rel=1e-2)
    check_devices(cfg, 64)  # the config's own mesh is valid on 64 devices


def test_flops_count_only_the_active_experts_and_the_router():
    mixtral = load_config(os.path.join(REPO, "configs", "mixtral_8x7b.py"))
    cfg = mixtral.model
    h, f, L = 4096, 14336, 32
    terms = flops.flops_breakdown(cfg, 4096)
    assert terms["experts"] == 6.0 * L * 2 * 3 * h * f and terms["mlp"] == 0  # top-2 of 8 experts, no dense MLP
    assert terms["router"] == 6.0 * L * h * 8
    dense = replace(cfg, moe=dict(num_experts=0))  # the same model with one MLP per block
    assert flops.flops_per_token(cfg, 4096) - flops.flops_per_token(dense, 4096) == \
        pytest.approx(6.0 * L * (3 * h * f + 8 * h))
    # save_dots keeps weight matmuls without batch dimensions; the experts' gate and up GEMMs are recomputed like
    # attention scores (not their down projection: its output is not needed again)
    saved = dataclasses.replace(mixtral.execution, remat="save_dots")
    assert flops.hardware_flops_per_token(cfg, saved, 4096) == pytest.approx(
        flops.flops_per_token(cfg, 4096) + (terms["attention_scores"] + terms["experts"] * 2 / 3) / 3)
    # 6 * active parameters (without the embedding) is the matmul part, as for a dense model
    no_attention = flops.flops_per_token(cfg, 4096) - terms["attention_scores"]
    active_matmul = flops.param_count(cfg, active=True) - cfg.vocab_size * h - (2 * L + 1) * h
    assert no_attention == pytest.approx(6.0 * active_matmul)


@pytest.mark.parametrize("field, value", [
    ("model.moe.num_experts", 6),  # mesh.expert = 4 does not divide 6
    ("model.moe.every", 3),
    ("model.moe.experts_per_token", 9),
    ("execution.moe_mode", "token_choice"),
    ("model.activation", "gelu"),
    ("execution.capacity_factor", 0.0),
    ("execution.moe_chunks", 0),
    ("execution.moe_node_shards", -1),
    ("execution.moe_node_shards", 3),  # does not divide mesh.expert = 4
])
def test_bad_moe_config_names_the_field(field, value):
    section, *groups, name = field.split(".")
    sections = {"model": dict(num_layers=4, moe=dict(num_experts=8))}
    target = sections.setdefault(section, {})
    for group in groups:
        target = target[group]
    target[name] = value
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        cfg = tiny_config(dict(fsdp=2, expert=4), **sections)
        check_devices(cfg, 8)


@pytest.mark.parametrize("other", [dict(moe_mode="capacity"), dict(moe_exchange="padded")])
def test_rows_once_per_node_refuse_an_exchange_that_cannot_send_them(other):
    with pytest.raises(ConfigError, match=r"'execution\.moe_node_shards' \(2\) "):
        ExecutionConfig(moe_node_shards=2, **other)


MOE = dict(moe=dict(num_experts=4, experts_per_token=2))


@pytest.fixture(scope="session")  # once per test process (tests/conftest.py)
def single_device_moe_run(tmp_path_factory):
    workdir = str(tmp_path_factory.mktemp("moe_single"))
    return workdir, run(tiny_config(dict(fsdp=1), model=MOE), workdir, use_tqdm=False, devices=jax.devices()[:1])


@pytest.mark.slow
@pytest.mark.parametrize("mesh", [dict(data=2, fsdp=2, tensor=2), dict(data=2, fsdp=1, expert=2, tensor=2),
                                  pytest.param(dict(fsdp=2, expert=4), marks=pytest.mark.extended)],  # as expert2
                         ids=["expert1", "expert2", "expert4"])
def test_training_losses_are_the_same_on_every_mesh(mesh, single_device_moe_run, tmp_path):
    summary = run(tiny_config(mesh, model=MOE), str(tmp_path), use_tqdm=False)
    expected = losses(single_device_moe_run[1])
    assert len(expected) == 3 and np.all(np.diff(expected) != 0)
    np.testing.assert_allclose(losses(summary), expected, rtol=1e-5)
    wi = summary.state.params["moe_layers"]["mlp"]["wi_up"].get_value()
    assert wi.sharding.shard_shape(wi.shape)[1] == 4 // mesh.get("expert", 1)  # experts really split


@pytest.mark.slow
def test_routing_metrics_are_logged(single_device_moe_run):
    workdir, _ = single_device_moe_run
    lines = metrics_lines(workdir)
    last = [line for line in lines if "loss" in line][-1]
    load = [last[f"expert_load/{e}"] for e in range(4)]
    assert sum(load) == pytest.approx(1.0) and min(load) > 0
    assert last["moe_max_load"] == pytest.approx(4 * max(load))
    assert last["moe_dropped_fraction"] == 0.0 and last["moe_aux_loss"] >= 1.0 and last["moe_z_loss"] > 0
    assert "expert_load/4" not in last


def _skewed_state(cfg):
    """A fresh state whose tokens share one embedding direction that the router sends to expert 0."""
    state = state_lib.init_state(cfg, "xla", None)
    params = nnx.to_pure_dict(state.params)
    u = jax.random.normal(jax.random.key(7), (cfg.model.embed_dim,))
    params["embedding"] = params["embedding"] + 0.01 * u  # about half of each token's embedding (std 0.02)
    router = params["moe_layers"]["mlp"]["router"]
    params["moe_layers"]["mlp"]["router"] = router.at[:, :, 0].add(u / jnp.linalg.norm(u))
    nnx.replace_by_pure_dict(state.params, params)
    return state


def _skewed_run(steps: int, model: dict, train: dict, first_step=None) -> tuple[list[float], state_lib.TrainState]:
    """``steps`` train steps of the tiny MoE from the skewed start: (moe_max_load of each step, the last state).
    ``first_step(setup, state, batch, new_state)`` checks the first step (one more compile, so once)."""
    cfg = tiny_config(model=model, train=dict(steps=steps, router_z_loss=0.0, **train),
                      optimizer=dict(learning_rate=1e-3, warmup_steps=1, min_lr_ratio=1.0))
    setup = state_lib.setup(cfg, "xla")
    step = jax.jit(lambda s, b: train_step(setup, s, b))
    source = SyntheticSource(256, 32, 0)
    state, loads = _skewed_state(cfg), []
    for i in range(steps):
        batch = {k: jnp.asarray(v) for k, v in source.rows(np.arange(8 * i, 8 * i + 8)).items()}
        new_state, metrics = step(state, batch)
        if i == 0 and first_step:
            first_step(setup, state, batch, new_state)
        state = new_state
        loads.append(float(metrics["moe_max_load"]))
    return loads, state


def _max_loads(coefficient: float, steps: int) -> list[float]:
    def router_gets_gradients(setup, state, batch, _):
        grads = jax.jit(lambda p, b: gradients(setup, p, b)[0])(state.params, batch)
        router_grad = np.asarray(grads["moe_layers"]["mlp"]["router"].get_value())
        assert np.all(np.isfinite(router_grad)) and np.abs(router_grad).max() > 0

    return _skewed_run(steps, MOE, dict(router_aux_loss=coefficient),
                       router_gets_gradients if coefficient else None)[0]


@pytest.mark.slow
@pytest.mark.extended  # the router bias's balance check stays in the first tier
def test_auxiliary_loss_moves_the_load_toward_balance():
    with_aux, without = _max_loads(1.0, 20), _max_loads(0.0, 20)
    assert with_aux[0] == without[0] == 2.0  # the skewed start: expert 0 is one of the two choices of every token
    # moe_max_load: the busiest expert's share relative to a balanced one; averaged over the last 10 steps
    assert np.mean(with_aux[10:]) < 1.35 and np.mean(without[10:]) > 1.9


def _learns_with_experts_split_over_two_devices(config: str, tmp_path) -> list[dict]:
    """60 steps of a tiny MoE config on the standard library, experts split over 2 devices, in capacity mode (on a
    CPU its dense slots cost a fraction of dropless's expanded ragged_dot); checks that it learned and returns
    the logged training lines."""
    proc = learning_run(config, tmp_path / "run", 2, f"--config.data.path={tmp_path / 'stdlib-store'}",
                        "--config.train.steps=60", "--config.train.global_batch_size=8", "--config.train.log_every=20",
                        "--config.train.eval_batches=2", "--config.mesh.expert=2", "--config.mesh.fsdp=1",
                        "--config.execution.moe_mode=capacity")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "'expert': 2" in proc.stderr  # the mesh of the run's first log line: half the experts on each device
    entropy = logged_entropy(proc.stderr)
    lines = metrics_lines(tmp_path / "run")
    logged = [line for line in lines if "loss" in line]
    validation = [line["eval/loss"] for line in lines if "eval/loss" in line]
    assert logged[-1]["step"] == 60 and logged[-1]["loss_avg"] < entropy - 0.5 and validation[-1] < entropy - 0.5
    return logged


@pytest.mark.integration
@pytest.mark.slow
def test_mixtral_tiny_learns_text_with_experts_split_over_two_devices(tmp_path):
    last = _learns_with_experts_split_over_two_devices("mixtral_tiny.py", tmp_path)[-1]
    # early in training the byte-level router is far from balanced: about 30% of assignments exceed capacity 1.25
    assert 1.0 <= last["moe_max_load"] < 8.0 / 2 and 0.0 < last["moe_dropped_fraction"] < 0.5


@pytest.mark.integration
@pytest.mark.slow
def test_deepseek_tiny_learns_text_with_experts_split_over_two_devices(tmp_path):
    logged = _learns_with_experts_split_over_two_devices("deepseek_tiny.py", tmp_path)
    # the balancing bias moves every step (0.001 each way), so its spread grows; the load is logged
    spreads = [line["moe_bias_spread"] for line in logged]
    assert 0 < spreads[0] < spreads[-1] <= 2 * 0.001 * 60 and 1.0 <= logged[-1]["moe_max_load"] < 16 / 2


def _deepseek_choice(logits, bias, groups, top_groups, k, scale):
    """DeepSeek-V3's routing written out token by token with numpy: sigmoid scores, the best ``top_groups``
    groups by the sum of their two best biased scores, the top-k biased scores within them, weighted by the
    unbiased scores renormalised and scaled. -> per token, {expert: weight}."""
    scores = 1 / (1 + np.exp(-logits.astype(np.float64)))
    out = []
    for s in scores.reshape(-1, scores.shape[-1]):
        biased = (s + bias).reshape(groups, -1)
        group_score = np.sort(biased, axis=1)[:, -2:].sum(axis=1)
        kept = np.argsort(-group_score, kind="stable")[:top_groups]
        candidates = [e for g in kept for e in range(g * biased.shape[1], (g + 1) * biased.shape[1])]
        chosen = sorted(candidates, key=lambda e: -(s[e] + bias[e]))[:k]
        total = sum(s[e] for e in chosen)
        out.append({e: scale * s[e] / total for e in chosen})
    return out


def test_sigmoid_router_with_bias_and_groups_matches_deepseek_v3():
    cfg = ModelConfig(attention=dict(num_heads=4, num_kv_heads=4),
                      moe=dict(num_experts=16, experts_per_token=3, router="sigmoid", router_groups=4,
                               router_top_groups=1, router_scale=2.5))
    logits = np.asarray(jax.random.normal(jax.random.key(0), (2, 24, 16)), np.float32)
    bias = np.asarray(0.5 * jax.random.normal(jax.random.key(1), (16,)), np.float32)
    ids, weights, stats = route(cfg, jnp.asarray(logits), bias=jnp.asarray(bias))
    got = [dict(zip(i.tolist(), w.tolist(), strict=True)) for i, w in zip(np.asarray(ids).reshape(-1, 3),
                                                            np.asarray(weights).reshape(-1, 3), strict=True)]
    expected = _deepseek_choice(logits, bias, 4, 1, 3, 2.5)
    assert [set(g) for g in got] == [set(e) for e in expected]
    assert max(abs(g[e] - x[e]) for g, x in zip(got, expected, strict=True) for e in x) < 1e-6
    # the bias and the groups both decide: without either, other experts are chosen for many tokens
    for other in (_deepseek_choice(logits, 0 * bias, 4, 1, 3, 2.5), _deepseek_choice(logits, bias, 4, 4, 3, 2.5)):
        assert sum(set(a) != set(b) for a, b in zip(other, expected, strict=True)) > 20
    assert float(jnp.sum(stats["load"])) == pytest.approx(1.0)


@pytest.mark.parametrize("router", ["softmax", "sigmoid"])
def test_routing_keeps_each_device_to_its_own_tokens(router):
    """Top-k is per token: with the batch split over 8 devices the routing gathers nothing (XLA's own
    partitioning of TopK gathered every device's router scores onto every device), and it chooses as on one
    device."""
    groups = dict(router_groups=4, router_top_groups=2) if router == "sigmoid" else {}
    cfg = ModelConfig(attention=dict(num_heads=4, num_kv_heads=4),
                      moe=dict(num_experts=16, experts_per_token=2, router=router, **groups))
    logits = jax.random.normal(jax.random.key(0), (16, 8, 16), jnp.float32)
    bias = 0.3 * jax.random.normal(jax.random.key(1), (16,)) if router == "sigmoid" else None

    def ids_and_weights(logits):
        ids, weights, stats = route(cfg, logits, bias=bias)
        return ids, weights, stats["aux_loss"]

    want = jax.jit(ids_and_weights)(logits)
    mesh = _mesh(dict(data=2, fsdp=2, expert=2))
    with jax.set_mesh(mesh):
        sharded = jax.device_put(logits, jax.sharding.NamedSharding(
            mesh, sharding.logical_to_spec(("activation_batch", None, None))))
        step = jax.jit(ids_and_weights)
        hlo = step.lower(sharded).compile().as_text()
        got = step(sharded)
    assert "all-gather" not in hlo
    np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))
    np.testing.assert_allclose(np.asarray(got[1]), np.asarray(want[1]), rtol=1e-6)
    np.testing.assert_allclose(float(got[2]), float(want[2]), rtol=1e-6)


def _deepseek_max_loads(rate: float, steps: int) -> tuple[list[float], jax.Array]:
    def one_step_from_zero(setup, state, batch, new_state):
        bias = np.asarray(new_state.params["moe_layers"]["mlp"]["router_bias"].get_value())
        # +rate for the experts below the mean load, -rate for those above
        assert set(np.unique(np.abs(bias)).tolist()) <= {0.0, np.float32(rate)}
        assert rate == 0 or bias[:, 0].tolist() == [-np.float32(rate)] * 2  # the skewed start overloads 0

    loads, state = _skewed_run(steps, dict(moe=dict(MOE["moe"], router="sigmoid"), attention=dict(num_kv_heads=4)),
                               dict(router_aux_loss=0.0, router_bias_rate=rate), one_step_from_zero)
    return loads, state.params["moe_layers"]["mlp"]["router_bias"].get_value()


@pytest.mark.slow
def test_router_bias_moves_the_load_toward_balance_without_gradients():
    balanced, bias = _deepseek_max_loads(0.02, 20)
    skewed, untouched = _deepseek_max_loads(0.0, 20)
    assert balanced[0] == skewed[0] == 2.0  # expert 0 is one of every token's two choices
    assert np.mean(balanced[10:]) < 1.5 and np.mean(skewed[10:]) > 1.9
    # no gradient, weight decay or optimizer moment moves the bias: only the balancing rule does
    assert np.all(np.asarray(untouched) == 0) and np.asarray(bias)[:, 0].max() < -0.1


@pytest.mark.parametrize("mode, exchange", [pytest.param("dropless", "padded", marks=pytest.mark.extended),
                                            ("dropless", "ragged"),
                                            pytest.param("capacity", "auto", marks=pytest.mark.extended)])
def test_experts_run_in_chunks_equal_one_chunk(mode, exchange):
    """execution.moe_chunks only splits each device's tokens into runs through the experts, whose exchanges overlap
    the other chunks' GEMMs on a GPU: outputs and gradients equal one chunk's (dropless chunks of the flattened
    tokens, capacity chunks of whole rows, on a mesh that also splits the experts' width over tensor)."""
    want, got = _loss_and_grads_under([ExecutionConfig(moe_mode=mode, moe_exchange=exchange, moe_chunks=c)
                                       for c in (1, 2)], "fsdp2_expert2_tensor2", 6)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("node_shards, chunks, router", [  # 4 nodes in 2 chunks: the extended tier
    (2, 1, "softmax"), pytest.param(1, 2, "softmax", marks=pytest.mark.extended), (2, 1, "sigmoid")])
def test_rows_sent_once_per_node_equal_each_assignment_sent_to_its_expert(node_shards, chunks, router):
    """execution.moe_node_shards on data=2 x expert=4 (2 or 4 'nodes'): each token crosses once to every node
    holding one of its experts, that node's device hands it on and sends back one weighted sum; outputs and
    gradients (the router's too, whose weights now travel with the rows) equal the one-hop exchange's. The sigmoid
    router limits each token to one group, a node's experts (node-limited routing, as DeepSeek-V3's)."""
    cfg = _layer_cfg(moe=dict(num_experts=E, experts_per_token=K, router="sigmoid", router_groups=2,
                              router_top_groups=1)) if router == "sigmoid" else None
    want, got = _loss_and_grads_under([ExecutionConfig(moe_exchange="ragged"),
                                       ExecutionConfig(moe_node_shards=node_shards, moe_chunks=chunks)],
                                      "data2_expert4", 7, cfg)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        # float32 sums in another order: the router's gradient sums products of both signs (1e-7 of the largest)
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-6 * max(1.0, np.abs(w).max()))


@pytest.mark.slow
def test_the_hop_inside_a_node_runs_among_the_nodes_devices_alone():
    """Rows once per node on data=2 x expert=4 (2 'nodes' of 2 shards): the exchanges between nodes run over the
    expert axis (groups of 4 devices), the hop to the experts inside a node among the node's 2 devices, so that a
    GPU sends it over NVLink and the scheduler's costs price it so (metrics/schedule.link_bandwidth)."""
    from jaxtron.metrics.collectives import group_devices

    x = jax.random.normal(jax.random.key(1), (8, 16, 32))
    graphdef, state = _layer(_layer_cfg(), ExecutionConfig(moe_node_shards=2))
    hlo = _collectives(_mesh(dict(data=2, fsdp=1, expert=4)), graphdef, state, x)
    sizes = [len(group_devices(line)) for line in hlo.splitlines() if "all-to-all(" in line]
    assert 2 in sizes and 4 in sizes and set(sizes) == {2, 4}, sizes
    # in the node: rows out and home, both transposed, the peers' counts, and the emulation's offsets beside each
    assert sizes.count(2) >= 5, sizes


@pytest.mark.parametrize("router", ["softmax", "sigmoid"])
def test_a_token_crosses_once_to_each_node_that_holds_one_of_its_experts(router):
    """The rows between nodes (models/experts.node_rows), 8 experts on 2 nodes: one for each token and node among
    its experts' nodes, carrying that node's assignments alone. Softmax top-2 reaches one or both nodes; the
    sigmoid router with a group per node and one group a token (node-limited routing) reaches one: half the rows of
    one per assignment."""
    top_groups = dict(router="sigmoid", router_groups=2, router_top_groups=1) if router == "sigmoid" else {}
    cfg = _layer_cfg(moe=dict(num_experts=E, experts_per_token=K, **top_groups))
    logits = jax.random.normal(jax.random.key(8), (4, 16, E)) * 2
    bias = jnp.zeros((E,)) if router == "sigmoid" else None
    ids = np.asarray(route(cfg, logits, None, bias)[0]).reshape(-1, K)
    rows = node_rows(jnp.asarray(ids), E, 2)
    pairs = {(t, e // (E // 2)) for t in range(len(ids)) for e in ids[t]}
    used = int(np.sum(rows.counts))
    assert used == len(pairs) == (len(ids) if router == "sigmoid" else used) and used < ids.size
    assert {(int(t), int(q)) for t, q in zip(rows.token[:used], rows.node[:used], strict=True)} == pairs
    assert np.all(np.diff(np.asarray(rows.node[:used])) >= 0)  # node by node
    carried = np.asarray(rows.carries[:used])
    for p in range(used):  # a row carries its token's assignments to its node and no other
        t, q = int(rows.token[p]), int(rows.node[p])
        np.testing.assert_array_equal(carried[p], ids[t] // (E // 2) == q)
    if router == "softmax":
        assert len(ids) < used  # some tokens reach both nodes
