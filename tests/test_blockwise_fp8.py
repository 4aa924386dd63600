"""Blockwise FP8 (``execution.fp8_recipe='blockwise'``, ``ops/blockwise_fp8.py``): tiles and blocks, each GEMM's
operands, the Pallas kernel against the emulation, and meshes."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jaxtron.ops import blockwise_fp8

RNG = np.random.default_rng(11)


def _e4m3(v: np.ndarray) -> np.ndarray:
    return v.astype(np.float32).astype(ml_dtypes.float8_e4m3fn).astype(np.float64)


def _tiles_reference(a: np.ndarray) -> np.ndarray:
    """``a`` [R, K] through 1 x 128 tiles in float64 (this test's own statement of DeepSeek-V3's recipe): each
    row's 128 consecutive elements scaled by their absolute maximum over 448, rounded to e4m3, scaled back."""
    t = a.astype(np.float64).reshape(a.shape[0], -1, 128)
    scale = np.abs(t).max(-1, keepdims=True) / 448.0
    scale = np.where(scale > 0, scale.astype(np.float32), 1.0)  # the kernel's scales are float32
    return (_e4m3(t / scale) * scale).reshape(a.shape)


def _blocks_reference(w: np.ndarray) -> np.ndarray:
    """``w`` [R, C] through 128 x 128 blocks, likewise."""
    r, c = w.shape
    b = w.astype(np.float64).reshape(r // 128, 128, c // 128, 128)
    scale = np.abs(b).max(axis=(1, 3), keepdims=True) / 448.0
    scale = np.where(scale > 0, scale.astype(np.float32), 1.0)
    return (_e4m3(b / scale) * scale).reshape(r, c)


def _tile_bound(a: np.ndarray) -> np.ndarray:
    """Each element's largest rounding error in its 1 x 128 tile: half an e4m3 step, 2^-4 of it where it is normal,
    else half the subnormal step 2^-9 of its tile's scale amax / 448."""
    t = np.abs(a.astype(np.float64)).reshape(a.shape[0], -1, 128)
    return np.maximum(2.0 ** -4 * t, 2.0 ** -10 * t.max(-1, keepdims=True) / 448.0).reshape(a.shape)


def _block_bound(w: np.ndarray) -> np.ndarray:
    """The same in 128 x 128 blocks."""
    r, c = w.shape
    b = np.abs(w.astype(np.float64)).reshape(r // 128, 128, c // 128, 128)
    return np.maximum(2.0 ** -4 * b, 2.0 ** -10 * b.max(axis=(1, 3), keepdims=True) / 448.0).reshape(r, c)


def _assert_same_grid(got: np.ndarray, want: np.ndarray) -> None:
    """Equal but where a quotient lay within an ulp of a tie between two e4m3 values: XLA may divide by
    multiplying by the reciprocal, which rounds such a quotient the other way (one element in 10^4 or so)."""
    off = ~np.isclose(got, want, rtol=1e-6, atol=0)
    assert off.mean() < 1e-3, off.mean()
    assert np.all(np.abs(got - want)[off] <= 2.0 ** -3 * np.abs(want)[off] * 1.0001)  # one e4m3 step


def test_tiles_and_blocks_are_the_recipes():
    x = RNG.standard_normal((256, 384)) * np.exp2(RNG.integers(-12, 12, (256, 1)))
    x[5, :128] = 0.0
    q, scale = blockwise_fp8.tiles(jnp.asarray(x, jnp.float32))
    assert q.dtype == jnp.float8_e4m3fn and scale.shape == (256, 3)
    _assert_same_grid(np.asarray(blockwise_fp8.dequantized(q, scale), np.float64), _tiles_reference(x))
    qw, block_scales = blockwise_fp8.blocks(jnp.asarray(x, jnp.float32))
    assert block_scales.shape == (2, 3)
    got = blockwise_fp8.dequantized(qw, blockwise_fp8.row_scales(block_scales))
    _assert_same_grid(np.asarray(got, np.float64), _blocks_reference(x))


def test_each_gemm_takes_its_tiles_and_the_weights_blocks():
    """Forward and input gradient read the weight's one set of 128 x 128 blocks (as stored, and transposed); the
    weight gradient takes both operands in tiles along the tokens; each within its operands' rounding bounds of
    the exact product (sum of |error a| |b| + |a| |error b| + the errors' product)."""
    x = RNG.standard_normal((2, 128, 256)).astype(np.float32)  # 256 tokens, 256 input features
    w = (RNG.standard_normal((256, 2, 64)) * 0.05).astype(np.float32)  # 128 output features
    g = RNG.standard_normal((2, 128, 2, 64)).astype(np.float32)
    eq = "btd,dhk->bthk"
    y, pullback = jax.vjp(lambda a, b: blockwise_fp8.scaled_einsum(eq, a, b), jnp.asarray(x), jnp.asarray(w))
    dx, dw = pullback(jnp.asarray(g))
    x2, w2, g2 = x.reshape(256, 256), w.reshape(256, 128), g.reshape(256, 128)

    def tiled(a):  # the operand through its tiles along its last axis (the quantizer checked above), float64
        return np.asarray(blockwise_fp8.dequantized(*blockwise_fp8.tiles(jnp.asarray(a))), np.float64)

    qw, block_scales = blockwise_fp8.blocks(jnp.asarray(w2))
    wq = np.asarray(blockwise_fp8.dequantized(qw, blockwise_fp8.row_scales(block_scales)), np.float64)
    a_of = {"forward": x2, "input gradient": g2, "weight gradient": x2.T}
    b_of = {"forward": w2.T, "input gradient": w2, "weight gradient": g2.T}
    bounds = {"forward": (_tile_bound(x2), _block_bound(w2).T), "input gradient": (_tile_bound(g2), _block_bound(w2)),
              "weight gradient": (_tile_bound(x2.T), _tile_bound(g2.T))}
    cases = (("forward", y, tiled(x2) @ wq, x2 @ w2.astype(np.float64)),
             ("input gradient", dx, tiled(g2) @ wq.T, g2 @ w2.T.astype(np.float64)),
             ("weight gradient", dw, tiled(x2.T) @ tiled(g2.T).T, x2.T @ g2.astype(np.float64)))
    for name, got, recipe, exact in cases:
        got = np.asarray(got, np.float64).reshape(recipe.shape)
        np.testing.assert_allclose(got, recipe, rtol=1e-5, atol=1e-5 * np.abs(recipe).max(), err_msg=name)
        ea, eb = bounds[name]
        bound = ea @ np.abs(b_of[name].T) + np.abs(a_of[name]) @ eb.T + ea @ eb.T + 1e-5 * np.abs(exact).max()
        assert np.all(np.abs(got - exact) <= bound), name
        assert np.abs(got - exact).max() > 1e-3 * np.abs(exact).max(), name  # it quantized


def test_the_kernel_computes_the_emulations_numbers():
    """The Pallas kernel, in Pallas' interpreter (its FP8 dots on the CPU), against the dequantized product: each
    128 x 128 tile's sum of 128-element steps, scaled per step."""
    a = (RNG.standard_normal((256, 384)) * np.exp2(RNG.integers(-4, 4, (256, 3)).repeat(128, 1))).astype(np.float32)
    b = RNG.standard_normal((128, 384)).astype(np.float32)
    qa, sa = blockwise_fp8.tiles(jnp.asarray(a))
    qb, sb = blockwise_fp8.tiles(jnp.asarray(b))
    operands = [v[None] for v in (qa, sa, qb, sb)]  # a batch of one GEMM
    want = blockwise_fp8.emulated_gemm(*operands, jnp.float32)
    got = blockwise_fp8.kernel_gemm(*operands, jnp.float32, interpret=True)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5 * float(jnp.abs(want).max()))


def test_a_split_gemm_quantizes_what_one_device_does():
    """The GEMM split as XLA splits a matmul: rows over one axis and columns over another, or the contracted
    dimension over 4 devices (whole tiles each, summed after the kernel): one device's numbers, to the order of
    float32 sums."""
    from jax.sharding import AxisType, NamedSharding, PartitionSpec

    mesh = jax.make_mesh((2, 4), ("rows", "cols"), axis_types=(AxisType.Auto,) * 2)  # as jaxtron's meshes are
    a = jnp.asarray(RNG.standard_normal((256, 512)), jnp.float32)
    b = jnp.asarray(RNG.standard_normal((512, 512)), jnp.float32)  # 128 columns a device over "cols"
    one = jax.jit(lambda a, b: blockwise_fp8.gemm(a, b, jnp.float32))(a, b)
    for a_spec, b_spec in ((("rows", None), ("cols", None)), ((None, "cols"), (None, "cols")),
                           (("rows", "cols"), (None, "cols"))):
        put = [jax.device_put(v, NamedSharding(mesh, PartitionSpec(*spec))) for v, spec in ((a, a_spec), (b, b_spec))]
        split = jax.jit(lambda a, b: blockwise_fp8.gemm(a, b, jnp.float32))(*put)
        np.testing.assert_allclose(np.asarray(split), np.asarray(one), rtol=1e-6, atol=1e-6 * float(jnp.abs(one).max()),
                                   err_msg=str((a_spec, b_spec)))


def test_the_budget_finds_the_kernel_by_its_name():
    from jaxtron.metrics import hlo

    assert blockwise_fp8.KERNEL_NAME == hlo.BLOCKWISE_FP8_KERNEL


@pytest.mark.slow
@pytest.mark.extended
def test_blockwise_steps_on_fsdp_sequence_and_tensor_equal_one_devices(tmp_path):
    """Each device's share of every contracted dimension is whole tiles (128 of the heads' and the MLP's features
    on tensor=2, 4 chunks of 128 tokens on sequence=2): the same first step as one device, but for float32's sums.

    One layer: a sum in another order moves a value across an e4m3 step now and then. Through a second layer's
    quantization such a step spreads over the whole row, and the gradient norm moved 5e-4 (2 layers, sequence=2),
    as far as leaving FP8 out moves it. With one layer the loss agreed exactly and the norm to 2e-6, against 5e-5
    and 8e-4 for float32 GEMMs instead. Adam's normalized update carries the difference into the next losses (2e-4
    at step 3). ``test_a_split_gemm_quantizes_what_one_device_does`` checks the GEMMs alone, to 1e-6."""
    from helpers import MESHES, tiny_config

    from jaxtron.training.loop import run

    def config(mesh):
        return tiny_config(mesh, model=dict(num_layers=1, embed_dim=256, mlp_dim=512, max_seq_len=512,
                                            attention=dict(num_heads=4, num_kv_heads=4)),
                           data=dict(seq_len=512), execution=dict(fp8=True, fp8_recipe="blockwise"))

    runs = {name: run(config(mesh), str(tmp_path / name), use_tqdm=False, devices=devices)
            for name, mesh, devices in (("one", dict(fsdp=1), jax.devices()[:1]),
                                        ("mesh", MESHES["fsdp2_sequence2_tensor2"], None))}
    losses = {k: np.array([h["loss"] for h in v.history]) for k, v in runs.items()}
    norms = {k: v.history[0]["grad_norm"] for k, v in runs.items()}
    assert len(losses["one"]) == 3 and np.all(np.diff(losses["one"]) != 0)
    np.testing.assert_allclose(losses["mesh"][0], losses["one"][0], rtol=1e-6)
    np.testing.assert_allclose(norms["mesh"], norms["one"], rtol=2e-5)
    np.testing.assert_allclose(losses["mesh"], losses["one"], rtol=1e-3)


def test_a_vmap_of_the_gemm_batches_the_kernel():
    """A pipeline's stages are a vmap: it (and a vmap inside it) becomes the kernel's batch of GEMMs, each one's
    numbers those of the GEMM alone."""
    x = jnp.asarray(RNG.standard_normal((2, 2, 128, 256)), jnp.float32)
    w = jnp.asarray(RNG.standard_normal((2, 2, 256, 128)), jnp.float32)
    one = jax.jit(lambda a, b: blockwise_fp8.scaled_einsum("md,df->mf", a, b))
    both = jax.jit(jax.vmap(jax.vmap(lambda a, b: blockwise_fp8.scaled_einsum("md,df->mf", a, b))))(x, w)
    for i in range(2):
        for j in range(2):
            np.testing.assert_array_equal(np.asarray(both[i, j]), np.asarray(one(x[i, j], w[i, j])))


def test_capacity_modes_experts_batch_the_kernel():
    """Capacity mode's batched expert GEMM (``ops/expert_recipes.py``): 100 slots padded to a tile, each expert's
    numbers those of its GEMM alone."""
    from jaxtron.ops.expert_recipes import expert_einsum
    x = jnp.asarray(RNG.standard_normal((2, 100, 128)), jnp.float32)
    w = jnp.asarray(RNG.standard_normal((2, 128, 256)), jnp.float32)
    got = jax.jit(lambda a, b: expert_einsum("blockwise", "emd,edf->emf", a, b))(x, w)
    single = jax.jit(lambda a, b: blockwise_fp8.scaled_einsum("md,df->mf", a, b))
    for e in range(2):
        want = single(jnp.pad(x[e], ((0, 28), (0, 0))), w[e])[:100]
        np.testing.assert_allclose(np.asarray(got[e]), np.asarray(want), rtol=1e-6, atol=1e-6)


@pytest.mark.slow
def test_the_grouped_gemm_quantizes_each_expert_as_its_own_gemm():
    """Dropless experts (``ops/grouped_blockwise.py``): each expert's rows, forward and both gradients, give the
    numbers of the blockwise GEMM of that expert alone, its weight gradient's token tiles counted from its first
    row (an expert's rows padded with zeros to whole tiles: zeros change no tile's maximum). The Pallas kernels,
    in Pallas' interpreter, give the reference's."""
    from jaxtron.ops import grouped_blockwise
    sizes = (100, 0, 150)  # an empty expert; short last tiles; 50 rows past the groups
    group_sizes = jnp.asarray(sizes, jnp.int32)
    x = jnp.asarray(RNG.standard_normal((300, 256)), jnp.float32)
    w = jnp.asarray(RNG.standard_normal((3, 256, 128)) * 0.1, jnp.float32)
    dy = jnp.asarray(RNG.standard_normal((300, 128)), jnp.float32)

    def grads(implementation, interpret):
        y, pullback = jax.vjp(lambda a, b: grouped_blockwise.matmul(a, b, group_sizes, implementation, interpret),
                              x, w)
        return (y, *pullback(dy))

    reference, kernels = grads("xla", False), grads("pallas", True)
    for name, a, b in zip(("forward", "input gradient", "weight gradient"), reference, kernels, strict=True):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-5, atol=1e-5 * float(jnp.abs(a).max()),
                                   err_msg=name)
    y, dx, dw = reference
    start = 0
    for g, size in enumerate(sizes):
        if not size:  # the empty expert: no rows, a zero weight gradient (checked below)
            continue
        rows = slice(start, start + size)
        pad = ((0, -size % 128), (0, 0))
        xg, gg = jnp.pad(x[rows], pad), jnp.pad(dy[rows], pad)
        alone = (blockwise_fp8.gemm(xg, w[g].T, jnp.float32, weight="columns")[:size],
                 blockwise_fp8.gemm(gg, w[g], jnp.float32, weight="rows")[:size],
                 blockwise_fp8.gemm(xg.T, gg.T, jnp.float32))
        for name, got, want in (("forward", y[rows], alone[0]), ("input gradient", dx[rows], alone[1]),
                                ("weight gradient", dw[g], alone[2])):
            np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5,
                                       atol=1e-5 * float(jnp.abs(want).max() + 1e-30), err_msg=f"{name} {g}")
        start += size
    assert float(jnp.abs(y[250:]).max()) == 0.0 and float(jnp.abs(dw[1]).max()) == 0.0


@pytest.mark.slow
@pytest.mark.extended
def test_blockwise_dropless_experts_on_fsdp_and_expert_axes_equal_one_devices(tmp_path):
    """A MoE model's dropless experts in blockwise FP8 on fsdp=4 x expert=2 (each device its experts' rows, after the
    exchange in the order one device holds them): the first step's loss as on one device to 1e-4 (1.5e-5 seen: the
    router's and the exchange's sums in another order move a value across an e4m3 step now and then)."""
    from helpers import MESHES, tiny_config

    from jaxtron.training.loop import run

    def config(mesh):
        return tiny_config(mesh, model=dict(embed_dim=256, mlp_dim=256, max_seq_len=128,
                                            attention=dict(num_heads=4, num_kv_heads=4), moe=dict(num_experts=4)),
                           data=dict(seq_len=128), execution=dict(fp8=True, fp8_recipe="blockwise"))

    runs = {name: run(config(mesh), str(tmp_path / name), use_tqdm=False, devices=devices)
            for name, mesh, devices in (("one", dict(fsdp=1), jax.devices()[:1]),
                                        ("mesh", MESHES["fsdp4_expert2"], None))}
    losses = {k: np.array([h["loss"] for h in v.history]) for k, v in runs.items()}
    assert np.all(np.isfinite(losses["one"])) and np.all(np.diff(losses["one"]) != 0)
    np.testing.assert_allclose(losses["mesh"][0], losses["one"][0], rtol=1e-4)
    np.testing.assert_allclose(losses["mesh"], losses["one"], rtol=1e-2)


@pytest.mark.slow
@pytest.mark.extended
def test_blockwise_steps_on_a_1f1b_pipeline_equal_one_devices(tmp_path):
    """pipeline=2 x fsdp=4 under the 1F1B schedule (its stages a vmap: the kernel's batch of GEMMs): the first
    step as on one device but for float32's sums (the loss to 1e-5)."""
    from helpers import tiny_config

    from jaxtron.training.loop import run

    def config(mesh, pipeline):
        return tiny_config(mesh, model=dict(embed_dim=256, mlp_dim=512, max_seq_len=128, num_layers=4,
                                            attention=dict(num_heads=4, num_kv_heads=4)),
                           data=dict(seq_len=128), execution=dict(fp8=True, fp8_recipe="blockwise"),
                           pipeline=pipeline)

    runs = {name: run(config(mesh, pipeline), str(tmp_path / name), use_tqdm=False, devices=devices)
            for name, mesh, pipeline, devices in (
                ("one", dict(fsdp=1), {}, jax.devices()[:1]),
                ("pipeline", dict(pipeline=2, fsdp=4), dict(schedule="1f1b", microbatches=2), None))}
    losses = {k: np.array([h["loss"] for h in v.history]) for k, v in runs.items()}
    np.testing.assert_allclose(losses["pipeline"][0], losses["one"][0], rtol=1e-5)
    np.testing.assert_allclose(losses["pipeline"], losses["one"], rtol=1e-2)
