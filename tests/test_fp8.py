"""FP8 matmuls (jaxtron/ops/fp8.py) against a reference built from ml_dtypes' FP8 rounding, and in the model.

On a GPU, XLA must turn the quantize/dequantize/dot pattern into FP8 GEMMs; that check runs only there.
"""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jaxtron.config.schema import Config, ConfigError, DataConfig, ExecutionConfig, ModelConfig, replace
from jaxtron.ops import fp8

RNG = np.random.default_rng(0)


def _reference_qdq(x: np.ndarray, dtype) -> np.ndarray:
    """Rounding to the FP8 grid of the tensor's own absolute maximum, computed in numpy."""
    limit = float(ml_dtypes.finfo(dtype).max)
    amax = np.abs(x).max()
    scale = np.float32(amax / limit) if amax > 0 else np.float32(1)
    q = np.clip(x.astype(np.float32) / scale, -limit, limit).astype(dtype)
    return q.astype(np.float32) * scale


@pytest.mark.parametrize("dtype", [fp8.E4M3, fp8.E5M2])
def test_quantize_dequantize_matches_the_reference(dtype):
    x = (RNG.standard_normal((64, 48)) * np.exp(RNG.uniform(-4, 4, (64, 48)))).astype(np.float32)
    got = np.asarray(fp8.quantize_dequantize(jnp.asarray(x), dtype))
    np.testing.assert_array_equal(got, _reference_qdq(x, dtype))
    # the largest magnitude is exact, and normal values keep 3 (e4m3) or 2 (e5m2) mantissa bits
    assert np.abs(got).max() == pytest.approx(np.abs(x).max(), rel=1e-6)
    bits = 3 if dtype == fp8.E4M3 else 2
    normal = np.abs(x) > np.abs(x).max() * 2.0 ** -6
    assert np.max(np.abs(got - x)[normal] / np.abs(x)[normal]) <= 2.0 ** -(bits + 1) * 1.0001


def test_scales_follow_the_tensor():
    big = jnp.full((4, 4), 3.0e4)
    assert np.asarray(fp8.quantize_dequantize(big, fp8.E4M3)) == pytest.approx(3.0e4)  # no saturation at 448
    assert np.all(np.asarray(fp8.quantize_dequantize(jnp.zeros((4, 4)), fp8.E4M3)) == 0)  # no 0/0
    inf = jnp.array([[1.0, jnp.inf]])
    assert not np.all(np.isfinite(np.asarray(fp8.quantize_dequantize(inf, fp8.E4M3))))  # not clipped away


def test_fp8_einsum_forward_and_gradients_match_the_reference():
    x = RNG.standard_normal((2, 8, 32)).astype(np.float32)
    w = (RNG.standard_normal((32, 4, 8)) * 0.05).astype(np.float32)
    dy = RNG.standard_normal((2, 8, 4, 8)).astype(np.float32) * 1e-3
    eq = "btd,dnh->btnh"
    y, vjp = jax.vjp(lambda a, b: fp8.einsum(eq, a, b), jnp.asarray(x), jnp.asarray(w))
    dx, dw = vjp(jnp.asarray(dy))
    xq, wq, dyq = _reference_qdq(x, ml_dtypes.float8_e4m3fn), _reference_qdq(w, ml_dtypes.float8_e4m3fn), \
        _reference_qdq(dy, ml_dtypes.float8_e5m2)
    np.testing.assert_allclose(np.asarray(y), np.einsum(eq, xq, wq), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(dx), np.einsum("btnh,dnh->btd", dyq, wq), rtol=1e-5, atol=1e-9)
    np.testing.assert_allclose(np.asarray(dw), np.einsum("btd,btnh->dnh", xq, dyq), rtol=1e-5, atol=1e-9)
    # and FP8 stays close to the exact product: a few percent of its scale
    exact = np.einsum(eq, x, w)
    assert np.abs(np.asarray(y) - exact).max() < 0.06 * np.abs(exact).max()


def _tiny(model: dict | None = None, **execution) -> Config:
    """A 4-layer model (``model``: fields to change) run in float32 with XLA attention (``execution``: fields to
    change, e.g. fp8=True); a Config, which checks the FP8 fields against the layers."""
    base = ModelConfig(name="tiny", vocab_size=64, embed_dim=64, num_layers=4,
                       attention=dict(num_heads=4, num_kv_heads=2), mlp_dim=128, max_seq_len=32)
    return Config(model=replace(base, **(model or {})),
                  execution=ExecutionConfig(**{**dict(dtype="float32", attention="xla"), **execution}),
                  data=DataConfig(seq_len=32))


def _loss_and_grads(cfg: Config, tokens):
    from flax import nnx

    from jaxtron.models import build_model
    graphdef, params = nnx.split(build_model(cfg.model, cfg.execution, 0))

    def loss(p):
        logits = nnx.merge(graphdef, p)(tokens[:, :-1]).logits()
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), tokens[:, 1:, None], -1))

    return jax.jit(jax.value_and_grad(loss))(params)


@pytest.mark.slow
def test_an_fp8_model_tracks_the_exact_one_and_keeps_chosen_layers_exact():
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 64, (4, 17)), jnp.int32)  # whatever ran before
    exact_loss, exact_grads = _loss_and_grads(_tiny(), tokens)
    fp8_loss, fp8_grads = _loss_and_grads(_tiny(fp8=True), tokens)
    skip_loss, skip_grads = _loss_and_grads(_tiny(fp8=True, fp8_skip_layers=1), tokens)
    assert float(fp8_loss) != float(exact_loss) != float(skip_loss)  # FP8 really ran
    assert abs(float(fp8_loss) - float(exact_loss)) < 2e-3 * float(exact_loss)

    def first_layer_error(grads):
        """The relative error of the first block's weight gradients (the stacked leaves' index 0) from exact."""
        pairs = [(np.asarray(a)[0], np.asarray(b)[0]) for a, b in zip(jax.tree.leaves(exact_grads),
                                                                       jax.tree.leaves(grads), strict=True)
                 if np.ndim(a) >= 2 and np.shape(a)[0] == 4]
        return np.sqrt(sum(np.sum((a - b) ** 2) for a, b in pairs) / sum(np.sum(a ** 2) for a, _ in pairs))

    # the kept block's own GEMMs are exact, only the noise of the FP8 blocks above it reaches its gradients: half
    # the error (0.037-0.047 against 0.076-0.089 over eight batches); the loss itself moves by noise either way
    assert first_layer_error(skip_grads) < 0.7 * first_layer_error(fp8_grads)
    leaves = zip(jax.tree.leaves(exact_grads), jax.tree.leaves(fp8_grads), strict=True)
    for a, b in leaves:  # e5m2 keeps 2 mantissa bits: about 10% noise per gradient, same direction
        a, b = np.asarray(a).ravel(), np.asarray(b).ravel()
        assert np.all(np.isfinite(b))
        assert np.linalg.norm(a - b) <= 0.15 * np.linalg.norm(a)
        assert a @ b >= 0.99 * np.linalg.norm(a) * np.linalg.norm(b)


@pytest.mark.slow
def test_fp8_trains_inside_scanned_layers_with_remat_and_gradient_accumulation(tmp_path):
    from conftest import REPO

    from jaxtron.config.loader import load_config
    from jaxtron.training.loop import run
    common = dict(data__source="synthetic", model__num_layers="2", model__embed_dim="64",
                  model__attention__num_heads="4", model__attention__num_kv_heads="2", model__mlp_dim="128",
                  data__seq_len="32", train__global_batch_size="16",
                  train__steps="12", train__log_every="4", train__eval_batches="0", checkpoint__every="0",
                  execution__remat="full", train__microbatches="2")
    losses = {}
    for name, extra in (("exact", {}), ("fp8", {"execution__fp8": "True"})):
        overrides = [(k.replace("__", "."), v) for k, v in {**common, **extra}.items()]
        cfg = load_config(f"{REPO}/configs/default.py", overrides)
        summary = run(cfg, str(tmp_path / name), use_tqdm=False)
        losses[name] = [h["loss"] for h in summary.history]
    assert losses["exact"][-1] < losses["exact"][0]  # it learns
    np.testing.assert_allclose(losses["fp8"], losses["exact"], rtol=1e-2)
    assert losses["fp8"] != losses["exact"]


@pytest.mark.slow
@pytest.mark.extended  # FP8 in the first tier: its kernels' checks and a run in scanned layers with accumulation
@pytest.mark.parametrize("remat", ["none", "full"])
def test_fp8_losses_and_parameters_on_fsdp_sequence_and_tensor_equal_one_devices(remat, tmp_path):
    """FP8 projections on fsdp=2 x sequence=2 x tensor=2 gather their weights after quantizing them (kept for the
    backward pass under a checkpoint, gathered again there without one) and reduce-scatter their gradients: the
    same steps as on one device, to float32 rounding (which moves a value across a step of the FP8 grid now and
    then: the losses agree to 1e-4, not 1e-5 as in 32 bits)."""
    from helpers import MESHES, tiny_config

    from jaxtron.training.loop import run
    runs = {}
    for name, mesh, devices in (("one", dict(fsdp=1), jax.devices()[:1]),
                                ("mesh", MESHES["fsdp2_sequence2_tensor2"], None)):
        cfg = tiny_config(mesh, execution=dict(fp8=True, remat=remat))
        runs[name] = run(cfg, str(tmp_path / name), use_tqdm=False, devices=devices)
    losses = {k: np.array([h["loss"] for h in v.history]) for k, v in runs.items()}
    assert len(losses["one"]) == 3 and np.all(np.diff(losses["one"]) != 0)
    np.testing.assert_allclose(losses["mesh"], losses["one"], rtol=1e-4)
    from flax import nnx
    for a, b in zip(jax.tree.leaves(nnx.to_pure_dict(runs["mesh"].state.params)),
                    jax.tree.leaves(nnx.to_pure_dict(runs["one"].state.params)), strict=True):
        # an element whose gradient crossed a grid step may move by a good part of an update (Adam divides by the
        # gradient's size): each parameter as a whole to 1% (a wrong gradient moves it by some 20%)
        a, b = np.asarray(a), np.asarray(b)
        assert np.linalg.norm(a - b) <= 0.01 * np.linalg.norm(b), (a.shape, np.linalg.norm(a - b) / np.linalg.norm(b))


def test_fp8_config_errors():
    with pytest.raises(ConfigError,
                       match="execution.fp8_skip_layers' .2. leaves no FP8 block among model.num_layers .4."):
        _tiny(fp8=True, fp8_skip_layers=2)
    with pytest.raises(ConfigError, match="execution.fp8_skip_layers' must be >= 0"):
        _tiny(fp8_skip_layers=-1)


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU: XLA rewrites FP8 GEMMs only there")
def test_xla_emits_fp8_gemms_for_every_projection_on_a_gpu():
    cfg = _tiny(dict(num_layers=2, embed_dim=128, mlp_dim=256), fp8=True, dtype="bfloat16")
    tokens = jnp.asarray(RNG.integers(0, 64, (4, 129)), jnp.int32)
    from flax import nnx

    from jaxtron.models import build_model
    graphdef, params = nnx.split(build_model(cfg.model, cfg.execution, 0, "cudnn"))

    def loss(p):
        return jnp.mean(nnx.merge(graphdef, p)(tokens[:, :-1]).logits())

    # compiled as the train step compiles an FP8 program (Setup carries these options into the step's compile)
    hlo = jax.jit(jax.grad(loss)).lower(params).compile(compiler_options=fp8.compiler_options(True)).as_text()
    # 7 projections per block (q, k, v, o, gate, up, down), each with one forward and two backward GEMMs; the
    # scanned blocks share one loop body
    assert hlo.count('custom_call_target="__cublas$lt$matmul$f8"') >= 21, hlo[:2000]
