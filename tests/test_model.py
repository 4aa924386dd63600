"""The Llama-3 decoder: published sizes, RoPE (with Llama-3.1 scaling), causality, GQA, remat, dtypes."""

import math
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import REPO
from flax import nnx
from helpers import tiny_config

from jaxtron.config.loader import load_config
from jaxtron.config.schema import ModelConfig
from jaxtron.data.loader import SyntheticSource
from jaxtron.metrics.flops import param_count
from jaxtron.models import build_model
from jaxtron.models.layers import apply_rope, rope_frequencies
from jaxtron.ops.attention import dot_product_attention
from jaxtron.parallel.mesh import make_mesh
from jaxtron.training import state as state_lib
from jaxtron.training.loss import Objective, loss_sums

# config (FILE[:ARG] under configs/) -> published parameter count
PUBLISHED = {"llama3_1b": 1.24e9, "llama3_8b": 8.03e9, "llama3_70b": 70.55e9, "llama3_405b": 405.85e9,
             "gpt3_175b": 175e9, "deepseek_v3": 671e9, "qwen3:8b": 8.19e9, "qwen3:32b": 32.8e9, "qwen3:30b-a3b": 30.5e9,
             "qwen3:235b-a22b": 235e9, "gemma3:1b": 1.0e9, "gemma3:4b": 3.88e9, "gemma3:12b": 11.77e9,
             "gemma3:27b": 27.0e9, "gpt_oss:20b": 20.91e9, "gpt_oss:120b": 116.83e9, "llama4:maverick": 400e9}
# Meta's totals that count a vision encoder beside the text model: (published, the encoder's own count)
# (Llama 4 Scout's 109B: the text model's 107.8B and its 0.87B vision encoder and projector; docs/references.md)
PUBLISHED_WITH_VISION = {"llama4:scout": (109e9, 0.87e9)}
# Qwen3's model cards also give the count without the token embedding and output head (0.6B's total is given
# only as "0.6B")
PUBLISHED_NON_EMBEDDING = {"qwen3:0.6b": 0.44e9, "qwen3:8b": 6.95e9, "qwen3:32b": 31.2e9, "qwen3:30b-a3b": 29.9e9,
                           "qwen3:235b-a22b": 234e9,
                           # Gemma 3's technical report, Table 1 (its 4B, 12B and 27B also hold a 417M vision encoder)
                           "gemma3:1b": 698e6, "gemma3:4b": 3209e6, "gemma3:12b": 10759e6, "gemma3:27b": 25600e6}
# given to two digits (DeepSeek-V3's 37B: 37.55B counting the token embedding table as jaxtron does, 36.6B without)
PUBLISHED_ACTIVE = {"qwen3:30b-a3b": 3.3e9, "qwen3:235b-a22b": 22e9, "deepseek_v3": 37e9, "llama4:scout": 17e9,
                    "llama4:maverick": 17e9}
# gpt-oss's model card counts the active parameters without the token embedding table (the output head counts)
PUBLISHED_ACTIVE_WITHOUT_EMBEDDING = {"gpt_oss:20b": 3.61e9, "gpt_oss:120b": 5.13e9}
# Qwen3.5 publishes sizes by name only; the text model is within 1% of the names from 9B up (below, the vision
# encoder is a larger share of the name), and its active count within 16% of the A-number ("A3B": 3.45B)
PUBLISHED_NOMINAL = {"qwen3_5:9b": 9e9, "qwen3_5:27b": 27e9, "qwen3_5:35b-a3b": 35e9, "qwen3_5:122b-a10b": 122e9,
                     "qwen3_5:397b-a17b": 397e9}
PUBLISHED_NOMINAL_ACTIVE = {"qwen3_5:35b-a3b": 3e9, "qwen3_5:122b-a10b": 10e9, "qwen3_5:397b-a17b": 17e9}


@pytest.mark.parametrize("name", list(PUBLISHED) + list(PUBLISHED_NOMINAL) + list(PUBLISHED_WITH_VISION) + [
    "qwen3:0.6b", "gemma3:tiny", "gpt_oss:tiny", "qwen3_5:0.8b", "qwen3_5:tiny", "qwen3_5:tiny_moe", "llama4:tiny"])
def test_config_parameter_counts_match_published(name):
    file, _, size = name.partition(":")
    cfg = load_config(os.path.join(REPO, "configs", f"{file}.py") + (f":{size}" if size else ""))
    abstract = nnx.eval_shape(lambda: build_model(cfg.model, cfg.execution, 0))  # no memory is allocated
    counted = sum(math.prod(x.shape) for x in jax.tree.leaves(nnx.state(abstract, nnx.Param)))
    assert counted == param_count(cfg.model)
    assert name not in PUBLISHED or counted == pytest.approx(PUBLISHED[name], rel=5e-3)
    if name in PUBLISHED_WITH_VISION:
        total, vision = PUBLISHED_WITH_VISION[name]
        assert counted + vision == pytest.approx(total, rel=5e-3)
    if name in PUBLISHED_NON_EMBEDDING:
        m = cfg.model
        embeddings = m.vocab_size * m.embed_dim * (1 if m.tie_embeddings else 2)
        assert counted - embeddings == pytest.approx(PUBLISHED_NON_EMBEDDING[name], rel=5e-3)
    if name in PUBLISHED_ACTIVE:
        assert param_count(cfg.model, active=True) == pytest.approx(PUBLISHED_ACTIVE[name], rel=2e-2)
    if name in PUBLISHED_NOMINAL:
        assert counted == pytest.approx(PUBLISHED_NOMINAL[name], rel=1e-2)
    if name in PUBLISHED_NOMINAL_ACTIVE:
        assert param_count(cfg.model, active=True) == pytest.approx(PUBLISHED_NOMINAL_ACTIVE[name], rel=0.16)
    if name in PUBLISHED_ACTIVE_WITHOUT_EMBEDDING:
        table = cfg.model.vocab_size * cfg.model.embed_dim
        assert param_count(cfg.model, active=True) - table == pytest.approx(
            PUBLISHED_ACTIVE_WITHOUT_EMBEDDING[name], rel=5e-3)


def test_rope_frequencies_plain_and_llama31_scaled():
    plain = ModelConfig(embed_dim=1024, attention=dict(num_heads=8, head_dim=128), rope=dict(theta=500_000.0))
    freq = np.asarray(rope_frequencies(plain))
    np.testing.assert_allclose(freq, [500_000.0 ** (-2 * i / 128) for i in range(64)], rtol=1e-6)
    scaled_cfg = ModelConfig(embed_dim=1024, attention=dict(num_heads=8, head_dim=128),
                             rope=dict(theta=500_000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                       original_max_len=8192))
    scaled = np.asarray(rope_frequencies(scaled_cfg))
    for f, s in zip(freq, scaled, strict=True):
        wavelength = 2 * math.pi / f
        if wavelength < 8192 / 4:  # high frequencies: unchanged
            assert s == pytest.approx(f, rel=1e-6)
        elif wavelength > 8192 / 1:  # low frequencies: divided by the factor
            assert s == pytest.approx(f / 8, rel=1e-6)
        else:  # in between: a blend of the two, weighted by how many wavelengths fit the original context
            w = (8192 / wavelength - 1) / (4 - 1)
            assert s == pytest.approx((1 - w) * f / 8 + w * f, rel=1e-5)
            assert f / 8 < s < f
    assert (scaled < freq).sum() > 0 and (scaled == freq).sum() > 0


def test_rope_scores_depend_only_on_relative_position():
    cfg = ModelConfig(embed_dim=64, attention=dict(num_heads=2, num_kv_heads=2, head_dim=32),
                      rope=dict(theta=10_000.0))
    inv = rope_frequencies(cfg)
    q, k = jax.random.normal(jax.random.key(0), (2, 1, 1, 1, 32))
    score = lambda i, j: float(jnp.sum(apply_rope(q, jnp.array([[i]]), inv) * apply_rope(k, jnp.array([[j]]), inv)))
    assert score(5, 3) == pytest.approx(score(105, 103), rel=1e-4)
    assert score(5, 3) != pytest.approx(score(5, 4), rel=1e-3)


def _model_and_tokens(**model):
    cfg = tiny_config(model=model)
    params_model = build_model(cfg.model, cfg.execution, 0)
    tokens = jnp.asarray(SyntheticSource(256, 16, 0).rows(np.arange(2))["inputs"])
    return cfg, params_model, tokens


@pytest.mark.slow
@pytest.mark.parametrize("variant", [{}, dict(activation="gelu", norm="layernorm", position_embedding="learned",
                                               tie_embeddings=True, attention=dict(num_kv_heads=4))])
def test_causal_no_token_sees_the_future(variant):
    _, model, tokens = _model_and_tokens(**variant)
    logits = model(tokens).logits()
    changed = tokens.at[:, 10:].set((tokens[:, 10:] + 1) % 256)
    other = model(changed).logits()
    np.testing.assert_allclose(logits[:, :10], other[:, :10], rtol=1e-5, atol=1e-6)
    assert not np.allclose(logits[:, 10:], other[:, 10:])


@pytest.mark.slow
def test_segments_do_not_attend_across_documents():
    _, model, tokens = _model_and_tokens()
    segments = jnp.array([[0] * 6 + [1] * 10, [0] * 16])
    positions = jnp.array([list(range(6)) + list(range(10)), list(range(16))])
    base = model(tokens, positions, segments).logits()
    changed = tokens.at[0, :6].set((tokens[0, :6] + 7) % 256)  # edit the first document only
    other = model(changed, positions, segments).logits()
    np.testing.assert_allclose(base[0, 6:], other[0, 6:], rtol=1e-5, atol=1e-6)  # the second one cannot see it
    # the second document alone, from position 0, gives the same logits
    alone = model(tokens[:1, 6:], positions[:1, 6:], jnp.zeros((1, 10), jnp.int32)).logits()
    np.testing.assert_allclose(base[0, 6:], alone[0], rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_sequence_sharded_attention_equals_unsharded():
    b, t, n, g, h = 2, 32, 4, 2, 16
    q = jax.random.normal(jax.random.key(1), (b, t, n, h))
    k, v = jax.random.normal(jax.random.key(2), (2, b, t, g, h))
    segments = jnp.array([[0] * 20 + [1] * 12, [0] * 32])
    want = dot_product_attention(q, k, v, segment_ids=segments)
    mesh = make_mesh(dict(data=1, fsdp=1, sequence=8, expert=1, tensor=1))
    with jax.set_mesh(mesh):
        got = jax.jit(lambda *a: dot_product_attention(*a, segment_ids=segments))(q, k, v)
        assert got.sharding.spec[1] == "sequence"  # queries stay sharded by position
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    # GQA reference: repeat each key/value head for its group of query heads, plain softmax attention
    kr, vr = jnp.repeat(k, n // g, axis=2), jnp.repeat(v, n // g, axis=2)
    scores = jnp.einsum("bqnh,bknh->bnqk", q, kr) / math.sqrt(h)
    allowed = jnp.tril(jnp.ones((t, t), bool)) & (segments[:, None, :, None] == segments[:, None, None, :])
    ref = jnp.einsum("bnqk,bknh->bqnh", jax.nn.softmax(jnp.where(allowed, scores, -1e30), -1), vr)
    np.testing.assert_allclose(want, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_remat_policies_change_memory_not_results():
    tokens = SyntheticSource(256, 64, 0).rows(np.arange(8))
    batch = {k: jnp.asarray(v) for k, v in tokens.items()}
    results, temp = {}, {}
    for remat in ("none", "full", "save_dots"):
        cfg = tiny_config(model=dict(num_layers=4), execution=dict(remat=remat), data=dict(seq_len=64))
        setup = state_lib.setup(cfg, "xla")
        params = state_lib.init_state(cfg, "xla", None).params
        fn = jax.jit(jax.value_and_grad(lambda p, setup=setup: loss_sums(p, setup.graphdef, batch)[0]))
        temp[remat] = fn.lower(params).compile().memory_analysis().temp_size_in_bytes
        loss, grads = fn(params)
        results[remat] = (float(loss), jax.tree.leaves(nnx.to_pure_dict(grads)))
    # full keeps only each layer's input; save_dots also keeps the projections; none keeps everything
    assert temp["full"] < temp["save_dots"] < temp["none"], temp
    for remat in ("full", "save_dots"):
        assert results[remat][0] == pytest.approx(results["none"][0], rel=1e-6)
        for a, b in zip(results[remat][1], results["none"][1], strict=True):
            # each policy's program rounds its reductions its own way: a few float32 ulps of gradients near 3
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=2e-6)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_layers_in_line_compute_what_the_layer_loop_does(dtype):
    """execution.scan_layers=False runs every block in line (no loop, no per-layer stacking of what the backward
    pass keeps): the same loss and gradients, and a program without a while loop. In line, the recomputed forward
    sits behind a barrier (merged with the first, it kept what the policy drops: Llama-3 8B on 8 H100s peaked at
    165 GB where the loop's step took 83), and each weight is cast to the compute dtype once, not again there."""
    batch = {k: jnp.asarray(v) for k, v in SyntheticSource(256, 64, 0).rows(np.arange(8)).items()}
    results = {}
    for scan in (True, False):
        cfg = tiny_config(model=dict(num_layers=3), execution=dict(remat="save_dots", scan_layers=scan, dtype=dtype),
                          data=dict(seq_len=64))
        setup = state_lib.setup(cfg, "xla")
        params = state_lib.init_state(cfg, "xla", None).params
        fn = jax.jit(jax.value_and_grad(lambda p, setup=setup: loss_sums(p, setup.graphdef, batch)[0]))
        # a scan's loop says so in its op name (XLA:CPU runs the embedding gradient's scatter in a loop too)
        text = fn.lower(params).compile().as_text()
        assert bool(re.search(r' while\(.*op_name="[^"]*/while"', text)) == scan
        if not scan:
            assert "optimization_barrier" in fn.lower(params).as_text()
            if dtype == "bfloat16":  # the gate and up weights [embed, mlp]: one cast each in the block's program
                shape = f"bf16[{cfg.model.embed_dim},{cfg.model.mlp_dim}]"
                jaxpr = str(jax.make_jaxpr(jax.value_and_grad(
                    lambda p, setup=setup: loss_sums(p, setup.graphdef, batch)[0]))(params))
                casts = re.findall(re.escape(shape) + r" = convert_element_type\[[^]]*new_dtype=bfloat16", jaxpr)
                assert len(casts) == 2, len(casts)  # 4 when the backward casts them again
        loss, grads = fn(params)
        results[scan] = (float(loss), jax.tree.leaves(nnx.to_pure_dict(grads)))
    tolerance = dict(rtol=1e-5, atol=1e-6) if dtype == "float32" else dict(rtol=2e-2, atol=2e-3)
    assert results[False][0] == pytest.approx(results[True][0], rel=tolerance["rtol"] / 10)
    for a, b in zip(results[False][1], results[True][1], strict=True):
        np.testing.assert_allclose(np.float32(a), np.float32(b), **tolerance)


def test_bf16_compute_keeps_fp32_parameters():
    cfg = tiny_config(execution=dict(dtype="bfloat16"))
    model = build_model(cfg.model, cfg.execution, 0)
    logits = model(jnp.zeros((1, 8), jnp.int32)).logits()
    assert logits.dtype == jnp.float32  # the head accumulates into float32 for the loss
    text = str(jax.make_jaxpr(lambda t: model(t).logits())(jnp.zeros((1, 8), jnp.int32)))
    import re
    bf16_dots = re.findall(r":bf16\[[0-9,]*\] = dot_general", text)
    assert len(bf16_dots) >= 7, text  # q, k, v, o, gate, up, down compute in bf16
    assert {x.dtype for x in jax.tree.leaves(nnx.state(model, nnx.Param))} == {jnp.dtype(jnp.float32)}


def test_tied_embeddings_have_no_output_head():
    tied_cfg, untied_cfg = tiny_config(model=dict(tie_embeddings=True)), tiny_config()
    tied = nnx.state(build_model(tied_cfg.model, tied_cfg.execution, 0), nnx.Param)
    untied = nnx.state(build_model(untied_cfg.model, untied_cfg.execution, 0), nnx.Param)
    assert "head" not in tied and "head" in untied


@pytest.mark.slow
def test_bf16_embedding_gradient_is_accumulated_in_float32():
    # a frequent token's gradient row is a sum over thousands of positions: summed in bf16 it loses most of it
    rng = np.random.default_rng(0)
    tokens = np.minimum(rng.zipf(1.3, size=(256, 33)), 255).astype(np.int32)
    batch = {"inputs": jnp.asarray(tokens[:, :-1]), "targets": jnp.asarray(tokens[:, 1:])}
    grads = {}
    for dtype in ("float32", "bfloat16"):
        cfg = tiny_config(execution=dict(dtype=dtype))
        setup = state_lib.setup(cfg, "xla")
        params = state_lib.init_state(cfg, "xla", None).params
        g = jax.jit(jax.grad(lambda p, setup=setup: loss_sums(p, setup.graphdef, batch)[0]))(params)
        grads[dtype] = np.asarray(g["embedding"].get_value())
        assert g["embedding"].get_value().dtype == jnp.float32
    counts = np.bincount(tokens[:, :-1].ravel())
    assert counts.max() > 2000
    top = counts.argmax()
    err = np.linalg.norm(grads["bfloat16"][top] - grads["float32"][top]) / np.linalg.norm(grads["float32"][top])
    assert err < 0.01, err  # bf16 compute noise only; a bf16 scatter-add gives tens of percent here


def test_every_remat_choice_of_the_config_has_a_policy():
    from jaxtron.config.model import REMAT_CHOICES
    from jaxtron.models.stack import remat_names
    assert (*remat_names(), "auto") == REMAT_CHOICES


@pytest.mark.parametrize("remat,count", [("full", 0), ("save_dots", 1), ("save_attention", 1),
                                         ("save_dots_attention", 2)])
def test_remat_policies_that_keep_the_attention_output(remat, count, capsys):
    cfg = tiny_config(model=dict(num_layers=2), execution=dict(remat=remat))
    graphdef, params = nnx.split(build_model(cfg.model, cfg.execution, 0))
    tokens = jnp.zeros((2, 16), jnp.int32)
    jax.ad_checkpoint.print_saved_residuals(lambda p: jnp.sum(nnx.merge(graphdef, p)(tokens).logits()), params)
    # residuals of the layer scan shaped [layers, batch, length, heads, head_dim]: the query projection (a
    # dot) and the attention output
    shape = f"[2,2,16,{cfg.model.attention.num_heads},{cfg.model.resolved_head_dim}] output of scan"
    assert capsys.readouterr().out.count(shape) == count


@pytest.mark.slow
def test_logits_in_chunks_give_the_same_loss_and_gradients_in_less_memory():
    tokens = SyntheticSource(4096, 64, 0).rows(np.arange(8))
    batch = {k: jnp.asarray(v) for k, v in tokens.items()}
    batch["loss_mask"] = jnp.asarray(np.random.default_rng(0).random((8, 64)) < 0.8, jnp.float32)
    results, temp = {}, {}
    mesh = make_mesh(dict(data=1, fsdp=2, sequence=2, expert=1, tensor=2))
    for chunks in (1, 8):
        cfg = tiny_config(model=dict(vocab_size=4096, num_layers=1, max_seq_len=64), data=dict(seq_len=64),
                          train=dict(logit_chunks=chunks, z_loss=1e-3))
        setup = state_lib.setup(cfg, "xla")
        params = state_lib.init_state(cfg, "xla", None).params
        fn = jax.jit(jax.value_and_grad(
            lambda p, setup=setup: loss_sums(p, setup.graphdef, batch, Objective(1e-3, setup.train.logit_chunks))[0]))
        temp[chunks] = fn.lower(params).compile().memory_analysis().temp_size_in_bytes
        with jax.set_mesh(mesh):  # the same on a mesh that shards the sequence and the vocabulary
            shardings = state_lib.state_shardings(mesh, setup.abstract_state).params
            loss, grads = jax.jit(fn)(jax.device_put(params, shardings))
        results[chunks] = (float(loss), jax.tree.leaves(nnx.to_pure_dict(grads)))
    # [8, 64, 4096] float32 logits are 8 MiB, their one-hot product and gradient as much again
    assert temp[8] < temp[1] / 3, temp
    assert results[8][0] == pytest.approx(results[1][0], rel=1e-6)
    for a, b in zip(results[8][1], results[1][1], strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)  # float32 sums in another order


def test_rope_angles_stay_accurate_for_every_position_a_row_can_hold():
    """Positions restart at each row's start, so RoPE sees positions below data.seq_len <= model.max_seq_len;
    there the float32 rotation matches a float64 one to 1e-3 (at a document offset of 1e6 it was off by 0.07)."""
    from jaxtron.config.schema import ModelConfig
    from jaxtron.models.layers import apply_rope, rope_frequencies
    cfg = ModelConfig(embed_dim=4096, attention=dict(num_heads=32), rope=dict(theta=500_000.0), max_seq_len=8192)
    dim = cfg.resolved_head_dim
    positions = np.arange(cfg.max_seq_len)[None]
    x = np.zeros((1, positions.shape[1], 1, dim), np.float32)
    x[..., 0] = 1.0  # rotates into (cos, sin) of each frequency's angle
    got = np.asarray(apply_rope(jnp.asarray(x), jnp.asarray(positions), rope_frequencies(cfg)))[0, :, 0]
    angles = positions[0, :, None] * (1.0 / cfg.rope.theta ** (np.arange(0, dim, 2) / dim))
    assert np.abs(got[:, 0] - np.cos(angles[:, 0])).max() < 1e-3
    assert np.abs(got[:, dim // 2] - np.sin(angles[:, 0])).max() < 1e-3


def test_sequence_parallelism_splits_the_residual_stream_over_the_tensor_group(monkeypatch):
    """Between blocks the residual stream is split along the sequence over ``tensor`` (the rules table's
    ``activation_residual_length``): the residual stack saved for the backward pass shrinks by the tensor degree,
    and the normed block inputs are gathered before the projections (no weight is gathered over ``tensor``)."""
    from jaxtron.parallel import sharding
    from jaxtron.planning.dry_run import dry_run
    layers, rows, length, width, tensor = 16, 4, 1024, 256, 4
    cfg = tiny_config(dict(fsdp=2, tensor=tensor), data=dict(seq_len=length), train=dict(global_batch_size=8),
                      model=dict(embed_dim=width, num_layers=layers, attention=dict(num_heads=8, num_kv_heads=4),
                                 mlp_dim=512, max_seq_len=length),
                      execution=dict(remat="full", attention="blockwise"))
    split = dry_run(cfg)
    # the stream whole per rank
    monkeypatch.setattr(sharding, "_RULES", {**sharding._RULES, "activation_residual_length": "sequence"})
    whole = dry_run(cfg)
    stack = layers * rows * length * width * 4  # float32 block inputs kept for the backward pass
    assert whole.temp_bytes - split.temp_bytes >= 0.9 * stack * (1 - 1 / tensor)
    # the normed stream is gathered before the attention and MLP projections, in the forward pass, its
    # recomputation and the backward pass (where the reduce-scatters of the outputs turn into all-gathers);
    # nothing is exchanged all-to-all (which would mean the projections ran on a split sequence)
    assert split.collectives["all-to-all"]["count"] == 0
    gathered = split.collectives["all-gather"]["bytes"] - whole.collectives["all-gather"]["bytes"]
    assert gathered >= 4 * layers * rows * length * width * 4 * (1 - 1 / tensor)
