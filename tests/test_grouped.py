"""The expert GEMM (jaxtron/ops/grouped.py): tokamax's grouped GEMM against jax.lax.ragged_dot, the choice 'auto'
makes, bad values, and on a GPU the kernel a run takes: grouped, and within bf16 rounding of float32. The FP8
expert GEMM (jaxtron/ops/grouped_fp8.py): its Pallas kernels, in Pallas' interpreter, against the dequantized
reference, and its per-expert scales."""

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxtron.config.schema import ConfigError, ExecutionConfig
from jaxtron.ops import fp8, grouped, grouped_fp8

needs_tokamax = pytest.mark.skipif(not grouped.tokamax_installed(),
                                   reason=f"tokamax is not installed ({grouped.INSTALL})")
RNG = np.random.default_rng(3)  # draws that need not be the same every run


def _case(groups: int, rows: int, k: int, n: int, dtype=jnp.float32, spare: int = 0):
    """Random operands and group sizes with empty groups, summing to ``rows - spare`` (rows past the groups)."""
    rng = np.random.default_rng([groups, rows, k, n, spare])  # the same case whatever ran before
    weights = rng.gamma(1.0, size=groups)
    weights[rng.random(groups) < 0.3] = 0.0
    weights[0], weights[-1] = max(weights[0], 0.5), 0.0
    sizes = rng.multinomial(rows - spare, weights / weights.sum()).astype(np.int32)
    x, w, ct = (jnp.asarray(rng.normal(size=shape), dtype) for shape in ((rows, k), (groups, k, n), (rows, n)))
    return x, w, jnp.asarray(sizes), ct


def _with_gradients(implementation, x, w, sizes, ct):
    y, pullback = jax.vjp(lambda x, w: grouped.matmul(x, w, sizes, implementation), x, w)
    return (y, *pullback(ct))


@needs_tokamax
@pytest.mark.parametrize("groups,rows,k,n,spare", [(8, 96, 16, 24, 0), (5, 64, 8, 12, 9), (16, 40, 4, 8, 3)])
def test_the_tokamax_gemm_equals_ragged_dot_with_both_gradients(groups, rows, k, n, spare):
    """Off a GPU tokamax runs its XLA implementation through jaxtron's own VJP (the weight gradient by jaxtron's
    Pallas kernel, interpreted, summing in another order: 1e-5): the output, the input gradient and the weight
    gradient equal jax.lax.ragged_dot's in float32, empty groups and rows past the groups included (zeros there)."""
    x, w, sizes, ct = _case(groups, rows, k, n, spare=spare)
    want = jax.jit(lambda *a: _with_gradients("xla", *a))(x, w, sizes, ct)
    got = jax.jit(lambda *a: _with_gradients("tokamax", *a))(x, w, sizes, ct)
    for name, g, v in zip(("output", "input gradient", "weight gradient"), got, want, strict=True):
        assert g.shape == v.shape and g.dtype == v.dtype, name
        tolerance = 1e-5 if name == "weight gradient" else 1e-6
        np.testing.assert_allclose(np.asarray(g), np.asarray(v), rtol=tolerance, atol=tolerance, err_msg=name)
    if spare:
        assert not np.asarray(got[0])[rows - spare:].any() and not np.asarray(got[1])[rows - spare:].any()
    # a group with no rows has a zero weight gradient
    empty = np.flatnonzero(np.asarray(sizes) == 0)
    assert not np.asarray(got[2])[empty].any()


@pytest.mark.parametrize("groups,rows,k,n,spare", [(5, 70, 40, 24, 8), (6, 300, 16, 136, 21)])
def test_the_fp8_kernels_equal_the_dequantized_reference_with_both_gradients(groups, rows, k, n, spare):
    """The Pallas kernels (interpreted on the CPU) against 16-bit GEMMs on the dequantized FP8 operands: output,
    input gradient and weight gradient to float32 rounding. Empty groups, rows past the groups, a 300-row case of
    three row tiles where groups cross tile boundaries, and sizes that are not tile multiples."""
    x, w, sizes, ct = _case(groups, rows, k, n, spare=spare)

    def both(kernel, interpret):
        y, pullback = jax.vjp(lambda a, b: grouped_fp8.matmul(a, b, sizes, kernel, interpret), x, w)
        return (y, *pullback(ct))
    got = jax.jit(lambda: both("pallas", True))()
    want = jax.jit(lambda: both("xla", False))()
    for name, g, v in zip(("output", "input gradient", "weight gradient"), got, want, strict=True):
        assert g.shape == v.shape and g.dtype == v.dtype, name
        np.testing.assert_allclose(np.asarray(g), np.asarray(v), rtol=2e-5, atol=2e-5 * float(jnp.max(jnp.abs(v))),
                                   err_msg=name)
    assert not np.asarray(got[0])[rows - spare:].any() and not np.asarray(got[1])[rows - spare:].any()
    assert not np.asarray(got[2])[np.flatnonzero(np.asarray(sizes) == 0)].any()


@pytest.mark.parametrize("shape,dtype", [((3, 128, 192), jnp.bfloat16), ((2, 100, 70), jnp.float32),
                                         ((1, 16, 300), jnp.float8_e4m3fn)])
def test_the_transpose_kernel_gives_each_groups_matrix_transposed(shape, dtype):
    """``grouped_kernels.transposed`` in Pallas' interpreter: whole tiles, and sizes it pads to its tiles."""
    from jaxtron.ops import grouped_kernels

    w = jnp.asarray(RNG.normal(size=shape), jnp.float32).astype(dtype)
    got = grouped_kernels.transposed(w, interpret=True)
    assert got.shape == (shape[0], shape[2], shape[1]) and got.dtype == w.dtype
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(jnp.swapaxes(w, 1, 2), np.float32))


def test_fp8_expert_weights_take_one_scale_per_expert():
    """An expert whose weights are 1e5 times the others' does not take their precision: each group's output is within
    FP8 rounding of float32 (a few percent) and visibly rounded; with one scale for all experts, the small experts'
    weights would fall to e4m3's subnormals and zero."""
    x = jnp.asarray(RNG.normal(size=(64, 32)), jnp.float32)
    w = jnp.asarray(RNG.normal(size=(4, 32, 16)) * np.array([1e5, 1, 1, 1])[:, None, None], jnp.float32)
    sizes = jnp.array([16, 20, 12, 16], jnp.int32)
    got = np.asarray(grouped_fp8.matmul(x, w, sizes, "xla"), np.float64)
    exact = np.asarray(jax.lax.ragged_dot(x, w, sizes), np.float64)
    shared = fp8.quantize_dequantize(w, fp8.E4M3)  # one scale for every expert
    crushed = np.asarray(jax.lax.ragged_dot(fp8.quantize_dequantize(x, fp8.E4M3), shared, sizes), np.float64)
    ends = np.cumsum(np.asarray(sizes))
    for g, (lo, hi) in enumerate(zip(ends - np.asarray(sizes), ends, strict=True)):
        if lo == hi:
            continue
        error = np.linalg.norm(got[lo:hi] - exact[lo:hi]) / np.linalg.norm(exact[lo:hi])
        assert 1e-3 < error < 0.06, (g, error)
        if g:
            assert np.linalg.norm(crushed[lo:hi] - exact[lo:hi]) / np.linalg.norm(exact[lo:hi]) > 0.2, g


def test_fp8_expert_gemms_take_jaxtrons_kernels_on_hopper_unless_xla_is_asked(monkeypatch):
    monkeypatch.setattr(grouped, "tokamax_installed", lambda: False)
    hopper = types.SimpleNamespace(platform="gpu", compute_capability="9.0")
    ampere = types.SimpleNamespace(platform="gpu", compute_capability="8.0")
    with grouped.on_target(hopper):
        assert grouped.resolve("auto", fp8=True) == "pallas" and grouped.resolve("xla", fp8=True) == "xla"
        assert grouped.resolve("auto") == "xla"  # tokamax is not installed: the 16-bit GEMM is XLA's
    with grouped.on_target(ampere):
        assert grouped.resolve("auto", fp8=True) == "xla"
    assert grouped.resolve("auto", fp8=True) == "xla"


def test_auto_takes_tokamax_only_for_a_hopper_gpu(monkeypatch):
    monkeypatch.setattr(grouped, "tokamax_installed", lambda: True)
    assert grouped.resolve("auto") == "xla"  # these tests run on the CPU
    hopper = types.SimpleNamespace(platform="gpu", compute_capability="9.0")
    ampere = types.SimpleNamespace(platform="gpu", compute_capability="8.0")
    with grouped.on_target(hopper):
        assert grouped.resolve("auto") == "tokamax"
        from jax.extend import backend
        assert backend.get_default_device() is hopper  # tokamax picks its kernel for this device
    with grouped.on_target(ampere):
        assert grouped.resolve("auto") == "xla"
    assert grouped.resolve("auto") == "xla" and grouped.resolve("xla") == "xla"
    monkeypatch.setattr(grouped, "tokamax_installed", lambda: False)
    with grouped.on_target(hopper):
        assert grouped.resolve("auto") == "xla"


def test_bad_expert_gemm_values_are_one_sentence(monkeypatch):
    with pytest.raises(ConfigError, match=r"execution.expert_gemm.*'cublas'"):
        ExecutionConfig(expert_gemm="cublas")
    with pytest.raises(ConfigError, match=r"execution.moe_exchange.*'nccl'"):
        ExecutionConfig(moe_exchange="nccl")
    with pytest.raises(ConfigError, match=r"execution.moe_receive_factor.*>= 0"):
        ExecutionConfig(moe_receive_factor=-1.0)
    with pytest.raises(ConfigError, match=r"moe_receive_factor' \(1.5\) sizes the ragged exchange's receive buffers"
                                          r".*set execution.moe_exchange to 'auto' or 'ragged'"):
        ExecutionConfig(moe_exchange="padded", moe_receive_factor=1.5)
    monkeypatch.setattr(grouped, "tokamax_installed", lambda: False)
    monkeypatch.setattr(grouped, "_tokamax_problem", lambda: "it is not installed")
    with pytest.raises(ConfigError) as info:
        grouped.resolve("tokamax")
    message = str(info.value)
    assert message == ("config field 'execution.expert_gemm' is 'tokamax' but it is not installed; install it "
                       f"with {grouped.INSTALL} or use 'auto' or 'xla'."), message


on_gpu = pytest.mark.skipif(jax.default_backend() != "gpu", reason="the GPU's expert GEMM is a GPU question")


@pytest.mark.gpu
@on_gpu
@pytest.mark.parametrize("part", ["forward", "input gradient", "weight gradient"])
def test_the_expert_gemm_a_gpu_run_takes_stays_grouped(part):
    """What dropless experts run on a GPU ('auto'): no array in the compiled program much larger than its
    operands. Expanded densely (every row against every expert, as XLA does with jax.lax.ragged_dot), the
    program holds [groups, rows, ...] arrays and computes ``groups`` times the FLOPs."""
    from helpers import largest_float_array

    groups, rows, k, n = 8, 8192, 256, 512
    x, w, dy = (jax.random.normal(key, shape, jnp.bfloat16) for key, shape in
                zip(jax.random.split(jax.random.key(0), 3), ((rows, k), (groups, k, n), (rows, n)), strict=True))
    sizes = jnp.full((groups,), rows // groups, jnp.int32)
    fn = {"forward": lambda x, w: grouped.matmul(x, w, sizes, "auto"),
          "input gradient": lambda x, w: jax.vjp(lambda a: grouped.matmul(a, w, sizes, "auto"), x)[1](dy)[0],
          "weight gradient": lambda x, w: jax.vjp(lambda b: grouped.matmul(x, b, sizes, "auto"), w)[1](dy)[0]}[part]
    hlo = jax.jit(fn).lower(x, w).compile().as_text()
    operands = max(rows * k, groups * k * n, rows * n)
    assert largest_float_array(hlo) < 2 * operands, f"the {part} of the expert GEMM is expanded densely"


@pytest.mark.gpu
@on_gpu
def test_the_gpu_expert_gemm_is_within_bf16_rounding_of_float32():
    """bf16 operands, random group sizes with empty groups: each of the three products against float32 group by
    group, by relative Frobenius norm (bf16 rounding of the result is about 2e-3)."""
    x, w, sizes, ct = _case(16, 4096, 512, 256, jnp.bfloat16, spare=100)
    got = jax.jit(lambda *a: _with_gradients("auto", *a))(x, w, sizes, ct)
    with jax.default_matmul_precision("float32"):  # not TF32
        want = jax.jit(lambda *a: _with_gradients("xla", *a))(*(a.astype(jnp.float32) for a in (x, w)), sizes,
                                                             ct.astype(jnp.float32))
    for name, g, v in zip(("output", "input gradient", "weight gradient"), got, want, strict=True):
        g, v = np.asarray(g, np.float64), np.asarray(v, np.float64)
        assert np.linalg.norm(g - v) / np.linalg.norm(v) < 5e-3, name


@pytest.mark.gpu
@on_gpu
def test_the_gpu_fp8_expert_gemm_equals_the_dequantized_reference():
    """On a Hopper GPU 'auto' with FP8 runs jaxtron's Pallas kernels: each of the three products equals 16-bit
    GEMMs on the same dequantized FP8 operands, group by group, to the bf16 rounding of the results."""
    x, w, sizes, ct = _case(16, 4096, 512, 256, jnp.bfloat16, spare=100)
    assert grouped.resolve("auto", fp8=True) == "pallas", "not a Hopper GPU"

    def both(kernel):
        y, pullback = jax.vjp(lambda a, b: grouped_fp8.matmul(a, b, sizes, kernel), x, w)
        return (y, *pullback(ct))
    got, want = jax.jit(lambda: both("pallas"))(), jax.jit(lambda: both("xla"))()
    for name, g, v in zip(("output", "input gradient", "weight gradient"), got, want, strict=True):
        g, v = np.asarray(g, np.float64), np.asarray(v, np.float64)
        assert np.linalg.norm(g - v) / np.linalg.norm(v) < 1e-2, name


def test_the_triton_lowering_fence_matches_the_installed_jax():
    """ops/triton_lowering.py patches Pallas' private Triton dialect only where its ``dot`` takes
    ``max_num_imprecise_acc``: on the jax this project pins, it does (else the FP8 expert GEMM would fall back to the
    older instructions without a word)."""
    import inspect

    from jaxtron.ops import triton_lowering

    dialect = triton_lowering.triton_dialect()
    assert dialect is not None and "max_num_imprecise_acc" in inspect.signature(dialect.dot).parameters
    assert triton_lowering.fp8_tensor_cores() is True
