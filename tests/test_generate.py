"""Generation: decoding with the cache equals the full forward at every step, for every family."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import tiny_config
from test_training import QWEN3_STYLE

from jaxtron.models import build_model

FAMILIES = {  # tiny models of each family's architecture
    "llama": {},
    "gpt3": dict(position_embedding="learned", norm="layernorm", activation="gelu", tie_embeddings=True),
    "qwen3": QWEN3_STYLE["qwen3"],
    "mixtral": dict(num_layers=4, moe=dict(num_experts=4, experts_per_token=2, every=2)),
    "deepseek_v3": dict(QWEN3_STYLE["deepseek_v3"], mtp=dict(depth=0)),
    # windows of 3 tokens, shorter than the prefill: a local layer's ring of 3 slots is read whole while the prompt
    # is prefilled, then turns over (Gemma 3: a lead block, then a period of local, local, global)
    "gemma3": dict(num_layers=4, activation="geglu", norm_unit_offset=True, post_norms=True, embed_scale=True,
                   attention=dict(qk_norm=True, window=3, global_every=3, query_pre_attn_scalar=24),
                   rope=dict(local_theta=100.0, scaling="linear", factor=2.0)),
    "gpt_oss": dict(num_layers=4, activation="clamped_swiglu", swiglu_limit=1.0,
                    attention=dict(window=3, global_every=2, sinks=True, bias=True),
                    rope=dict(scaling="yarn", factor=4.0, original_max_len=16, truncate=False),
                    moe=dict(num_experts=4, experts_per_token=2, router_logit_bias=True, expert_bias=True)),
    # chunks of 4 positions: the prefill and the steps cross chunk boundaries; every fourth layer global, no RoPE,
    # its temperature changing every 3 positions; experts top-1 scaling their input, a shared one, every second block
    "llama4": dict(num_layers=4, attention=dict(chunk=4, global_every=4, global_nope=True, temperature_floor=3,
                                                temperature_scale=0.5, qk_l2_norm=True),
                   moe=dict(num_experts=4, experts_per_token=1, every=2, shared_experts=1, router="sigmoid",
                            router_renormalize=False, balance_bias=False, scale_input=True)),
}
DRAWN = ("gemma3", "gpt_oss")  # their sinks, biases and norm offsets start at zero: drawn away from it


def _model(family, cfg):
    """The family's tiny model; its parameters moved by noise where zeros would hide a mechanism."""
    from flax import nnx

    model = build_model(cfg.model, cfg.execution, 0)
    if family in DRAWN:
        state = nnx.state(model, nnx.Param)
        leaves, tree = jax.tree.flatten(state)
        keys = jax.random.split(jax.random.key(7), len(leaves))
        nnx.update(model, jax.tree.unflatten(tree, [x + 0.3 * jax.random.normal(k, x.shape)
                                                    for x, k in zip(leaves, keys, strict=True)]))
    return model


# The cache is longer than the prompt, so the softmax sums in another order than the full forward's. On some
# CPUs a gpt-oss logit near 0.2 then moves by 1.3e-5 (of logits up to 5): float32 rounding, not a wrong position.
ATOL = 3e-5


@pytest.mark.slow
# Llama 4's and Gemma 3's in the extended tier (the first tier's time): gpt-oss's checks the window's ring too
@pytest.mark.parametrize("family", [f if f not in ("llama4", "gemma3") else pytest.param(f, marks=pytest.mark.extended)
                                    for f in FAMILIES])
def test_decoding_with_the_cache_equals_the_full_forward_at_every_step(family):
    """A prompt's prefill (5 tokens) and then one token at a time: each step's float32 logits equal the full
    forward's at the same positions (ATOL), with rows at different positions (the second row a step behind)."""
    cfg = tiny_config(model=FAMILIES[family], execution=dict(moe_mode="dropless"))
    model = _model(family, cfg)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, cfg.model.vocab_size, (2, 12)), jnp.int32)
    want = np.asarray(model(tokens).logits())
    cache = model.empty_cache(2, 16, jnp.float32)
    window = cfg.model.attention.window
    for kind, c in zip(cfg.model.period_blocks(), cache["period"], strict=True):  # local layers: the window
        assert not window or c["k"].shape[2] == (window if kind.local else 16)
    step = jax.jit(lambda m, t, p, c: m.decode(t, p, c))
    positions = jnp.broadcast_to(jnp.arange(5, dtype=jnp.int32), (2, 5))
    fresh = cache
    logits, cache = step(model, tokens[:, :5], positions, cache)
    np.testing.assert_allclose(np.asarray(logits), want[:, :5], rtol=1e-5, atol=ATOL)
    # a prefill's logits at one column a row (the prompts' last), as generation and GRPO's sampler take them
    last, _ = jax.jit(lambda m, t, p, c, at: m.decode(t, p, c, last=at))(model, tokens[:, :5], positions, fresh,
                                                                         jnp.asarray([4, 2], jnp.int32))
    np.testing.assert_allclose(np.asarray(last)[:, 0], want[[0, 1], [4, 2]], rtol=1e-5, atol=ATOL)
    for t in range(5, 12):  # the first row at t, the second at t - 1 (its own position)
        at = jnp.asarray([[t], [t - 1]], jnp.int32)
        logits, cache = step(model, jnp.take_along_axis(tokens, at, axis=1), at, cache)
        np.testing.assert_allclose(np.asarray(logits)[0, 0], want[0, t], rtol=1e-5, atol=ATOL, err_msg=str(t))
        np.testing.assert_allclose(np.asarray(logits)[1, 0], want[1, t - 1], rtol=1e-5, atol=ATOL, err_msg=str(t))


def _naive_greedy(model, prompt: list[int], steps: int) -> list[int]:
    """Greedy continuation by re-running the full forward on the whole sequence for every token."""
    tokens = list(prompt)
    for _ in range(steps):
        logits = model(jnp.asarray([tokens], jnp.int32)).logits()
        tokens.append(int(jnp.argmax(logits[0, -1])))
    return tokens[len(prompt):]


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama", pytest.param("gemma3", marks=pytest.mark.extended)])
def test_greedy_generation_of_a_batch_equals_the_full_forward_token_by_token(family):
    """Two prompts of different lengths in one batch (right-padded, each row at its own position): each row's
    greedy tokens are those of re-running the whole forward for every token; top-k 1 and a tiny top-p are greedy
    too, and sampling at a temperature repeats with its seed. Gemma 3's local layers: the shorter prompt's padding
    must not take the place of its last tokens in the window's ring."""
    from jaxtron.inference.generate import Generator, Sampling

    cfg = tiny_config(model=FAMILIES[family])
    model = _model(family, cfg)
    prompts = [[3, 14, 15, 92, 65], [35, 89]]
    generator = Generator(model)
    got = generator.generate(prompts, 6).tokens
    assert got == [_naive_greedy(model, p, 6) for p in prompts]
    if family != "llama":
        return
    assert generator.generate(prompts, 6, Sampling(temperature=1.0, top_k=1)).tokens == got
    assert generator.generate(prompts, 6, Sampling(temperature=1.0, top_p=1e-6)).tokens == got
    a, b, c = (generator.generate(prompts, 6, Sampling(temperature=1.5, seed=s)).tokens for s in (1, 1, 2))
    assert a == b and a != c


def test_generation_ends_at_the_end_of_document_token_and_at_a_stop():
    from jaxtron.inference.generate import Generator

    cfg = tiny_config(model=FAMILIES["llama"])
    generator = Generator(build_model(cfg.model, cfg.execution, 0))
    full = generator.generate([[3, 14, 15]], 8).tokens[0]
    eos = full[3]  # the fourth token: the row ends before it
    assert generator.generate([[3, 14, 15]], 8, eos_id=eos).tokens[0] == full[:full.index(eos)]
    stopped = generator.generate([[3, 14, 15]], 8, stop=lambda row, t: len(t) == 2)
    assert stopped.tokens[0] == full[:2]
    assert stopped.decode_tokens == 1 and stopped.prefill_tokens == 3  # the first new token is the prefill's


@pytest.mark.parametrize("family", ["llama", pytest.param("deepseek_v3", marks=pytest.mark.extended)])
def test_sharded_generation_equals_one_devices_tokens(family):
    """The parameters sharded by the rules table over tensor=2 x fsdp=4 (8 fake devices): the same greedy tokens."""
    from jaxtron.inference.generate import Generator
    from jaxtron.parallel.mesh import make_mesh

    cfg = tiny_config(model=FAMILIES[family], execution=dict(moe_mode="dropless"))
    model = build_model(cfg.model, cfg.execution, 0)
    prompts = [[3, 14, 15, 92, 65], [35, 89]]
    one = Generator(model).generate(prompts, 5).tokens
    sharded = Generator(model, make_mesh(dict(tensor=2, fsdp=4))).generate(prompts, 5).tokens
    assert sharded == one


def test_a_cache_longer_than_the_model_takes_is_refused():
    from jaxtron.config.schema import ConfigError
    from jaxtron.inference.generate import Generator

    cfg = tiny_config(model=FAMILIES["llama"])  # max_seq_len 64
    with pytest.raises(ConfigError, match="needs a cache of 70 positions, beyond the model's max_seq_len 64"):
        Generator(build_model(cfg.model, cfg.execution, 0)).generate([[1] * 40], 30)


@pytest.fixture(scope="session")  # once per test process (tests/conftest.py)
def trained_run(tmp_path_factory):
    """A training run of the tiny model on synthetic bytes, its checkpoint at step 2."""
    from jaxtron.training.loop import run

    workdir = str(tmp_path_factory.mktemp("run"))
    run(tiny_config(train=dict(steps=2), checkpoint=dict(every=0)), workdir, use_tqdm=False, devices=jax.devices()[:1])
    return workdir


def test_jaxtron_generate_continues_prompts_from_a_run(trained_run, tmp_path, capsys, monkeypatch):
    """One prompt streams after itself; a JSONL batch prints one JSON object per prompt; the continuation is the
    library's greedy one on the checkpoint's parameters. The run is named by a relative path, as the README does."""
    import os

    from jaxtron import cli
    from jaxtron.inference.generate import Generator, load_model

    monkeypatch.chdir(os.path.dirname(trained_run))
    assert cli.main(["generate", "--run", os.path.basename(trained_run), "--prompt", "def f(", "--max-new-tokens", "6",
                     "--tokenizer", "byte"]) == 0
    out = capsys.readouterr().out
    model, _ = load_model(trained_run)
    want = Generator(model).generate([list(b"def f(")], 6).tokens[0]
    assert out == "def f(" + bytes(want).decode("utf-8", errors="replace") + "\n"
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "import os"}\n\n{"prompt": "x = "}\n')
    assert cli.main(["generate", "--run", trained_run, "--prompts", str(prompts), "--max-new-tokens", "3",
                     "--tokenizer", "byte", "--temperature", "0.8", "--top-k", "20", "--seed", "3"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [line["prompt"] for line in lines] == ["import os", "x = "]
    assert all(len(line["completion"].encode("utf-8", errors="replace")) >= 1 for line in lines)


def test_bad_generate_input_is_one_sentence_and_exit_2(trained_run, tmp_path, capsys):
    from jaxtron import cli

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a"}\nnot json\n')
    cases = [
        (["--prompts", str(bad)], f"--prompts '{bad}' line 2 is not JSON"),
        (["--prompt", "x" * 60, "--max-new-tokens", "10"],
         "needs a cache of 70 positions, beyond the model's max_seq_len 64"),
        (["--prompt", "x", "--top-p", "0"], "--top-p must be in (0, 1], not 0.0"),
        (["--prompt", "x", "--mesh", "tensor=two"], "--mesh 'tensor=two' must be AXIS=SIZE pairs"),
        ([], "no prompt given"),
    ]
    for extra, message in cases:
        assert cli.main(["generate", "--run", trained_run, "--tokenizer", "byte", *extra]) == 2, extra
        err = capsys.readouterr().err
        assert err.startswith("error: ") and err.count("\n") == 1 and message in err, err
    assert cli.main(["generate", "--run", str(tmp_path / "nothing"), "--prompt", "x"]) == 2
    assert "is not a directory" in capsys.readouterr().err


def test_a_converted_model_generates_with_the_tokenizer_it_was_converted_with(tmp_path, capsys):
    """``convert from-hf`` copies the Hugging Face directory's tokenizer files; ``jaxtron generate`` then finds
    tokenizer.json there, with its end-of-document token."""
    import os
    import shutil

    from tokenizers import Tokenizer, models, pre_tokenizers

    from jaxtron import cli
    from jaxtron.interop import convert

    hf = tmp_path / "hf"
    shutil.copytree(os.path.join(os.path.dirname(__file__), "fixtures", "hf", "llama"), hf)
    words = ["<|endoftext|>", "[UNK]", *(f"w{i}" for i in range(94))]  # the fixture's 96-token vocabulary
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(hf / "tokenizer.json"))
    convert.from_hf(str(hf), str(tmp_path / "converted"))
    assert (tmp_path / "converted" / "tokenizer.json").read_bytes() == (hf / "tokenizer.json").read_bytes()
    assert cli.main(["generate", "--run", str(tmp_path / "converted"), "--prompt", "w1 w2 w3",
                     "--max-new-tokens", "4"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("w1 w2 w3") and len(out) > len("w1 w2 w3\n")
