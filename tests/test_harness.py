"""lm-evaluation-harness: jaxtron's model scores local tasks as lm-eval's own Hugging Face model does."""

import json
import os
import shutil

import jax
import numpy as np
import pytest

lm_eval = pytest.importorskip("lm_eval")

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")
TASKS = os.path.join(FIXTURES, "lmeval", "tasks")


@pytest.fixture(scope="module", autouse=True)
def offline(tmp_path_factory):
    """No network, and the datasets cache in a temporary directory."""
    saved = {k: os.environ.get(k) for k in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE", "HF_HOME")}
    os.environ.update(HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path_factory.mktemp("hf_home")))
    yield
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """The tiny Llama fixture with its 96-token tokenizer, converted to jaxtron (tokenizer files copied along)."""
    from jaxtron.interop import convert

    root = tmp_path_factory.mktemp("lmeval")
    shutil.copytree(os.path.join(FIXTURES, "hf", "llama"), root / "hf")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(FIXTURES, "lmeval", name), root / "hf")
    convert.from_hf(str(root / "hf"), str(root / "converted"))
    return str(root / "converted")


def _evaluate(lm, tasks):
    from lm_eval.tasks import TaskManager

    return lm_eval.simple_evaluate(model=lm, tasks=tasks, bootstrap_iters=0, log_samples=True,
                                   task_manager=TaskManager(include_path=TASKS, include_defaults=False))


@pytest.mark.slow
def test_local_tasks_score_as_with_lm_evals_hugging_face_model(converted):
    """Multiple choice (loglikelihood), generation (generate_until) and perplexity (loglikelihood_rolling) tasks on
    the converted checkpoint give lm-eval's Hugging Face model's per-sample results on the original one
    (hf_results.json, written by scripts/lmeval_fixtures.py): loglikelihoods to 1e-5, the same greedy flags, the
    same generated text, the same accuracy."""
    from jaxtron.inference.harness import JaxtronLM

    with open(os.path.join(FIXTURES, "lmeval", "hf_results.json")) as f:
        want = json.load(f)["tasks"]
    results = _evaluate(JaxtronLM(run=converted, batch_size=4), list(want))
    for task, expected in want.items():
        samples = sorted(results["samples"][task], key=lambda s: s["doc_id"])
        assert len(samples) == len(expected["samples"]) > 0
        for got, ref in zip(samples, expected["samples"], strict=True):
            for a, b in zip(got["resps"], ref["resps"], strict=True):
                if isinstance(b[0], str):
                    assert a[0] == b[0], (task, got["doc_id"])
                elif isinstance(b[0], list):  # (loglikelihood, is_greedy)
                    np.testing.assert_allclose(a[0][0], b[0][0], rtol=1e-5, err_msg=task)
                    assert bool(a[0][1]) == b[0][1]
                else:
                    np.testing.assert_allclose(a[0], b[0], rtol=1e-5, err_msg=task)
        for metric, value in expected["metrics"].items():
            if metric != "sample_len":
                np.testing.assert_allclose(float(results["results"][task][metric]), value, rtol=1e-5)
    assert results["results"]["jaxtron_sums"]["acc,none"] == want["jaxtron_sums"]["metrics"]["acc,none"]
    # and the checkpoint exported back to Hugging Face is the one lm-eval's model scored, tensor for tensor
    from jaxtron.interop import convert
    from jaxtron.interop.hf.safetensors import ModelFiles

    exported = os.path.join(os.path.dirname(converted), "exported")
    convert.to_hf(converted, exported)
    original, written = ModelFiles(os.path.join(FIXTURES, "hf", "llama")), ModelFiles(exported)
    assert sorted(written.names()) == sorted(original.names())
    for name in original.names():
        np.testing.assert_array_equal(written.read(name), original.read(name), err_msg=name)


@pytest.mark.slow
def test_loglikelihoods_equal_jaxtrons_own_scoring(converted):
    """A request's loglikelihood is the sum of the model's own log-softmax at the continuation's tokens, in batches
    of mixed lengths; a sequence beyond max_seq_len keeps its end."""
    import jax.numpy as jnp
    from lm_eval.api.instance import Instance

    from jaxtron.inference.generate import load_model
    from jaxtron.inference.harness import JaxtronLM

    lm = JaxtronLM(run=converted, batch_size=3)
    model, _ = load_model(converted)
    pairs = [("Question: 2 + 3 =\nAnswer:", " 5"), ("ab", "c"), ("Hello", " world!"), ("x" * 200, " yz"),
             ("1 2 3", " 4 5")]
    got = lm.loglikelihood([Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(pairs)])
    for (context, continuation), (logp, greedy) in zip(pairs, got, strict=True):
        ids = lm.tok_encode(context + continuation)[-(model.cfg.max_seq_len + 1):]
        n = len(lm.tok_encode(continuation))
        logits = np.asarray(model(jnp.asarray([ids[:-1]], jnp.int32)).logits()[0], np.float64)
        logsoftmax = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
            - logits.max(-1, keepdims=True)
        picked = logsoftmax[np.arange(len(ids) - 1), ids[1:]][-n:]
        np.testing.assert_allclose(logp, picked.sum(), rtol=1e-5)
        assert greedy == bool((logits.argmax(-1)[-n:] == np.asarray(ids[1:])[-n:]).all())


def test_generation_keeps_a_long_prompts_end_and_the_models_length(converted):
    """A prompt longer than max_seq_len keeps its end; more new tokens than the model holds are cut to fit."""
    from lm_eval.api.instance import Instance

    from jaxtron.inference.harness import JaxtronLM

    lm = JaxtronLM(run=converted, batch_size=2)
    requests = [Instance("generate_until", {}, ("x" * 300, {"until": ["\n"], "max_gen_toks": 500}), 0),
                Instance("generate_until", {}, ("ab", {"until": ["b"], "max_gen_toks": 4}), 1)]
    long, short = lm.generate_until(requests)
    assert isinstance(long, str) and len(lm.tok_encode(long)) <= 127
    assert len(lm.tok_encode(short)) <= 4 and "b" not in short


def test_a_sharded_model_scores_as_one_device(converted):
    from jaxtron.inference.harness import JaxtronLM

    one = _evaluate(JaxtronLM(run=converted, batch_size=4), ["jaxtron_sums"])
    eight = _evaluate(JaxtronLM(run=converted, batch_size=4, mesh="tensor=2,fsdp=4"), ["jaxtron_sums"])
    assert len(jax.devices()) >= 8
    a = [s["resps"] for s in sorted(one["samples"]["jaxtron_sums"], key=lambda s: s["doc_id"])]
    b = [s["resps"] for s in sorted(eight["samples"]["jaxtron_sums"], key=lambda s: s["doc_id"])]
    np.testing.assert_allclose(np.array([[r[0][0] for r in x] for x in a]),
                               np.array([[r[0][0] for r in x] for x in b]), rtol=1e-5)


@pytest.mark.integration
@pytest.mark.slow
def test_jaxtron_lm_eval_runs_local_tasks_end_to_end(converted, tmp_path, capsys):
    """`jaxtron lm-eval --model jaxtron ...` is lm-eval's command line: it writes the results file."""
    from jaxtron import cli

    assert cli.main(["lm-eval", "--model", "jaxtron", "--model_args", f"run={converted}", "--tasks",
                     "jaxtron_sums,jaxtron_count", "--include_path", TASKS, "--batch_size", "4",
                     "--output_path", str(tmp_path / "out")]) == 0
    found = [os.path.join(d, f) for d, _, files in os.walk(tmp_path / "out") for f in files if f.endswith(".json")]
    assert found
    with open(found[0]) as f:
        results = json.load(f)["results"]
    assert set(results) == {"jaxtron_sums", "jaxtron_count"} and 0 <= results["jaxtron_sums"]["acc,none"] <= 1
    assert "jaxtron_sums" in capsys.readouterr().out


@pytest.mark.slow
@pytest.mark.integration
def test_lm_evals_own_api_finds_the_model_by_name_after_one_import(converted):
    import subprocess
    import sys

    code = ("import jaxtron.inference.harness; from lm_eval.api.registry import model_registry; "
            "print('jaxtron' in model_registry)")
    registered = subprocess.run([sys.executable, "-c", code],
                                capture_output=True, text=True, timeout=300, check=False)
    assert registered.stdout.strip() == "True", registered.stderr[-2000:]
    from lm_eval.tasks import TaskManager

    import jaxtron.inference.harness  # noqa: F401 - the one import: it registers the name
    results = lm_eval.simple_evaluate(model="jaxtron", model_args=f"run={converted}", tasks=["jaxtron_sums"],
                                      bootstrap_iters=0, task_manager=TaskManager(include_path=TASKS,
                                                                                  include_defaults=False))
    assert 0 <= results["results"]["jaxtron_sums"]["acc,none"] <= 1


@pytest.mark.slow  # lm-eval's import and task loading: 34 s on a slow 2-core machine
@pytest.mark.integration
def test_a_task_that_cannot_load_is_one_sentence_with_exit_2(converted, tmp_path, capsys):
    from jaxtron import cli

    args = ["lm-eval", "--model", "jaxtron", "--model_args", f"run={converted}", "--include_path"]
    assert cli.main([*args, TASKS, "--tasks", "jaxtron_sums,no_such_task"]) == 2
    err = capsys.readouterr().err
    assert err.splitlines()[-1] == ("error: lm-eval knows no task no_such_task; list its tasks with `jaxtron "
                                    "lm-eval --tasks list`, or pass --include_path DIR holding the task's YAML.")
    hub = tmp_path / "tasks"
    hub.mkdir()
    (hub / "hub.yaml").write_text("task: needs_the_hub\ndataset_path: nobody/not_on_this_machine\n"
                                  "test_split: test\noutput_type: multiple_choice\ndoc_to_text: '{{q}}'\n"
                                  "doc_to_target: 0\ndoc_to_choice: ['a', 'b']\n")
    assert cli.main([*args, str(hub), "--tasks", "needs_the_hub"]) == 2
    err = capsys.readouterr().err
    # (a handler lm-eval's command line set up in an earlier test may log to a closed stream: not this command's)
    assert "Traceback" not in err.replace("--- Logging error ---\nTraceback", "")
    assert err.splitlines()[-1].startswith("error: a task's data cannot be loaded here (")


def test_bad_lm_eval_input_is_one_sentence(tmp_path):
    from jaxtron.config.schema import ConfigError
    from jaxtron.inference.harness import JaxtronLM

    with pytest.raises(ConfigError, match="needs run=DIR"):
        JaxtronLM()
    with pytest.raises(ConfigError, match="is not a directory; pass a training run or a converted model"):
        JaxtronLM(run=str(tmp_path / "nothing"))


@pytest.fixture(scope="module")
def byte_store(tmp_path_factory):
    from jaxtron.data.prepare import prepare

    root = tmp_path_factory.mktemp("text")
    for i in range(12):
        (root / f"{i}.txt").write_text(f"Question: {i} + {i} =\nAnswer: {2 * i}\n" * 20)
    prepare([str(root / "*.txt")], "byte", str(root / "store"))
    return str(root / "store")


@pytest.mark.slow
def test_train_eval_tasks_are_scored_beside_the_validation_loss(byte_store, tmp_path):
    """train.eval_tasks runs during training every train.eval_every steps and at the end; the scores logged at the
    end equal lm-eval's scores of the run's final checkpoint."""
    from helpers import metrics_lines, tiny_config

    from jaxtron.inference.downstream import task_hook
    from jaxtron.inference.harness import JaxtronLM
    from jaxtron.training.loop import run

    cfg = tiny_config(model=dict(max_seq_len=128),
                      train=dict(steps=4, eval_every=2, eval_batches=1, eval_tasks="jaxtron_sums,jaxtron_count",
                                 eval_tasks_path=TASKS, eval_tasks_limit=4),
                      data=dict(source="store", path=byte_store, seq_len=32), checkpoint=dict(every=0))
    summary = run(cfg, str(tmp_path / "run"), use_tqdm=False, devices=jax.devices()[:1], hooks=task_hook(cfg))
    lines = [line for line in metrics_lines(tmp_path / "run") if "eval/jaxtron_sums/acc" in line]
    assert [line["step"] for line in lines] == [2, 4]
    assert all("eval/jaxtron_count/exact_match" in line for line in lines)
    validated = [line["step"] for line in metrics_lines(tmp_path / "run") if "eval/loss" in line]
    assert validated == [2, 4]  # beside the validation loss of the same steps
    assert summary.data["eval/jaxtron_sums/acc"] == lines[-1]["eval/jaxtron_sums/acc"]
    from lm_eval.tasks import TaskManager  # the same four documents the run scored
    again = lm_eval.simple_evaluate(model=JaxtronLM(run=str(tmp_path / "run")), tasks=["jaxtron_sums"], limit=4,
                                    bootstrap_iters=0, task_manager=TaskManager(include_path=TASKS,
                                                                                include_defaults=False))
    assert again["results"]["jaxtron_sums"]["acc,none"] == lines[-1]["eval/jaxtron_sums/acc"]


def test_bad_eval_tasks_are_one_sentence(byte_store, tmp_path):
    from helpers import tiny_config

    from jaxtron.config.schema import ConfigError
    from jaxtron.training.loop import run

    with pytest.raises(ConfigError, match="train.eval_tasks_path.*is not a directory"):
        tiny_config(train=dict(eval_tasks="x", eval_tasks_path=str(tmp_path / "none")))
    with pytest.raises(ConfigError, match="needs a tokenizer, but data.source is not 'store'"):
        tiny_config(train=dict(eval_tasks="x", eval_tasks_path=TASKS))
    cfg = tiny_config(train=dict(steps=1, eval_tasks="jaxtron_sums,nope", eval_tasks_path=TASKS),
                      data=dict(source="store", path=byte_store, seq_len=32))
    from jaxtron.inference.downstream import task_hook
    with pytest.raises(ConfigError, match="names 'nope', not a task of the YAML files in train.eval_tasks_path"):
        run(cfg, str(tmp_path / "run"), use_tqdm=False, devices=jax.devices()[:1], hooks=task_hook(cfg))
    with pytest.raises(ConfigError, match="is set but no hook of this run scores it"):
        run(cfg, str(tmp_path / "run2"), use_tqdm=False, devices=jax.devices()[:1])
