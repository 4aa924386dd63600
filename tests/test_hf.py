"""Hugging Face interop: logit parity with transformers' own forward pass (fixtures written by
scripts/hf_fixtures.py), bit-exact round trips, fine-tuning starts, and one-sentence errors for bad input."""

import json
import os
import shutil

import numpy as np
import pytest
from conftest import REPO

from jaxtron import cli, families
from jaxtron.config.loader import load_config
from jaxtron.interop import convert, score
from jaxtron.interop.hf import safetensors as st

FIXTURES = os.path.join(REPO, "tests", "fixtures", "hf")
# every family's fixtures, as the families declare them (jaxtron/families/; scripts/hf_fixtures.py writes them)
FIXTURE = {fixture.name: fixture for family in families.all_families().values() for fixture in family.fixtures}
MODELS = tuple(FIXTURE)
# every fixture's logits are checked in the first tier; the round trip and greedy decoding there on a dense, an MoE
# and a QK-norm family, the rest in the extended tier (the first tier's time is close to its limit)
FIRST_TIER_FIXTURES = ("llama", "mixtral", "qwen3")
FIRST_TIER = tuple(n if n in FIRST_TIER_FIXTURES else pytest.param(n, marks=pytest.mark.extended) for n in MODELS)


def _tokens(name: str) -> str:
    """The token file a fixture's logits are of (tokens.npy, or longer rows for chunked mechanisms)."""
    return os.path.join(FIXTURES, FIXTURE[name].tokens_file)


@pytest.fixture(scope="session")  # once per test process (tests/conftest.py)
def imported(tmp_path_factory):
    out = {}
    for name in MODELS:
        out[name] = str(tmp_path_factory.mktemp(name) / "converted")
        convert.from_hf(os.path.join(FIXTURES, name), out[name])
    return out


@pytest.mark.slow
@pytest.mark.parametrize("name", MODELS)
def test_logits_match_transformers(name, imported):
    logits = score.score(imported[name], _tokens(name))
    reference = np.load(os.path.join(FIXTURES, name, "logits.npy"))
    assert logits.dtype == np.float32 and logits.shape == reference.shape == (2, FIXTURE[name].length, 96)
    assert np.abs(reference).max() > 0.5  # the comparison is not between near-zero numbers
    assert np.abs(logits - reference).max() < 1e-4


def test_config_json_of_transformers_4_and_5_map_to_the_same_model():
    with open(os.path.join(FIXTURES, "llama", "config.json")) as f:
        v5 = json.load(f)
    assert "rope_parameters" in v5 and "rope_theta" not in v5
    v4 = {k: v for k, v in v5.items() if k != "rope_parameters"}
    v4["rope_theta"] = v5["rope_parameters"]["rope_theta"]
    v4["rope_scaling"] = {k: v for k, v in v5["rope_parameters"].items() if k != "rope_theta"}
    cfg = families.model_config(v5, "x")
    assert families.model_config(v4, "x") == cfg
    assert (cfg.rope.theta, cfg.rope.factor, cfg.rope.original_max_len) == (500000.0, 8.0, 32)
    with open(os.path.join(FIXTURES, "llama_tied", "config.json")) as f:
        tied = families.model_config(json.load(f), "y")
    assert tied.tie_embeddings and tied.rope.factor == 8.0
    # Qwen3-MoE in the 4.x form: rope_theta at the top, the expert count as num_experts
    with open(os.path.join(FIXTURES, "qwen3_moe", "config.json")) as f:
        v5 = json.load(f)
    v4 = {k: v for k, v in v5.items() if k not in ("rope_parameters", "num_local_experts")}
    v4.update(rope_theta=v5["rope_parameters"]["rope_theta"], rope_scaling=None, num_experts=v5["num_local_experts"])
    moe = families.model_config(v5, "q")
    assert families.model_config(v4, "q") == moe and families.train_fields(v4) == families.train_fields(v5)
    assert (moe.attention.qk_norm, moe.moe.num_experts, moe.mlp_dim, moe.moe.expert_dim, moe.moe.every,
            moe.moe.router_renormalize, moe.rope.theta) == (True, 4, 64, 24, 2, True, 1e6)


@pytest.mark.slow
@pytest.mark.parametrize("name", FIRST_TIER)
def test_round_trip_is_bit_exact(name, imported, tmp_path):
    exported = str(tmp_path / "hf")
    hf = convert.to_hf(imported[name], exported)
    original, again = st.ModelFiles(os.path.join(FIXTURES, name)), st.ModelFiles(exported)
    expected = [n for n in original.names() if not (hf["tie_word_embeddings"] and n == "lm_head.weight")]
    assert again.names() == sorted(expected)
    for tensor in expected:
        a, b = original.read(tensor), again.read(tensor)
        assert a.dtype == b.dtype == np.float32 and np.array_equal(a, b), tensor
    with open(os.path.join(FIXTURES, name, "config.json")) as f:
        source = json.load(f)
    assert families.model_config(hf, "same") == families.model_config(source, "same")
    assert families.train_fields(hf) == families.train_fields(source)  # Mixtral's router loss coefficient
    # and back again: the same parameters
    _, first = convert.load(imported[name])
    convert.from_hf(exported, str(tmp_path / "again"))
    _, second = convert.load(str(tmp_path / "again"))
    assert first.keys() == second.keys() and all(np.array_equal(first[k], second[k]) for k in first)


def test_export_shards_with_an_index(imported, tmp_path, monkeypatch):
    monkeypatch.setattr(convert, "SHARD_BYTES", 32 * 1024)
    exported = str(tmp_path / "hf")
    convert.to_hf(imported["mixtral"], exported, dtype="bfloat16")
    with open(os.path.join(exported, st.INDEX)) as f:
        index = json.load(f)
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 2 and all(os.path.getsize(os.path.join(exported, f)) <= 32 * 1024 + 8192 for f in files)
    original, again = st.ModelFiles(os.path.join(FIXTURES, "mixtral")), st.ModelFiles(exported)
    assert again.names() == original.names()
    name = "model.layers.1.block_sparse_moe.experts.3.w2.weight"
    got = again.read(name)
    assert got.dtype.name == "bfloat16"
    np.testing.assert_allclose(got.astype(np.float32), original.read(name), rtol=2 ** -8)
    # bfloat16 shards import like float32 ones: the same values, widened
    convert.from_hf(exported, str(tmp_path / "back"))
    _, params = convert.load(str(tmp_path / "back"))
    assert np.array_equal(params["moe_layers.mlp.wo"][1, 3], got.astype(np.float32).T)


def test_safetensors_writer_and_reader_agree_on_every_dtype(tmp_path):
    rng = np.random.default_rng(0)
    arrays = {f"t.{code}": rng.normal(size=(3, 5)).astype(dtype) for code, dtype in st.SAFETENSORS_DTYPES.items()}
    arrays["empty"] = np.zeros((0, 4), np.float32)
    path = str(tmp_path / "model.safetensors")
    st.write(path, [(k, v.shape, v.dtype) for k, v in arrays.items()], arrays.__getitem__, {"format": "pt"})
    files = st.ModelFiles(str(tmp_path))
    assert files.names() == sorted(arrays)
    for k, v in arrays.items():
        assert files.read(k).dtype == v.dtype and np.array_equal(files.read(k), v)
    assert files.files[st.SINGLE].metadata == {"format": "pt"}


def _copy(name, tmp_path):
    target = str(tmp_path / name)
    shutil.copytree(os.path.join(FIXTURES, name), target)
    return target


def _edit_config(directory, **changes):
    path = os.path.join(directory, "config.json")
    with open(path) as f:
        config = json.load(f)
    config.update(changes)
    with open(path, "w") as f:
        json.dump(config, f)


def _rewrite_without(directory, drop=None, reshape=None):
    """Rewrites model.safetensors without one tensor, or with one tensor's shape changed."""
    files = st.ModelFiles(directory)
    tensors = {n: files.read(n) for n in files.names() if n != drop}
    if reshape:
        tensors[reshape] = tensors[reshape][:-1]
    os.remove(os.path.join(directory, st.SINGLE))
    st.write(os.path.join(directory, st.SINGLE), [(n, v.shape, v.dtype) for n, v in tensors.items()],
             tensors.__getitem__)


def _fails(capsys, argv, *fragments):
    assert cli.run("convert", argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and len(err.splitlines()) == 1 and "Traceback" not in err
    for fragment in fragments:
        assert fragment in err, err
    return err


def test_bad_input_gets_one_sentence_naming_the_problem(tmp_path, capsys):
    out = str(tmp_path / "out")
    gpt = _copy("llama", tmp_path / "a")
    _edit_config(gpt, architectures=["GPT2LMHeadModel"], model_type="gpt2")
    _fails(capsys, ["from-hf", gpt, out], "GPT2LMHeadModel", "LlamaForCausalLM")
    missing = _copy("llama", tmp_path / "b")
    _rewrite_without(missing, drop="model.layers.1.mlp.up_proj.weight")
    _fails(capsys, ["from-hf", missing, out], "'model.layers.1.mlp.up_proj.weight' is missing")
    shaped = _copy("mixtral", tmp_path / "c")
    _rewrite_without(shaped, reshape="model.layers.0.block_sparse_moe.experts.2.w3.weight")
    _fails(capsys, ["from-hf", shaped, out], "'model.layers.0.block_sparse_moe.experts.2.w3.weight' has shape (47, 32)",
           "(48, 32)")
    truncated = _copy("llama", tmp_path / "d")
    path = os.path.join(truncated, st.SINGLE)
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - 100)
    _fails(capsys, ["from-hf", truncated, out], "truncated or corrupt")
    pickled = str(tmp_path / "e")
    os.makedirs(pickled)
    shutil.copy(os.path.join(FIXTURES, "llama", "config.json"), pickled)
    open(os.path.join(pickled, "pytorch_model.bin"), "wb").close()
    _fails(capsys, ["from-hf", pickled, out], "pickle files, which are never loaded")
    scaled = _copy("llama", tmp_path / "f")
    _edit_config(scaled, rope_parameters={"rope_type": "longrope", "rope_theta": 1e4, "factor": 4.0})
    _fails(capsys, ["from-hf", scaled, out], "'longrope'")
    factored = _copy("deepseek_v3", tmp_path / "f2")
    _edit_config(factored, rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0,
                                            "attention_factor": 2.0})
    _fails(capsys, ["from-hf", factored, out], "YaRN's 'attention_factor'")
    # Gemma 3 and gpt-oss variants jaxtron does not build: soft-capping, local layers in another pattern, another
    # quantization
    capped = _copy("gemma3", tmp_path / "f3")
    _edit_config(capped, final_logit_softcapping=30.0)
    _fails(capsys, ["from-hf", capped, out], "final_logit_softcapping=30.0")
    patterned = _copy("gpt_oss", tmp_path / "f4")
    _edit_config(patterned, layer_types=["full_attention", "sliding_attention"] * 2)
    _fails(capsys, ["from-hf", patterned, out], "layer_types", "global_every")
    quantized = _copy("gpt_oss", tmp_path / "f5")
    _edit_config(quantized, quantization_config={"quant_method": "fp8"})
    _fails(capsys, ["from-hf", quantized, out], "quantized by 'fp8'")
    # Qwen3 variants jaxtron does not build: dense-only layers by list, a missing query norm
    listed = _copy("qwen3_moe", tmp_path / "g")
    _edit_config(listed, mlp_only_layers=[0])
    _fails(capsys, ["from-hf", listed, out], "mlp_only_layers=[0]", "decoder_sparse_step")
    # DeepSeek-V3: another scoring function, keys and values with fewer heads than the queries, no balancing bias
    softmax = _copy("deepseek_v3", tmp_path / "h")
    _edit_config(softmax, scoring_func="softmax")
    _fails(capsys, ["from-hf", softmax, out], "scoring_func='softmax'")
    grouped = _copy("deepseek_v3", tmp_path / "h2")
    _edit_config(grouped, num_key_value_heads=2)
    _fails(capsys, ["from-hf", grouped, out], "num_key_value_heads=2")
    unbiased = _copy("deepseek_v3", tmp_path / "h3")
    _rewrite_without(unbiased, drop="model.layers.2.mlp.gate.e_score_correction_bias")
    _fails(capsys, ["from-hf", unbiased, out], "'model.layers.2.mlp.gate.e_score_correction_bias' is missing")
    unnormed = _copy("qwen3", tmp_path / "i")
    _rewrite_without(unnormed, drop="model.layers.0.self_attn.q_norm.weight")
    _fails(capsys, ["from-hf", unnormed, out], "'model.layers.0.self_attn.q_norm.weight' is missing")
    assert not os.path.exists(out)  # nothing half-written
    _fails(capsys, ["to-hf", str(tmp_path / "nothing"), out], "neither a converted model")


@pytest.mark.slow
def test_score_refuses_bad_tokens(imported, tmp_path, capsys):
    bad, out = str(tmp_path / "bad.npy"), str(tmp_path / "o.npy")
    np.save(bad, np.full((1, 4), 96, np.int32))
    assert cli.run("score", ["--checkpoint", imported["llama"], "--tokens", bad, "--output", out]) == 2
    assert "outside the model's vocabulary of 96" in capsys.readouterr().err
    np.save(bad, np.zeros((4,), np.int32))
    assert cli.run("score", ["--checkpoint", imported["llama"], "--tokens", bad, "--output", out]) == 2
    assert "shape [batch, length]" in capsys.readouterr().err
    good = os.path.join(FIXTURES, "tokens.npy")
    out = str(tmp_path / "logits.npy")
    assert cli.run("score", ["--checkpoint", imported["mixtral"], "--tokens", good, "--output", out]) == 0
    assert np.load(out).shape == (2, 24, 96)


def _flat(params):
    from flax import nnx
    return {".".join(map(str, p)): np.asarray(v.get_value()) for p, v in nnx.to_flat_state(params)}


@pytest.mark.slow
def test_converted_config_fine_tunes_from_the_imported_parameters(imported, tmp_path):
    import jax

    from jaxtron.training.loop import run
    from jaxtron.training.state import init_state
    spec = os.path.join(imported["llama"], "config.py")
    # one step at a negligible learning rate: the parameters after it are those the run started from
    overrides = [("execution.dtype", "float32"), ("train.steps", "1"), ("train.log_every", "1"),
                 ("train.global_batch_size", "2"), ("data.seq_len", "24"), ("mesh.fsdp", "1"),
                 ("optimizer.learning_rate", "1e-9"), ("optimizer.warmup_steps", "0")]
    cfg = load_config(spec, overrides)
    assert cfg.train.init_from == imported["llama"] and cfg.model.vocab_size == 96
    summary = run(cfg, str(tmp_path / "run"), use_tqdm=False, devices=jax.devices()[:1])
    assert int(summary.state.step) == 1  # a fresh start, not a resumed run
    imported_params, started = convert.load(imported["llama"])[1], _flat(summary.state.params)
    assert imported_params.keys() == started.keys()
    for k in started:
        np.testing.assert_allclose(started[k], imported_params[k], atol=1e-6, err_msg=k)
    # the same model initialised afresh is far from the imported parameters (so the comparison above means something)
    fresh = _flat(init_state(load_config(spec, overrides + [("train.init_from", "")]), "xla", None).params)
    assert np.abs(fresh["layers.attn.wq.weight"] - imported_params["layers.attn.wq.weight"]).max() > 0.1
    # a training run's workdir is a valid init_from too: its latest parameters, a fresh optimizer
    again = run(load_config(spec, overrides + [("train.init_from", str(tmp_path / "run"))]), str(tmp_path / "b"),
                use_tqdm=False, devices=jax.devices()[:1])
    assert int(again.state.step) == 1
    for k, v in _flat(again.state.params).items():
        np.testing.assert_allclose(v, started[k], atol=1e-6, err_msg=k)
    # a training run exports like a converted model: its parameters, in Hugging Face layout
    convert.to_hf(str(tmp_path / "run"), str(tmp_path / "hf"))
    exported = st.ModelFiles(str(tmp_path / "hf"))
    wq = exported.read("model.layers.1.self_attn.q_proj.weight")
    assert np.array_equal(wq, started["layers.attn.wq.weight"][1].reshape(48, 48).T)
    assert len(exported.names()) == len(st.ModelFiles(os.path.join(FIXTURES, "llama")).names())


@pytest.mark.integration
@pytest.mark.slow
def test_init_from_a_missing_or_mismatched_checkpoint_is_one_sentence(imported, tmp_path):
    import subprocess
    import sys

    from jaxtron.checkpoint.params import restore_params
    from jaxtron.checkpoint.train_state import CheckpointError
    with pytest.raises(CheckpointError, match="holds neither params/"):
        restore_params(str(tmp_path / "none"), None, None)
    # through train.py: parameters of another model are refused in one line, exit 2
    spec = os.path.join(imported["llama"], "config.py")
    proc = subprocess.run([sys.executable, os.path.join(REPO, "train.py"), f"--config={spec}",
                           f"--workdir={tmp_path / 'w'}", "--config.train.steps=1", "--config.data.seq_len=24",
                           "--config.train.global_batch_size=8", f"--config.train.init_from={imported['mixtral']}"],
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1 and "Traceback" not in proc.stderr
    assert "parameter 'embedding' is of shape (96, 32)" in lines[0] and "needs shape (96, 48)" in lines[0]


@pytest.mark.slow
def test_init_from_restores_a_converted_mixtral_onto_a_mesh(imported, tmp_path):
    from jaxtron.training.loop import run
    overrides = [("execution.dtype", "float32"), ("train.steps", "1"), ("train.log_every", "1"),
                 ("train.global_batch_size", "8"), ("data.seq_len", "24"), ("mesh.fsdp", "2"), ("mesh.expert", "2"),
                 ("mesh.tensor", "2"), ("optimizer.learning_rate", "1e-9"), ("optimizer.warmup_steps", "0")]
    summary = run(load_config(os.path.join(imported["mixtral"], "config.py"), overrides), str(tmp_path / "run"),
                  use_tqdm=False)
    wi = summary.state.params["moe_layers"]["mlp"]["wi_up"].get_value()
    assert wi.sharding.shard_shape(wi.shape) == (2, 2, 16, 24)  # experts, embed and width all split
    started, imported_params = _flat(summary.state.params), convert.load(imported["mixtral"])[1]
    for k in started:
        np.testing.assert_allclose(started[k], imported_params[k], atol=1e-6, err_msg=k)


def _with_mtp_layer(tmp_path, head_copy_scale: float = 1.0) -> str:
    """The DeepSeek-V3 fixture plus a multi-token prediction module as layer 3, the way DeepSeek's checkpoints
    store it: a block (here layer 2's, perturbed), its own norms and projection, and copies of the embedding and
    output head (scaled by ``head_copy_scale``: 1 keeps them equal to the model's)."""
    directory = _copy("deepseek_v3", tmp_path)
    files = st.ModelFiles(directory)
    tensors = {n: files.read(n) for n in files.names()}
    rng = np.random.default_rng(3)
    for name in list(tensors):
        if name.startswith("model.layers.2."):
            tensors[name.replace("layers.2.", "layers.3.")] = tensors[name] + np.float32(0.01) * \
                rng.standard_normal(tensors[name].shape, np.float32)
    pre = "model.layers.3."
    for name in ("enorm", "hnorm", "shared_head.norm"):
        tensors[pre + name + ".weight"] = rng.standard_normal(32, np.float32)
    tensors[pre + "eh_proj.weight"] = 0.2 * rng.standard_normal((32, 64), np.float32)
    tensors[pre + "embed_tokens.weight"] = tensors["model.embed_tokens.weight"].copy()
    tensors[pre + "shared_head.head.weight"] = tensors["lm_head.weight"] * np.float32(head_copy_scale)
    os.remove(os.path.join(directory, st.SINGLE))
    st.write(os.path.join(directory, st.SINGLE), [(n, v.shape, v.dtype) for n, v in tensors.items()],
             tensors.__getitem__)
    return directory


@pytest.mark.integration
@pytest.mark.slow
def test_deepseek_multi_token_prediction_module_converts_both_ways(tmp_path, capsys):
    source = _with_mtp_layer(tmp_path / "src")
    convert.from_hf(source, str(tmp_path / "c"))
    cfg, _ = convert.load(str(tmp_path / "c"))
    assert cfg.mtp.depth == 1
    # the module adds no logits: the model's are transformers' (which skips it) as before
    logits = score.score(str(tmp_path / "c"), os.path.join(FIXTURES, "tokens.npy"))
    assert np.abs(logits - np.load(os.path.join(FIXTURES, "deepseek_v3", "logits.npy"))).max() < 1e-4
    hf = convert.to_hf(str(tmp_path / "c"), str(tmp_path / "hf"))
    assert hf["num_nextn_predict_layers"] == 1
    original, again = st.ModelFiles(source), st.ModelFiles(str(tmp_path / "hf"))
    assert again.names() == original.names() and any(n.startswith("model.layers.3.") for n in again.names())
    for name in original.names():
        assert np.array_equal(original.read(name), again.read(name)), name
    # without the module's weights (transformers' own checkpoints announce one anyway) the import has none
    convert.from_hf(os.path.join(FIXTURES, "deepseek_v3"), str(tmp_path / "p"))
    plain_cfg, plain = convert.load(str(tmp_path / "p"))
    assert plain_cfg.mtp.depth == 0 and not any(name.startswith("mtp.") for name in plain)
    # a module whose head copy is not the model's head is refused: jaxtron shares it
    differing = _with_mtp_layer(tmp_path / "bad", head_copy_scale=2.0)
    _fails(capsys, ["from-hf", differing, str(tmp_path / "out")],
           "'model.layers.3.shared_head.head.weight' differs from the model's own head")
    assert not os.path.exists(tmp_path / "out")


@pytest.mark.parametrize("name", FIRST_TIER)
def test_greedy_generation_equals_transformers_generate(name, imported):
    """The first 8 tokens of each row (a fixture of longer rows: all but 16) continued by 8, greedily: jaxtron's
    tokens (KV cache, both rows in one batch) are those of transformers' ``generate`` on the same model
    (greedy.npy, scripts/hf_fixtures.py)."""
    from jaxtron.inference.generate import Generator, load_model

    prompts = np.load(_tokens(name))[:, :FIXTURE[name].prompt]
    want = np.load(os.path.join(FIXTURES, name, "greedy.npy"))
    model, _ = load_model(imported[name])
    got = Generator(model).generate([list(map(int, p)) for p in prompts], 8).tokens
    np.testing.assert_array_equal(np.asarray(got), want)
