"""NVFP4 (``execution.fp8_recipe='nvfp4'``, ``ops/nvfp4.py``): the format, stochastic rounding, the Hadamard
transform, each GEMM's operands, and meshes. On the CPU the block-scaled GEMMs run emulated."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jaxtron.ops import nvfp4

RNG = np.random.default_rng(5)


def _gap(v: np.ndarray) -> np.ndarray:
    """The distance between E2M1's neighbours around ``|v|`` (0.5 below 2, 1 below 4, 2 up to 6)."""
    a = np.abs(v)
    return np.where(a < 2, 0.5, np.where(a < 4, 1.0, 2.0))


def _reference(x: np.ndarray, rows: int = 1) -> np.ndarray:
    """``x`` [R, K] through NVFP4 to the nearest value in float64 (this test's own statement of the format):
    tensor scale amax / (6 x 448), each rows x 16 block's scale its amax / 6 over that, rounded to e4m3, each
    element over both scales clipped to 6 and rounded to E2M1 (ml_dtypes)."""
    x = x.astype(np.float32)
    g = np.float32(np.abs(x).max() / (6 * 448.0))
    r, k = x.shape
    b = x.reshape(r // rows, rows, k // 16, 16)
    s = (np.abs(b).max(axis=(1, 3), keepdims=True) / np.float32(6.0) / g).astype(ml_dtypes.float8_e4m3fn)
    s = s.astype(np.float32)
    v = np.clip(b / np.where(s > 0, s * g, 1), -6, 6).astype(np.float32)
    return (v.astype(ml_dtypes.float4_e2m1fn).astype(np.float64) * s * g).reshape(r, k)


def test_nearest_rounding_is_the_formats_own():
    x = RNG.standard_normal((64, 128)) * np.exp2(RNG.integers(-3, 3, (64, 1)))
    x[7, :16] = 0.0
    for rows in (1, 16):  # activations' 1 x 16 blocks, weights' 16 x 16
        g = nvfp4.tensor_scale(jnp.asarray(x, jnp.float32))
        q, s = nvfp4.quantized(jnp.asarray(x, jnp.float32), g, rows=rows)
        assert q.dtype == jnp.float4_e2m1fn and s.shape == (64, 8)
        got = np.asarray(nvfp4.dequantized(q, s, g), np.float64)
        want = _reference(x, rows)
        off = ~np.isclose(got, want, rtol=1e-6, atol=0)  # a quotient within an ulp of a tie may round either way
        assert off.mean() < 2e-3, (rows, off.mean())


def test_stochastic_rounding_is_unbiased_and_lands_on_a_neighbour():
    v = jnp.asarray(RNG.uniform(-6, 6, 400_000), jnp.float32)
    r = np.asarray(nvfp4.round_e2m1(v, stochastic=True).astype(jnp.float32), np.float64)
    nearest = np.asarray(nvfp4.round_e2m1(v, stochastic=False).astype(jnp.float32), np.float64)
    v = np.asarray(v, np.float64)
    assert np.all(np.abs(r - v) <= _gap(v) + 1e-6)  # the value below or above
    assert np.all(np.abs(nearest - v) <= _gap(v) / 2 + 1e-6)
    error = r - v
    # each error's spread is at most half a gap of 2: the mean of 400k within 4 standard errors of zero
    assert abs(error.mean()) < 4 * error.std() / np.sqrt(v.size)
    assert abs((nearest - v).mean()) < 4 * error.std() / np.sqrt(v.size)
    assert np.mean(r != nearest) > 0.2  # it is not the nearest value


def test_the_hadamard_transform_leaves_a_product_over_the_tokens_alone():
    h = nvfp4.hadamard()
    np.testing.assert_allclose(h @ h.T, np.eye(16), atol=1e-6)
    a, b = (jnp.asarray(RNG.standard_normal((32, 64)), jnp.float32) for _ in range(2))
    ta, tb = nvfp4.transformed(a), nvfp4.transformed(b)
    np.testing.assert_allclose(np.asarray(ta @ tb.T), np.asarray(a @ b.T), rtol=1e-5, atol=1e-4)
    # an outlier spreads over its block of 16: its largest share is a quarter of it
    spike = jnp.zeros((1, 16)).at[0, 3].set(16.0)
    np.testing.assert_allclose(np.abs(np.asarray(nvfp4.transformed(spike))), 4.0, rtol=1e-6)


@pytest.mark.slow
def test_each_gemm_takes_its_blocks_and_rounding():
    """Forward: activations in 1 x 16 blocks, the weight in 16 x 16 ones; input gradient: the same weight blocks
    read transposed, the gradient rounded stochastically; weight gradient: both operands transformed along the
    tokens, the gradient rounded stochastically. Each the float64 product of those quantized operands, within the
    format's rounding of the exact product."""
    x = RNG.standard_normal((2, 32, 96)).astype(np.float32)  # 64 tokens, 96 input features
    w = (RNG.standard_normal((96, 2, 32)) * 0.1).astype(np.float32)  # 64 output features
    g = RNG.standard_normal((2, 32, 2, 32)).astype(np.float32)
    eq = "btd,dhk->bthk"
    y, pullback = jax.vjp(lambda a, b: nvfp4.scaled_einsum(eq, a, b), jnp.asarray(x), jnp.asarray(w))
    dx, dw = pullback(jnp.asarray(g))
    x2, w2, g2 = x.reshape(64, 96), w.reshape(96, 64), g.reshape(64, 64)

    def through(a, stochastic=False, rows=1):
        """(the operand through NVFP4 in float64, each element's error bound: a whole gap of E2M1 around its
        scaled value, which covers nearest and stochastic rounding and a clip of up to 6 x 2^-4, times its
        scales)."""
        a = jnp.asarray(a, jnp.float32)
        scale = nvfp4.tensor_scale(a)
        q, s = nvfp4.quantized(a, scale, stochastic, rows)
        unit = np.repeat(np.asarray(s * scale, np.float64), 16, axis=1)
        v = np.asarray(a, np.float64) / np.where(unit > 0, unit, 1.0)
        return np.asarray(nvfp4.dequantized(q, s, scale), np.float64), _gap(v) * unit

    wq, we = through(w2, rows=16)
    xt, gt = np.asarray(nvfp4.transformed(jnp.asarray(x2.T))), np.asarray(nvfp4.transformed(jnp.asarray(g2.T)))
    cases = (("forward", y, through(x2), (wq.T, we.T), x2 @ w2.astype(np.float64)),
             ("input gradient", dx, through(g2, True), (wq, we), g2 @ w2.T.astype(np.float64)),
             ("weight gradient", dw, through(xt), through(gt, True), x2.T @ g2.astype(np.float64)))
    for name, got, (a, ea), (b, eb), exact in cases:
        got = np.asarray(got, np.float64).reshape(exact.shape)
        np.testing.assert_allclose(got, a @ b.T, rtol=1e-5, atol=1e-5 * np.abs(exact).max(), err_msg=name)
        bound = ea @ np.abs(b.T) + np.abs(a) @ eb.T + ea @ eb.T + 1e-4 * np.abs(exact).max()
        assert np.all(np.abs(got - exact) <= bound), name
        assert np.abs(got - exact).max() > 1e-2 * np.abs(exact).max(), name  # it quantized


@pytest.mark.slow
@pytest.mark.extended
def test_nvfp4_steps_on_fsdp_sequence_and_tensor_equal_one_devices(tmp_path):
    """16-element blocks within each device's share (16 of the key heads' features on tensor=2, 4 chunks of 16
    tokens on sequence=2), and stochastic rounding hashes each value's leading bits, not its place: the first step
    as on one device but for float32's sums. The forward rounds to the nearest value: the loss to 1e-5. A gradient
    summed in another order crosses a hashed bit now and then and draws again, a 4-bit step each time: the
    gradient norm to 5e-3 (2e-3 seen)."""
    from helpers import MESHES, tiny_config

    from jaxtron.training.loop import run

    def config(mesh):
        return tiny_config(mesh, model=dict(max_seq_len=64), data=dict(seq_len=64),
                           execution=dict(fp8=True, fp8_recipe="nvfp4"))

    runs = {name: run(config(mesh), str(tmp_path / name), use_tqdm=False, devices=devices)
            for name, mesh, devices in (("one", dict(fsdp=1), jax.devices()[:1]),
                                        ("mesh", MESHES["fsdp2_sequence2_tensor2"], None))}
    losses = {k: np.array([h["loss"] for h in v.history]) for k, v in runs.items()}
    assert len(losses["one"]) == 3 and np.all(np.diff(losses["one"]) != 0)
    np.testing.assert_allclose(losses["mesh"][0], losses["one"][0], rtol=1e-5)
    np.testing.assert_allclose(runs["mesh"].history[0]["grad_norm"], runs["one"].history[0]["grad_norm"], rtol=5e-3)
    np.testing.assert_allclose(losses["mesh"], losses["one"], rtol=1e-2)
