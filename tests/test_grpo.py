"""GRPO: advantages, the loss against its definition, the sampler against generation, resume, a tensor mesh, the
refusals, and the shipped example's learning run."""

from __future__ import annotations

import json
import os

import jax
import numpy as np
import pytest
from helpers import refused, tiny_config

from jaxtron import cli
from jaxtron.data.chat import PLAIN_TEMPLATE

REWARD = '''
def score(prompt, completion, record):
    """Longer counts score higher: rewards that differ within a group, whatever a random model writes."""
    return min(len(completion), 24) / 24 + (0.5 if completion.startswith(str(record["a"])) else 0.0)

def text(prompt, completion, record):
    return "high"

def broken(prompt, completion, record):
    raise KeyError("answer")
'''


@pytest.fixture(scope="module")
def grpo_data(tmp_path_factory):
    """A base run (one step of the tiny model), a counting prompt store and a reward module."""
    from jaxtron.training.loop import run
    tmp = tmp_path_factory.mktemp("grpo")
    base = str(tmp / "base")
    run(tiny_config(train=dict(steps=1), checkpoint=dict(every=0)), base, use_tqdm=False, devices=jax.devices()[:1])
    (tmp / "plain.jinja").write_text(PLAIN_TEMPLATE)
    records = [{"prompt": f"Count from {a} to {b}.", "a": a, "b": b} for a in range(1, 10) for b in range(a + 1, 12)]
    (tmp / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    store = str(tmp / "prompts")
    assert cli.main(["prepare", "--input", str(tmp / "prompts.jsonl"), "--tokenizer", "byte", "--output", store,
                     "--prompts", "--chat-template", str(tmp / "plain.jinja")]) == 0
    (tmp / "rewards.py").write_text(REWARD)
    return base, store, str(tmp / "rewards.py")


def _grpo_cfg(data, mesh=None, steps=4, **sections):
    base, store, rewards = data
    train = dict(steps=steps, global_batch_size=16, log_every=1, init_from=base, objective="grpo", eval_batches=0)
    rl = dict(reward=f"{rewards}:score", group_size=4, max_new_tokens=16, updates=2, kl=0.1)
    return tiny_config(mesh, train={**train, **sections.pop("train", {})}, model=dict(max_seq_len=128),
                       optimizer=dict(learning_rate=3e-3, warmup_steps=1, decay_steps=8,
                                      **sections.pop("optimizer", {})),
                       data=dict(source="store", path=store, seq_len=64, validation_fraction=0.0),
                       rl={**rl, **sections.pop("rl", {})}, **{"checkpoint": dict(every=0), **sections})


def test_advantages_are_normalized_within_each_group():
    from jaxtron.training.rollouts import advantages
    rewards = np.array([1.0, 0.0, 0.0, 0.0, 0.5, 0.5, 0.5, 0.5, 0.2, 0.9, 0.4, 0.1], np.float32)
    scaled, spread = advantages(rewards, 4, scale=True)
    groups = scaled.reshape(3, 4)
    np.testing.assert_allclose(groups.mean(axis=1), 0, atol=1e-6)
    np.testing.assert_allclose(groups[[0, 2]].std(axis=1), 1, rtol=1e-3)
    assert not groups[1].any()  # a group whose rewards agree teaches nothing
    np.testing.assert_allclose(spread, np.repeat(rewards.reshape(3, 4).std(axis=1), 4), rtol=1e-6)
    centred, _ = advantages(rewards, 4, scale=False)
    np.testing.assert_allclose(centred.reshape(3, 4), rewards.reshape(3, 4) - rewards.reshape(3, 4).mean(1,
                                                                                                    keepdims=True))


def test_a_completion_keeps_its_end_of_turn_marker_and_nothing_after():
    from jaxtron.data.tokenizers import ByteTokenizer
    from jaxtron.training.rollouts import completion_end
    tok = ByteTokenizer()
    tokens = list(tok.encode("42<|end|>\n<|user|>"))
    assert completion_end(tokens, tok.decode, None, ["<|end|>"]) == len("42<|end|>")
    assert completion_end(tokens, tok.decode, None, []) == len(tokens)  # no stop: all it wrote
    assert completion_end([5, 9, 2, 7], tok.decode, 2, []) == 3  # through the end-of-document token


def test_the_grpo_loss_is_its_definition():
    """Against numpy: the clipped surrogate, the k3 KL, length normalization, and the metrics."""
    import jax.numpy as jnp
    from flax import nnx

    from jaxtron.config.schema import RlConfig
    from jaxtron.models import build_model
    from jaxtron.training.grpo import grpo_sums
    from jaxtron.training.preference import token_logps

    cfg = tiny_config()
    graphdef, params = nnx.split(build_model(cfg.model, cfg.execution, 0), nnx.Param)
    rng = np.random.default_rng(0)
    rows, length = 4, 16
    tokens = rng.integers(0, 256, (rows, length + 1))
    mask = (np.arange(length)[None] >= np.array([[3], [5], [8], [2]])) & (np.arange(length)[None] < 12)
    batch = {"inputs": jnp.asarray(tokens[:, :-1], jnp.int32), "targets": jnp.asarray(tokens[:, 1:], jnp.int32),
             "positions": jnp.broadcast_to(jnp.arange(length), (rows, length)),
             "loss_mask": jnp.asarray(mask, jnp.int32),
             "advantages": jnp.asarray(np.repeat([[1.0], [-1.0], [0.5], [-0.3]], length, 1), jnp.float32)}
    new = np.asarray(token_logps(params, graphdef, batch), np.float64)
    old, ref = new + rng.normal(0, 0.3, new.shape), new + rng.normal(0, 0.2, new.shape)
    batch.update(old_logps=jnp.asarray(old, jnp.float32), reference_logps=jnp.asarray(ref, jnp.float32))
    for normalized in (True, False):
        rl = RlConfig(clip=0.2, kl=0.05, length_normalization=normalized, max_new_tokens=16)
        total, (_, count, metrics) = grpo_sums(params, graphdef, batch, rl)
        ratio, adv = np.exp(new - old), np.asarray(batch["advantages"])
        surrogate = np.minimum(ratio * adv, np.clip(ratio, 0.8, 1.2) * adv)
        kl = np.exp(ref - new) - (ref - new) - 1
        per_row = ((-surrogate + 0.05 * kl) * mask).sum(1) / (mask.sum(1) if normalized else 16)
        np.testing.assert_allclose(float(total), per_row.sum(), rtol=1e-5)
        assert float(count) == rows
        np.testing.assert_allclose(float(metrics["grpo/kl"]), (kl * mask).sum() / mask.sum(), rtol=1e-5)
        clipped = (np.clip(ratio, 0.8, 1.2) * adv < ratio * adv) & mask
        np.testing.assert_allclose(float(metrics["grpo/clip_fraction"]), clipped.sum() / mask.sum(), rtol=1e-5)
        assert 0 < float(metrics["grpo/clip_fraction"]) < 1


@pytest.mark.slow
def test_the_sampler_at_temperature_zero_writes_what_generate_writes(grpo_data):
    """The rollouts' one-program sampler (prefill, then a scanned decode) against `jaxtron generate`'s loop."""
    import jax.numpy as jnp
    from flax import nnx

    from jaxtron.inference.generate import Generator, load_model
    from jaxtron.training.rollouts import sampler

    model, _ = load_model(grpo_data[0])
    cfg = _grpo_cfg(grpo_data, rl=dict(temperature=0.0))
    prompts = [list(b"<|user|>\nCount 3 to 7.<|end|>\n<|assistant|>\n"), list(b"<|user|>\nHi<|end|>\n")]
    want = Generator(model).generate(prompts, 16).tokens
    tokens = np.zeros((2, 48), np.int32)
    for row, prompt in enumerate(prompts):
        tokens[row, :len(prompt)] = prompt
    graphdef, params = nnx.split(model, nnx.Param)
    got = jax.jit(sampler(graphdef, cfg))(params, jnp.asarray(tokens), jnp.asarray([len(p) for p in prompts]),
                                           jax.random.key(0))
    assert np.asarray(got).tolist() == want


@pytest.mark.slow
def test_grpo_resumes_bit_exactly(grpo_data, tmp_path):
    """4 steps, a resume with train.steps raised and 4 more: the same samples, losses and parameters as 8."""
    from jaxtron.training.loop import run
    one = jax.devices()[:1]
    straight = run(_grpo_cfg(grpo_data, steps=8), str(tmp_path / "straight"), use_tqdm=False, devices=one)
    saving = dict(every=4)
    first = run(_grpo_cfg(grpo_data, steps=4, checkpoint=saving), str(tmp_path / "run"), use_tqdm=False, devices=one)
    resumed = run(_grpo_cfg(grpo_data, steps=8, checkpoint=saving), str(tmp_path / "run"), use_tqdm=False,
                  devices=one)
    for key in ("loss", "grpo/reward", "grpo/kl"):
        assert [h[key] for h in first.history + resumed.history] == [h[key] for h in straight.history], key
    for a, b in zip(jax.tree.leaves(straight.state.params), jax.tree.leaves(resumed.state.params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    rewards = [h["grpo/reward"] for h in straight.history]
    assert len(set(rewards)) > 1 and straight.history[-1]["grpo/kl"] > 0  # the policy moved from its reference
    assert int(straight.state.step) == 8  # one step a batch, whatever rl.updates


@pytest.mark.slow
@pytest.mark.extended  # a mesh: the extended tier's (the first tier's time); the first keeps the resume
def test_grpo_on_a_tensor_mesh_equals_one_device(grpo_data, tmp_path):
    from jaxtron.training.loop import run
    one = run(_grpo_cfg(grpo_data, steps=3), str(tmp_path / "one"), use_tqdm=False, devices=jax.devices()[:1])
    # the mesh's logits in 4 slices of the sequence, one device's whole: the same log-probabilities; the mesh's
    # masters split over data (the distributed optimizer), the sampler reading their working copy
    mesh = run(_grpo_cfg(grpo_data, dict(data=2, fsdp=2, tensor=2), steps=3, train=dict(logit_chunks=4),
                         optimizer=dict(distributed=True)), str(tmp_path / "mesh"), use_tqdm=False)
    for key in ("loss", "grad_norm", "grpo/reward", "grpo/kl", "grpo/ratio"):
        np.testing.assert_allclose([h[key] for h in mesh.history], [h[key] for h in one.history], rtol=1e-5,
                                   atol=1e-5, err_msg=key)


@pytest.mark.parametrize("override, message", [
    ("--config.rl.group_size=1", "a group needs at least 2"),
    ("--config.rl.reward=no_such_module_anywhere:score", "cannot be imported"),
    ("--config.rl.reward={rewards}:absent", "has no function 'absent'"),
    ("--config.rl.reward={rewards}:text", "not a finite number"),
    ("--config.rl.reward={rewards}:broken", "raised KeyError"),
])
def test_bad_rl_input_is_one_sentence_exit_2_and_leaves_no_workdir(grpo_data, tmp_path, capsys, override, message):
    base, store, rewards = grpo_data
    workdir = tmp_path / "run"
    argv = ["train", "--config=configs/default.py", f"--workdir={workdir}", f"--config.train.init_from={base}",
            "--config.model.embed_dim=64", "--config.model.num_layers=2", "--config.model.mlp_dim=128",
            "--config.model.attention.num_heads=4", "--config.model.max_seq_len=128", "--config.data.prepare=",
            f"--config.data.path={store}", "--config.data.seq_len=64", "--config.data.validation_fraction=0",
            "--config.train.objective=grpo", "--config.train.global_batch_size=8", "--config.train.steps=2",
            "--config.rl.group_size=4", "--config.rl.max_new_tokens=8", f"--config.rl.reward={rewards}:score",
            override.format(rewards=rewards)]
    assert message in refused(capsys, argv)
    assert not workdir.exists()


def test_the_arithmetic_task_asks_every_sum_and_rewards_the_bare_number_alone():
    """The example's task: every sum below LIMIT asked once, one answer in four bare; the reward wants the number."""
    from jaxtron.data import arithmetic
    chats, prompts = arithmetic.conversations(), arithmetic.prompts()
    pairs = {(r["a"], r["b"]) for r in prompts}
    assert len(chats) == len(prompts) == len(pairs) == arithmetic.LIMIT ** 2
    answers = [chat["messages"][1]["content"] for chat in chats]
    assert sum(a.isdigit() for a in answers) == len(answers) // 4
    record = prompts[0]
    total = str(record["a"] + record["b"])
    assert [arithmetic.reward("", text, record) for text in (f" {total}\n", f"{total} ({record['a']} + {record['b']})",
                                                               str(int(total) + 1), "")] == [1.0, 0.0, 0.0, 0.0]


@pytest.mark.integration
@pytest.mark.slow
def test_the_grpo_example_raises_its_reward(tmp_path):
    """configs/grpo.py as the README's post-training page runs it: the fine-tuned base, then GRPO. The mean reward
    of the last quarter of logged steps beats the first quarter's by 0.15 or more."""
    from helpers import learning_run, metrics_lines
    sft = learning_run("grpo.py:sft", tmp_path / "sft", 1, f"--config.data.path={tmp_path / 'chat'}")
    assert sft.returncode == 0, sft.stderr[-2000:]
    proc = learning_run("grpo.py", tmp_path / "grpo", 1, f"--config.train.init_from={tmp_path / 'sft'}",
                        f"--config.data.path={tmp_path / 'prompts'}")
    assert proc.returncode == 0, proc.stderr[-2000:]
    rewards = [line["grpo/reward"] for line in metrics_lines(tmp_path / "grpo") if "grpo/reward" in line]
    quarter = len(rewards) // 4
    assert np.mean(rewards[-quarter:]) - np.mean(rewards[:quarter]) >= 0.15, rewards
    assert os.path.isdir(tmp_path / "grpo" / "checkpoints")
