"""Writes the Hugging Face parity fixtures under tests/fixtures/hf/ with transformers and torch.

    pip install torch transformers && python scripts/hf_fixtures.py [NAME ...]   # all, or only those models
    python scripts/hf_fixtures.py --greedy [NAME ...]   # only greedy.npy, from the models already saved
    python scripts/hf_fixtures.py --logits [NAME ...]   # only logits.npy, from the models already saved

Tests only read the files this writes (CI needs neither torch nor transformers). Each model is tiny and
random, saved by transformers itself, with the logits its own forward pass gives on tokens.npy in float64,
rounded to float32 (the exact value, against which jaxtron's float32 pass is compared). The
fixtures are those the families declare (``Family.fixtures`` in jaxtron/families/): each names its
transformers config's arguments, its seed, its shard size and whether config.json is rewritten in the
transformers 4.x form. tests/test_families.py checks that each config.json holds what its declaration says.
Each model gets its own seed, so writing some leaves the others as they are. Beside each model, greedy.npy holds the
8 tokens transformers' ``generate`` continues the first 8 tokens of each row of tokens.npy with, greedily (no
end-of-document stop), read from the saved model (``--greedy`` writes only these).
"""

import json
import os
import shutil
import sys

import numpy as np
import torch
import transformers

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from jaxtron import families  # the checkout's package, not an installed one
from jaxtron.families.llama import VOCAB

OUT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests", "fixtures", "hf")
FIXTURES = {f.name: (family, f) for family in families.all_families().values() for f in family.fixtures}


def build(model_type: str, config: dict) -> transformers.PreTrainedModel:
    """The family's transformers model of the declared config, with eager attention (the reference math)."""
    hf = transformers.AutoConfig.for_model(model_type, **config, attn_implementation="eager")
    return transformers.AutoModelForCausalLM.from_config(hf)


def to_v4(path: str) -> None:
    """Rewrites config.json with transformers 4.x RoPE fields (what older Hub checkpoints carry)."""
    with open(path) as f:
        config = json.load(f)
    rope = config.pop("rope_parameters")
    config["rope_theta"] = rope.pop("rope_theta")
    config["rope_scaling"] = rope if rope.get("rope_type", "default") != "default" else None
    config["transformers_version"] = "4.46.0"
    with open(path, "w") as f:
        json.dump(config, f, indent=2)


def tokens_of(fixture) -> np.ndarray:
    """The fixture's token rows: tokens.npy's 24, or its own longer ones (written once, then read)."""
    path = os.path.join(OUT, fixture.tokens_file)
    if not os.path.exists(path):
        seed = 0 if fixture.length == 24 else fixture.length
        np.save(path, np.random.default_rng(seed).integers(0, VOCAB, size=(2, fixture.length)).astype(np.int32))
    return np.load(path)


def greedy(name: str) -> None:
    """greedy.npy of a saved fixture: transformers' greedy continuation of each token row's first
    ``fixture.prompt`` tokens (8 of tokens.npy's 24) by 8 tokens."""
    directory = os.path.join(OUT, name)
    fixture = FIXTURES[name][1]
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    prompt = torch.from_numpy(tokens_of(fixture)[:, :fixture.prompt]).long()
    with torch.no_grad():
        out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=8, min_new_tokens=8,
                             do_sample=False, eos_token_id=None, pad_token_id=0)
    continuation = out[:, prompt.shape[1]:].numpy().astype(np.int32)
    np.save(os.path.join(directory, "greedy.npy"), continuation)
    print(name, "greedy", continuation.tolist())


def reference_logits(name: str) -> None:
    """logits.npy of a saved fixture: transformers' forward pass in float64 (experts run eagerly, which float64
    needs), rounded to float32. transformers' own float32 pass is off the exact value by up to 6.4e-5 on Qwen3.5's
    chunked rule, most of the parity tests' 1e-4."""
    directory = os.path.join(OUT, name)
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float64,
                                                              experts_implementation="eager").eval()
    with torch.no_grad():
        logits = model(torch.from_numpy(tokens_of(FIXTURES[name][1])).long()).logits.numpy()
    np.save(os.path.join(directory, "logits.npy"), logits.astype(np.float32))
    print(name, "logits", logits.shape)


def write(name: str) -> None:
    """One fixture: the model saved as declared, its logits on its tokens and its greedy continuation."""
    family, fixture = FIXTURES[name]
    torch.manual_seed(fixture.seed)
    model = build(family.model_type, dict(fixture.config))
    for p in model.parameters():  # larger than the default 0.02 so that logits differ visibly
        torch.nn.init.normal_(p, std=0.2)
    for buffer_name, b in model.named_buffers():  # DeepSeek's balancing bias: large enough to change choices
        if buffer_name.endswith("e_score_correction_bias"):
            b.copy_(0.3 * torch.randn(b.shape))
    model.eval()
    directory = os.path.join(OUT, name)
    shutil.rmtree(directory, ignore_errors=True)
    kwargs = {"max_shard_size": fixture.shard} if fixture.shard else {}
    model.save_pretrained(directory, safe_serialization=True, **kwargs)
    if fixture.v4:
        to_v4(os.path.join(directory, "config.json"))
    print(name, "files", sorted(os.listdir(directory)))
    reference_logits(name)
    greedy(name)


def main(names: list[str]) -> None:
    if names[:1] in (["--greedy"], ["--logits"]):
        for name in names[1:] or FIXTURES:
            (greedy if names[0] == "--greedy" else reference_logits)(name)
        return
    unknown = sorted(set(names) - set(FIXTURES))
    if unknown:
        sys.exit(f"unknown fixture(s) {unknown}; the fixtures are {sorted(FIXTURES)}")
    if not names:
        shutil.rmtree(OUT, ignore_errors=True)
    os.makedirs(OUT, exist_ok=True)
    open(os.path.join(OUT, "VERSIONS"), "a" if names else "w").close()
    for name in names or FIXTURES:
        write(name)
        with open(os.path.join(OUT, "VERSIONS"), "a") as f:
            f.write(f"{name}/: torch {torch.__version__}, transformers {transformers.__version__}\n")


if __name__ == "__main__":
    main(sys.argv[1:])
