"""MXFP8 (``execution.fp8_recipe='mxfp8'``, ``ops/block_scaled.py``): the format, each GEMM's blocks, meshes and
the recipe's refusals. On the CPU the block-scaled GEMMs run emulated: the same quantized operands, dequantized."""

import math

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jaxtron.config.schema import ConfigError
from jaxtron.ops import block_scaled

RNG = np.random.default_rng(7)


def _mx_reference(a: np.ndarray) -> np.ndarray:
    """``a`` [..., K] through MXFP8 in float64, as OCP MX v1.0 states it (this test's own statement): blocks of
    32 along the last axis, a scale 2^ceil(log2(amax / 448)), each element rounded to e4m3 (ml_dtypes)."""
    blocks = a.astype(np.float64).reshape(*a.shape[:-1], a.shape[-1] // 32, 32)
    ratio = np.abs(blocks).max(-1, keepdims=True) / 448.0
    scale = np.exp2(np.ceil(np.log2(np.maximum(ratio, 2.0 ** -126))))
    q = (blocks / scale).astype(np.float32).astype(ml_dtypes.float8_e4m3fn).astype(np.float64)
    return (q * scale).reshape(a.shape)


def _rounding_bound(a: np.ndarray) -> np.ndarray:
    """Each element's largest MXFP8 rounding error: half an e4m3 step, 2^-4 of the value where it is normal,
    else half the subnormal step 2^-9 of the block's scale (the scale at most amax / 448 x 2)."""
    blocks = np.abs(a.astype(np.float64)).reshape(*a.shape[:-1], a.shape[-1] // 32, 32)
    scale = 2 * blocks.max(-1, keepdims=True) / 448.0
    return np.maximum(2.0 ** -4 * blocks, 2.0 ** -10 * scale).reshape(a.shape)


def test_the_quantized_operand_is_the_formats_own():
    # values across many binades, some blocks all zero, one block with an exact power-of-two maximum
    x = RNG.standard_normal((6, 128)) * np.exp2(RNG.integers(-20, 20, (6, 1)))
    x[2, :64] = 0.0
    x[3, :32] = np.linspace(-1, 1, 32) * 448.0 * 2.0 ** -3
    q, scale = block_scaled.quantized(jnp.asarray(x, jnp.float32))
    assert q.dtype == jnp.float8_e4m3fn and scale.shape == (6, 4)
    np.testing.assert_array_equal(np.log2(np.asarray(scale)), np.round(np.log2(np.asarray(scale))))  # powers of 2
    got = np.asarray(block_scaled.dequantized(q, scale), np.float64)
    np.testing.assert_array_equal(got, _mx_reference(x.astype(np.float32)))
    assert np.all(np.abs(got - x) <= _rounding_bound(x) * (1 + 1e-6))


def test_each_gemm_quantizes_its_operands_along_its_own_contraction():
    """Forward, input and weight gradients: each the float64 product of its two operands through MXFP8 along the
    dimension that GEMM contracts; within the format's rounding of the exact product; and not the exact one."""
    x = RNG.standard_normal((2, 64, 96)).astype(np.float32)  # [batch, tokens, in]: 128 tokens, 96 features
    w = (RNG.standard_normal((96, 4, 32)) * 0.1).astype(np.float32)  # [in, heads, head size]: 128 out features
    g = RNG.standard_normal((2, 64, 4, 32)).astype(np.float32)
    eq = "btd,dhk->bthk"
    y, pullback = jax.vjp(lambda a, b: block_scaled.scaled_einsum(eq, a, b), jnp.asarray(x), jnp.asarray(w))
    dx, dw = pullback(jnp.asarray(g))
    x2, w2, g2 = x.reshape(128, 96), w.reshape(96, 128), g.reshape(128, 128)
    cases = (("forward", y, x2, w2.T, (2, 64, 4, 32)),  # a [M, K], b [N, K]: blocks along K
             ("input gradient", dx, g2, w2, (2, 64, 96)),  # along the output features
             ("weight gradient", dw, x2.T, g2.T, (96, 4, 32)))  # along the tokens
    for name, got, a, b, shape in cases:
        got = np.asarray(got, np.float64).reshape(-1, b.shape[0])
        recipe = _mx_reference(a) @ _mx_reference(b).T
        np.testing.assert_allclose(got, recipe, rtol=1e-5, atol=1e-5 * np.abs(recipe).max(), err_msg=name)
        exact = a.astype(np.float64) @ b.astype(np.float64).T
        ea, eb = _rounding_bound(a), _rounding_bound(b)
        bound = ea @ np.abs(b.T) + np.abs(a) @ eb.T + ea @ eb.T + 1e-5 * np.abs(exact).max()
        assert np.all(np.abs(got - exact) <= bound), name
        assert np.abs(got - exact).max() > 1e-3 * np.abs(exact).max(), name  # it quantized
        assert got.size == math.prod(shape)


def test_a_block_recipe_refuses_what_it_cannot_run():
    from helpers import tiny_config

    from jaxtron.parallel.checks import check_devices
    with pytest.raises(ConfigError, match=r"execution.fp8_recipe' is 'nvfp8', which is not one of 'tensorwise', "
                                          r"'blockwise', 'mxfp8', 'nvfp4'"):
        tiny_config(execution=dict(fp8=True, fp8_recipe="nvfp8"))
    with pytest.raises(ConfigError, match=r"'model.mlp_dim' \(100\) is not a multiple of the 32-element blocks"):
        tiny_config(model=dict(mlp_dim=100), execution=dict(fp8=True, fp8_recipe="mxfp8"))
    with pytest.raises(ConfigError, match="has no form for dropless mode's grouped expert GEMM"):
        tiny_config(model=dict(moe=dict(num_experts=4)), execution=dict(fp8=True, fp8_recipe="mxfp8"))
    tiny_config(model=dict(moe=dict(num_experts=4)), execution=dict(fp8=True, fp8_recipe="mxfp8", moe_mode="capacity"))
    tiny_config(model=dict(mlp_dim=100), execution=dict(fp8_recipe="mxfp8"))  # without fp8 the recipe is idle
    # tensor=2 leaves each device 16 of the 2 key heads' 32 features: half a block
    cfg = tiny_config(dict(fsdp=4, tensor=2), execution=dict(fp8=True, fp8_recipe="mxfp8"))
    with pytest.raises(ConfigError, match=r"blocks would straddle devices: model.attention.num_kv_heads x head_dim "
                                          r"\(32\) splits into 2 pieces of 16 over mesh.tensor"):
        check_devices(cfg, 8)
    check_devices(tiny_config(dict(fsdp=8), execution=dict(fp8=True, fp8_recipe="mxfp8")), 8)


def _mesh_config(mesh: dict):
    from helpers import tiny_config

    # head size 32 and 128 tokens a row: whole blocks on each device of tensor=2 and sequence=2 (4 chunks of 32)
    return tiny_config(mesh, model=dict(embed_dim=128, max_seq_len=128), data=dict(seq_len=128),
                       execution=dict(fp8=True, fp8_recipe="mxfp8"))


# each recipe's smallest whole blocks on data=2 sequence=2: a row's tokens and the key heads' features
RECIPE_SIZES = {"mxfp8": (128, 128, 2), "nvfp4": (128, 128, 2), "blockwise": (256, 512, 4)}


@pytest.mark.slow
@pytest.mark.parametrize("recipe", sorted(RECIPE_SIZES))
def test_a_recipes_gemms_keep_each_devices_tokens_on_a_sequence_mesh(recipe):
    """A projection's GEMM merges the batch and the length into rows. Split over data and sequence, the merge has
    no tiled layout unless the length's pieces go outermost (``block_scaled.as_rows``): without that, XLA gathered
    every token onto every device before each GEMM (sequence=2: 19 all-gathers against the 16-bit step's 4, each
    GEMM over the whole sequence). The recipe's step gathers no more than the 16-bit one's, and its GEMMs take
    the device's rows (nvfp4's 16-wide Hadamard products aside)."""
    import re

    from helpers import tiny_config

    from jaxtron.planning.dry_run import _compile

    width, length, kv_heads = RECIPE_SIZES[recipe]

    def compiled(execution):
        cfg = tiny_config(dict(data=2, fsdp=1, sequence=2), data=dict(seq_len=length), execution=execution,
                          model=dict(embed_dim=width, mlp_dim=2 * width, max_seq_len=length,
                                     attention=dict(num_heads=4, num_kv_heads=kv_heads)))
        result, text = _compile(cfg, jax.devices()[:4], "blockwise")
        return result.collectives["all-gather"]["bytes"], text

    plain, _ = compiled({})
    gathered, text = compiled(dict(fp8=True, fp8_recipe=recipe))
    assert gathered <= plain, (gathered, plain)
    shapes = [(int(m), int(n)) for m, n in re.findall(r"f32\[(\d+),(\d+)\]\{1,0\} dot\(", text)]
    rows = [m for m, n in shapes if n > 16]
    local_tokens = 8 * length // 4  # the batch's 8 rows over data=2 and sequence=2
    assert rows and max(rows) == local_tokens, sorted(set(rows))


@pytest.mark.slow
@pytest.mark.extended
def test_mxfp8_steps_on_fsdp_sequence_and_tensor_equal_one_devices(tmp_path):
    """Blocks lie within each device's share (the checks refuse a mesh where they would not), so each device
    quantizes the elements one device does: the same steps, to float32 rounding (a sum in another order moves a
    value across an e4m3 step now and then: the losses agree to 1e-4)."""
    from helpers import MESHES

    from jaxtron.training.loop import run
    runs = {name: run(_mesh_config(mesh), str(tmp_path / name), use_tqdm=False, devices=devices)
            for name, mesh, devices in (("one", dict(fsdp=1), jax.devices()[:1]),
                                        ("mesh", MESHES["fsdp2_sequence2_tensor2"], None))}
    losses = {k: np.array([h["loss"] for h in v.history]) for k, v in runs.items()}
    assert len(losses["one"]) == 3 and np.all(np.diff(losses["one"]) != 0)
    np.testing.assert_allclose(losses["mesh"], losses["one"], rtol=1e-4)


def test_an_unknown_recipe_exits_2_with_the_names_and_writes_nothing(tmp_path, capsys):
    from conftest import REPO

    from jaxtron import cli
    workdir = tmp_path / "run"
    assert cli.main(["train", f"--config={REPO}/configs/default.py", f"--workdir={workdir}",
                     "--config.execution.fp8=True", "--config.execution.fp8_recipe=mx"]) == 2
    err = capsys.readouterr().err
    assert "'execution.fp8_recipe' is 'mx', which is not one of 'tensorwise', 'blockwise', 'mxfp8', 'nvfp4'" in err
    assert err.count("\n") == 1 and not workdir.exists()


def test_skipped_layers_keep_16_bits_under_every_recipe():
    """``execution.fp8_skip_layers`` cuts the stack into spans; the middle one runs the recipe, the ends none."""
    from helpers import tiny_config

    from jaxtron.models.stack import layer_spans
    for recipe in ("tensorwise", "blockwise", "mxfp8", "nvfp4"):
        cfg = tiny_config(model=dict(num_layers=4, embed_dim=256, mlp_dim=512, max_seq_len=128),
                          data=dict(seq_len=128), execution=dict(fp8=True, fp8_recipe=recipe, fp8_skip_layers=1))
        spans = [(s.first, s.end, s.fp8) for s in layer_spans(cfg.model, cfg.execution)]
        assert spans == [(0, 1, None), (1, 3, recipe), (3, 4, None)], spans


def test_capacity_modes_experts_run_each_experts_gemms_by_the_recipe():
    """Capacity mode's batched expert GEMMs, each expert's by MXFP8 or NVFP4 (``ops/expert_recipes.py``): the
    slots padded to whole blocks give the unpadded GEMM's numbers, each expert on its own blocks."""
    from jaxtron.ops import nvfp4
    from jaxtron.ops.expert_recipes import expert_einsum
    x = jnp.asarray(RNG.standard_normal((3, 40, 64)), jnp.float32)  # 40 slots: padded to 64 and to 48
    w = jnp.asarray(RNG.standard_normal((3, 64, 96)) * 0.1, jnp.float32)
    exact = jnp.einsum("emd,edf->emf", x, w)
    for recipe, one in (("mxfp8", block_scaled.scaled_einsum), ("nvfp4", nvfp4.scaled_einsum)):
        batched = jax.jit(lambda a, b, r=recipe: expert_einsum(r, "emd,edf->emf", a, b))
        single = jax.jit(lambda a, b, one=one: one("md,df->mf", a, b))
        got = batched(x, w)
        for e in range(3):
            np.testing.assert_allclose(np.asarray(got[e]), np.asarray(single(x[e], w[e])), rtol=1e-6, atol=1e-6,
                                       err_msg=recipe)
        assert 0 < float(jnp.abs(got - exact).max()) < 0.3 * float(jnp.abs(exact).max()), recipe
        dx, dw = jax.jit(jax.grad(lambda a, b, f=batched: jnp.sum(f(a, b)), argnums=(0, 1)))(x, w)
        assert dx.shape == x.shape and dw.shape == w.shape and bool(jnp.all(jnp.isfinite(dw)))
