"""Writes tests/fixtures/lmeval/: a tokenizer for the tiny Llama fixture and lm-eval's Hugging Face results on it.

    pip install torch transformers "lm-eval[hf]" && python scripts/lmeval_fixtures.py

tokenizer.json (+ tokenizer_config.json) holds 96 tokens, the fixture model's vocabulary: three special tokens and
characters. hf_results.json holds what lm-eval's own Hugging Face model (``--model hf``: transformers on the CPU, in
float32) gives on the fixture tasks in tests/fixtures/lmeval/tasks for tests/fixtures/hf/llama with that tokenizer:
each task's metrics and each sample's responses (loglikelihoods, generated text). The tests run jaxtron's model on
the same checkpoint, converted, and compare (CI needs neither torch nor transformers).
"""

import json
import os
import shutil
import string
import tempfile

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "fixtures")
HERE = os.path.join(ROOT, "lmeval")
TASKS = ["jaxtron_sums", "jaxtron_count", "jaxtron_text"]


def write_tokenizer(directory: str) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    specials = ["<unk>", "<s>", "</s>"]
    symbols = specials + [" ", "\n"] + list(string.ascii_letters + string.digits + string.punctuation)
    tokenizer = Tokenizer(models.WordLevel({t: i for i, t in enumerate(symbols[:96])}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    tokenizer.add_special_tokens(specials)
    tokenizer.save(os.path.join(directory, "tokenizer.json"))
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
                   "unk_token": "<unk>", "model_max_length": 128}, f, indent=1)


def main() -> None:
    import lm_eval
    import transformers
    from lm_eval.tasks import TaskManager

    write_tokenizer(HERE)
    with tempfile.TemporaryDirectory() as tmp:  # the model with the tokenizer beside it, as lm-eval loads it
        for name in os.listdir(os.path.join(ROOT, "hf", "llama")):
            if name.endswith((".json", ".safetensors")):
                shutil.copy(os.path.join(ROOT, "hf", "llama", name), tmp)
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(os.path.join(HERE, name), tmp)
        results = lm_eval.simple_evaluate(
            model="hf", model_args=f"pretrained={tmp},dtype=float32", device="cpu", batch_size=4, tasks=TASKS,
            task_manager=TaskManager(include_path=os.path.join(HERE, "tasks"), include_defaults=False),
            bootstrap_iters=0, log_samples=True)
    out = {"lm_eval": lm_eval.__version__, "transformers": transformers.__version__, "tasks": {}}
    for task in TASKS:
        out["tasks"][task] = {
            "metrics": {k: float(v) for k, v in results["results"][task].items() if isinstance(v, (int, float))},
            "samples": [{"doc_id": s["doc_id"], "resps": s["resps"]} for s in results["samples"][task]]}
    with open(os.path.join(HERE, "hf_results.json"), "w") as f:
        json.dump(out, f, indent=1, default=float)
    print(json.dumps({t: v["metrics"] for t, v in out["tasks"].items()}, indent=1))


if __name__ == "__main__":
    main()
