"""DPO: pair stores, the loss against its definition, resume, meshes, LoRA's reference and the refusals."""

from __future__ import annotations

import json
import os

import jax
import numpy as np
import pytest
from helpers import refused, tiny_config

from jaxtron import cli
from jaxtron.data.chat import PLAIN_TEMPLATE

PAIR_TASK = [(a, b) for a in range(1, 16) for b in range(a + 2, 16)]


def _count(a: int, b: int, skip: int | None = None) -> str:
    return ", ".join(str(x) for x in range(a, b + 1) if x != skip) + "."


def _write(path, records) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def _pair_store(tmp_path, records=None) -> str:
    """Counting pairs: the whole count chosen, the count missing its middle number rejected."""
    records = records or [{"prompt": f"Count from {a} to {b}.", "chosen": _count(a, b),
                           "rejected": _count(a, b, (a + b) // 2)} for a, b in PAIR_TASK]
    template = tmp_path / "plain.jinja"
    template.write_text(PLAIN_TEMPLATE)
    store = str(tmp_path / "pairs")
    assert cli.main(["prepare", "--input", _write(tmp_path / "pairs.jsonl", records), "--tokenizer", "byte",
                     "--output", store, "--pairs", "--chat-template", str(template)]) == 0
    return store


@pytest.fixture(scope="module")
def dpo_data(tmp_path_factory):
    """A base run (one step of the tiny model) and a counting pair store."""
    from jaxtron.training.loop import run
    tmp = tmp_path_factory.mktemp("dpo")
    base = str(tmp / "base")
    run(tiny_config(train=dict(steps=1), checkpoint=dict(every=0)), base, use_tqdm=False, devices=jax.devices()[:1])
    return base, _pair_store(tmp)


def _dpo_cfg(data, mesh=None, steps=4, **sections):
    base, store = data
    train = dict(steps=steps, global_batch_size=8, log_every=1, init_from=base, objective="dpo", eval_batches=0)
    # the schedule's length fixed (optimizer.decay_steps), so that a resumed run may raise train.steps
    return tiny_config(mesh, train={**train, **sections.pop("train", {})}, model=dict(max_seq_len=128),
                       optimizer=dict(learning_rate=3e-3, warmup_steps=1, decay_steps=8,
                                      **sections.pop("optimizer", {})),
                       data=dict(source="store", path=store, seq_len=96, validation_fraction=0.1),
                       **{"checkpoint": dict(every=0), **sections})


def test_a_pair_store_holds_both_sides_with_loss_on_the_final_response_alone(tmp_path):
    from jaxtron.data.pairs import PairSplit
    from jaxtron.data.store import TokenStore
    records = [{"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"},
                             {"role": "user", "content": "Name a colour."}],
                "chosen": [{"role": "assistant", "content": "Blue."}], "rejected": {"content": "Seven."}},
               {"prompt": "Say yes.", "chosen": "Yes.", "rejected": "No."}]
    store = TokenStore(_pair_store(tmp_path, records))
    assert store.manifest["pairs"] and store.num_documents == 4
    split = PairSplit(store, 128, "train", 0.0, seed=0)
    rows = split.rows(np.arange(4))
    for row in range(4):
        text = bytes(rows["targets"][row][rows["loss_mask"][row] == 1].astype(np.uint8)).decode()
        whole = bytes(rows["inputs"][row][rows["inputs"][row] > 0].astype(np.uint8)).decode()
        reply = whole.rsplit("<|assistant|>\n", 1)[1]
        # the final reply and its end-of-turn marker, not "Hello" (an earlier turn) nor the prompt
        assert text == reply.split("<|end|>")[0] + "<|end|>\n", (text, whole)
        assert text in {"Blue.<|end|>\n", "Seven.<|end|>\n", "Yes.<|end|>\n", "No.<|end|>\n"}
    # each pair's sides are rows 2p and 2p + 1: the same prompt, chosen first
    for pair in range(2):
        chosen, rejected = (bytes(rows["inputs"][2 * pair + s].astype(np.uint8)).decode() for s in range(2))
        assert chosen.rsplit("<|assistant|>", 1)[0] == rejected.rsplit("<|assistant|>", 1)[0]
        assert any(word in chosen for word in ("Blue.", "Yes.")) and any(w in rejected for w in ("Seven.", "No."))


@pytest.mark.slow
def test_the_dpo_loss_is_its_definition_against_a_reference(dpo_data):
    """The pairs' loss -log sigmoid(beta * margin) from per-token log-softmax in numpy, for a policy and a
    different reference; with the policy as its own reference the loss is log 2 and the margin 0."""
    from flax import nnx

    from jaxtron.config.schema import DpoConfig
    from jaxtron.data.pairs import PairSplit
    from jaxtron.data.store import TokenStore
    from jaxtron.models import build_model
    from jaxtron.training.preference import dpo_sums

    cfg = _dpo_cfg(dpo_data)
    batch = {k: jax.numpy.asarray(v) for k, v in
             PairSplit(TokenStore(dpo_data[1]), 96, "train", 0.1, 0).rows(np.arange(8)).items()}
    graphdef, policy = nnx.split(build_model(cfg.model, cfg.execution, 0), nnx.Param)
    reference = nnx.split(build_model(cfg.model, cfg.execution, 1), nnx.Param)[1]

    def logps(params):
        logits = np.asarray(nnx.merge(graphdef, params)(batch["inputs"], batch["positions"]).logits(), np.float64)
        logits -= logits.max(-1, keepdims=True)
        log_softmax = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
        picked = np.take_along_axis(log_softmax, np.asarray(batch["targets"])[..., None], -1)[..., 0]
        return (picked * np.asarray(batch["loss_mask"])).sum(-1).reshape(-1, 2)

    dpo = DpoConfig(beta=0.3, label_smoothing=0.1)
    total, (_, pairs, metrics) = dpo_sums(policy, graphdef, batch, dpo, reference)
    p, r = logps(policy), logps(reference)
    margin = dpo.beta * ((p[:, 0] - r[:, 0]) - (p[:, 1] - r[:, 1]))
    want = -(0.9 * np.log(1 / (1 + np.exp(-margin))) + 0.1 * np.log(1 / (1 + np.exp(margin))))
    assert float(pairs) == 4
    np.testing.assert_allclose(float(total), want.sum(), rtol=1e-5)
    np.testing.assert_allclose(float(metrics["dpo/chosen_logp"]), p[:, 0].mean(), rtol=1e-5)
    np.testing.assert_allclose(float(metrics["dpo/margin"]), margin.mean(), rtol=1e-4, atol=1e-5)
    assert float(metrics["dpo/train_accuracy"]) == np.mean(margin > 0)
    same, (_, _, even) = dpo_sums(policy, graphdef, batch, DpoConfig(), policy)
    np.testing.assert_allclose(float(same), 4 * np.log(2), rtol=1e-6)
    assert float(even["dpo/margin"]) == 0.0 and float(even["dpo/train_accuracy"]) == 0.0


def _params(summary) -> list[np.ndarray]:
    return [np.asarray(x) for x in jax.tree.leaves(summary.state.params)]


@pytest.mark.slow
def test_dpo_resumes_bit_exactly_and_keeps_its_reference_out_of_checkpoints(dpo_data, tmp_path):
    from jaxtron.training.loop import run
    one = jax.devices()[:1]
    straight = run(_dpo_cfg(dpo_data, steps=8), str(tmp_path / "straight"), use_tqdm=False, devices=one)
    saving = dict(every=4)
    first = run(_dpo_cfg(dpo_data, steps=4, checkpoint=saving), str(tmp_path / "run"), use_tqdm=False, devices=one)
    resumed = run(_dpo_cfg(dpo_data, steps=8, checkpoint=saving), str(tmp_path / "run"), use_tqdm=False, devices=one)
    losses = [h["loss"] for h in first.history + resumed.history]
    assert losses == [h["loss"] for h in straight.history]
    for a, b in zip(_params(straight), _params(resumed), strict=True):
        np.testing.assert_array_equal(a, b)
    assert losses[0] == pytest.approx(np.log(2), rel=1e-6)  # the policy starts as its reference
    assert losses[-1] < losses[0]
    # the reference stayed train.init_from's parameters, and no checkpoint holds a second copy of them
    for a, b in zip(jax.tree.leaves(resumed.state.reference), jax.tree.leaves(first.state.reference), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    with open(os.path.join(tmp_path, "run", "checkpoints", "8", "state", "_METADATA")) as f:
        saved = list(json.load(f)["tree_metadata"])
    assert any(k.startswith("('params', ") for k in saved)
    assert not [k for k in saved if k.startswith("('reference', ")]  # an empty field: no array under it


@pytest.mark.slow
@pytest.mark.extended  # a mesh: the extended tier's (the first tier's time); the first keeps the resume
def test_dpo_on_a_data_fsdp_tensor_mesh_equals_one_device(dpo_data, tmp_path):
    from jaxtron.training.loop import run
    cfg = dict(train=dict(microbatches=2))
    one = run(_dpo_cfg(dpo_data, **cfg), str(tmp_path / "one"), use_tqdm=False, devices=jax.devices()[:1])
    # the mesh's masters split over data (the distributed optimizer); its reference placed as its rules say
    mesh = run(_dpo_cfg(dpo_data, dict(data=2, fsdp=2, tensor=2), optimizer=dict(distributed=True), **cfg),
               str(tmp_path / "mesh"), use_tqdm=False)
    # every step's loss, gradient norm and metrics: the parameters after each update agree as well
    for key in ("loss", "grad_norm", "dpo/margin", "dpo/chosen_logp", "dpo/rejected_logp"):
        np.testing.assert_allclose([h[key] for h in mesh.history], [h[key] for h in one.history], rtol=1e-5,
                                   atol=1e-5, err_msg=key)
    assert one.history[-1]["loss"] < one.history[0]["loss"]


@pytest.mark.slow
def test_lora_dpo_takes_the_base_without_adapters_as_its_reference(dpo_data, tmp_path):
    """No reference copy in the state; the first loss is log 2 (the adapters start at zero); the held-out pairs'
    accuracy and margin are logged at each evaluation."""
    from jaxtron.training.loop import run
    cfg = _dpo_cfg(dpo_data, steps=6, lora=dict(rank=4, targets="q,v,o,down"),
                   train=dict(eval_every=3, eval_batches=2))
    summary = run(cfg, str(tmp_path / "lora"), use_tqdm=False, devices=jax.devices()[:1])
    assert summary.state.reference is None
    assert summary.history[0]["loss"] == pytest.approx(np.log(2), rel=1e-6)
    assert summary.history[-1]["loss"] < summary.history[0]["loss"]
    from helpers import metrics_lines
    lines = [line for line in metrics_lines(tmp_path / "lora") if "dpo/accuracy" in line]
    assert [line["step"] for line in lines] == [3, 6]
    assert all(0 <= line["dpo/accuracy"] <= 1 and "eval/dpo_margin" in line for line in lines)


@pytest.mark.parametrize("record, message", [
    ({"prompt": "Say yes.", "chosen": "Yes."}, "has no 'rejected' response"),
    ({"prompt": "Say yes.", "chosen": 3, "rejected": "No."}, "'chosen' is not a text"),
    ({"chosen": "Yes.", "rejected": "No."}, "has no 'prompt'"),
    ({"prompt": "Say yes.", "chosen": [{"role": "user", "content": "Yes."}], "rejected": "No."},
     "ending with the assistant's"),
])
def test_bad_pair_records_are_one_sentence_and_exit_2(tmp_path, capsys, record, message):
    template = tmp_path / "plain.jinja"
    template.write_text(PLAIN_TEMPLATE)
    data = _write(tmp_path / "pairs.jsonl", [{"prompt": "Hi", "chosen": "Hello.", "rejected": "Go."}, record])
    err = refused(capsys, ["prepare", "--input", data, "--tokenizer", "byte", "--output", str(tmp_path / "out"),
                            "--pairs", "--chat-template", str(template)])
    assert message in err and "line 2" in err, err
    assert not os.path.exists(tmp_path / "out")


def test_a_pair_store_and_the_objective_must_agree(dpo_data, tmp_path, capsys):
    base, store = dpo_data
    common = ["train", "--config=configs/default.py", f"--config.train.init_from={base}", "--config.train.steps=1",
              "--config.model.embed_dim=64", "--config.model.num_layers=2", "--config.model.mlp_dim=128",
              "--config.model.attention.num_heads=4", "--config.data.seq_len=96", "--config.data.prepare="]
    err = refused(capsys, [*common, f"--workdir={tmp_path / 'lm'}", f"--config.data.path={store}"])
    assert "holds chosen/rejected pairs" in err and "train.objective='dpo'" in err
    assert not os.path.exists(tmp_path / "lm")
    plain = str(tmp_path / "plain")
    (tmp_path / "a.txt").write_text("some text " * 200)
    assert cli.main(["prepare", "--input", str(tmp_path / "a.txt"), "--tokenizer", "byte", "--output", plain]) == 0
    err = refused(capsys, [*common, f"--workdir={tmp_path / 'dpo'}", f"--config.data.path={plain}",
                            "--config.train.objective=dpo"])
    assert "holds no chosen/rejected pairs" in err and "--pairs" in err
    err = refused(capsys, [*common[:2], "--config.train.objective=dpo", f"--workdir={tmp_path / 'x'}"])
    assert "train.init_from" in err
    err = refused(capsys, [*common, f"--workdir={tmp_path / 'odd'}", f"--config.data.path={store}",
                            "--config.train.objective=dpo", "--config.train.global_batch_size=6",
                            "--config.train.microbatches=2"])
    assert "two a pair" in err


@pytest.mark.integration
@pytest.mark.slow
def test_the_dpo_example_raises_held_out_accuracy(tmp_path):
    """configs/dpo.py from a fresh workdir, on a shortened chain of its bases (the main job, then SFT): held-out
    dpo/accuracy ends at 0.75 or more, above its first value."""
    from helpers import learning_run, metrics_lines
    stores = tmp_path / "stores"
    base = learning_run("default.py", tmp_path / "default", 1, "--config.train.steps=150",
                        f"--config.data.path={stores / 'stdlib'}")
    assert base.returncode == 0, base.stderr[-2000:]
    sft = learning_run("sft.py", tmp_path / "sft", 1, "--config.train.steps=150",
                       f"--config.train.init_from={tmp_path / 'default'}", f"--config.data.path={stores / 'chat'}")
    assert sft.returncode == 0, sft.stderr[-2000:]
    dpo = learning_run("dpo.py", tmp_path / "dpo", 1, f"--config.train.init_from={tmp_path / 'sft'}",
                       f"--config.data.path={stores / 'pairs'}")
    assert dpo.returncode == 0, dpo.stderr[-2000:]
    accuracy = [line["dpo/accuracy"] for line in metrics_lines(tmp_path / "dpo") if "dpo/accuracy" in line]
    assert len(accuracy) == 15 and accuracy[-1] >= 0.75 and accuracy[-1] > accuracy[0], accuracy
