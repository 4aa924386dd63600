"""Conversations for supervised fine-tuning: chat templates, the assistant-only loss mask, the conversation store."""

import json
import os

import numpy as np
import pytest

from jaxtron.data.chat import PLAIN_TEMPLATE, ChatTemplate, encode_conversation, load_template
from jaxtron.data.errors import DataError
from jaxtron.data.tokenizers import ByteTokenizer

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures", "chat")

TALK = [{"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4."},
        {"role": "user", "content": "And 3+3?"},
        {"role": "assistant", "content": "6, of course."}]


def _marked(ids: np.ndarray, mask: np.ndarray, decode) -> str:
    """The text of the masked tokens, runs of them joined by '|'."""
    runs, current = [], []
    for token, m in zip(ids, mask, strict=True):
        if m:
            current.append(int(token))
        elif current:
            runs.append(decode(current))
            current = []
    if current:
        runs.append(decode(current))
    return "|".join(runs)


def test_only_the_assistants_text_and_end_of_turn_carry_loss_with_byte_tokens():
    template = ChatTemplate(PLAIN_TEMPLATE)
    ids, mask = encode_conversation(ByteTokenizer(), template, TALK)
    text = template.render(TALK)
    assert bytes(ids.astype(np.uint8)).decode() == text
    assert _marked(ids, mask, lambda t: bytes(t).decode()) == "4.<|end|>\n|6, of course.<|end|>\n"
    assert template.end_of_turn() == "<|end|>"
    assert template.render(TALK[:2], add_generation_prompt=True).endswith("What is 2+2?<|end|>\n<|assistant|>\n")


def _hf_tokenizer(tmp_path, template: str | None = None, **config):
    """A word-level tokenizer.json with ChatML's markers as special tokens, and its tokenizer_config.json."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

    words = ["[UNK]", "<|endoftext|>", "system", "user", "assistant", "Be", "brief", ".", "What", "is", "2",
             "+", "?", "4", "And", "3", "6", ",", "of", "course"]
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()  # blanks are dropped, punctuation split off
    tokenizer.add_special_tokens([AddedToken("<|im_start|>", special=True), AddedToken("<|im_end|>", special=True)])
    path = tmp_path / "tokenizer.json"
    tokenizer.save(str(path))
    if template is not None:
        (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": template, **config}))
    return str(path)


CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_a_tokenizer_json_marks_the_assistants_tokens_by_their_offsets(tmp_path):
    from jaxtron.data.tokenizers import load_tokenizer

    path = _hf_tokenizer(tmp_path, CHATML, eos_token={"content": "<|im_end|>"})
    template = load_template(path)
    assert template.special_tokens == {"eos_token": "<|im_end|>"}
    tokenizer = load_tokenizer(path)
    ids, mask = encode_conversation(tokenizer, template, TALK)
    assert np.array_equal(ids, tokenizer.encode(template.render(TALK)))  # the whole text encoded once
    marked = [tokenizer.decode([t]) for t, m in zip(ids, mask, strict=True) if m]
    assert marked == ["4", ".", "<|im_end|>", "6", ",", "of", "course", ".", "<|im_end|>"]
    assert template.end_of_turn() == "<|im_end|>"
    # a chat_template.jinja beside the tokenizer is preferred, as transformers saves it
    (tmp_path / "chat_template.jinja").write_text("{{ messages[0]['content'] }}")
    assert load_template(path).render(TALK) == "Be brief."


def test_a_template_that_rewrites_earlier_turns_is_refused():
    rewriting = "{% for m in messages %}{{ m['role'] }}{% if loop.last %}!{% endif %}:{{ m['content'] }};{% endfor %}"
    with pytest.raises(DataError, match="renders a conversation's earlier turns differently once later ones follow"):
        encode_conversation(ByteTokenizer(), ChatTemplate(rewriting), TALK)


def _write(path, lines):
    path.write_text("".join(json.dumps(line) + "\n" if not isinstance(line, str) else line for line in lines))
    return str(path)


def test_prepare_chat_writes_a_store_whose_rows_train_on_the_assistant_only(tmp_path):
    from jaxtron.data.packing import PackedSplit
    from jaxtron.data.prepare import prepare
    from jaxtron.data.store import TokenStore

    conversations = _write(tmp_path / "talk.jsonl", [{"messages": TALK}] * 3 + ["\n"])
    path = _hf_tokenizer(tmp_path, CHATML)
    manifest = prepare([conversations], path, str(tmp_path / "store"), chat=load_template(path))
    assert manifest["format"] == 3 and manifest["loss_mask"] and manifest["chat_template"]["source"] == CHATML
    store = TokenStore(str(tmp_path / "store"), verify=True)
    assert store.has_loss_mask and store.num_documents == 3
    split = PackedSplit(store, 16, "train", 0.0, seed=0)
    rows = split.rows(np.arange(split.num_windows))
    from jaxtron.data.tokenizers import load_tokenizer
    tokenizer = load_tokenizer(path)
    pairs = list(zip(rows["targets"].ravel(), rows["loss_mask"].ravel(), strict=True))
    trained = {tokenizer.decode([t]) for t, m in pairs if m}
    assert trained == {"4", ".", "<|im_end|>", "6", ",", "of", "course"}
    untrained = {tokenizer.decode([t]) for t, m in pairs if not m}
    assert {"What", "is", "Be", "user", "system", "<|endoftext|>"} <= untrained
    # the mask is part of the store's checksums
    mask_file = tmp_path / "store" / manifest["shards"][0]["mask"]
    data = bytearray(mask_file.read_bytes())
    data[0] ^= 1
    mask_file.write_bytes(bytes(data))
    with pytest.raises(DataError, match="does not match its checksum"):
        TokenStore(str(tmp_path / "store"), verify=True)


def test_stores_without_a_mask_keep_format_2_and_train_on_every_target(tmp_path):
    from jaxtron.data.prepare import prepare
    from jaxtron.data.store import TokenStore

    (tmp_path / "a.txt").write_text("hello world")
    manifest = prepare([str(tmp_path / "a.txt")], "byte", str(tmp_path / "store"))
    assert manifest["format"] == 2 and not manifest["loss_mask"]
    store = TokenStore(str(tmp_path / "store"))
    assert not store.has_loss_mask and store.take_mask(np.arange(4)).tolist() == [1, 1, 1, 1]


def test_bad_conversation_input_is_one_sentence_and_exit_2(tmp_path, capsys):
    from jaxtron import cli

    path = _hf_tokenizer(tmp_path)  # no tokenizer_config.json: no template
    talk = _write(tmp_path / "talk.jsonl", [{"messages": TALK}])
    no_messages = _write(tmp_path / "bad.jsonl", [{"text": "hi"}])
    no_reply = _write(tmp_path / "user.jsonl", [{"messages": TALK[:2]}])
    broken = tmp_path / "broken.jinja"
    broken.write_text("{% for m in messages %}")
    text = tmp_path / "plain.txt"
    text.write_text("hi")
    plain = tmp_path / "plain.jinja"
    plain.write_text(PLAIN_TEMPLATE)
    cases = [
        ([talk], [], ("has no chat template (no 'tokenizer_config.json' with a chat_template and no "
                     "'chat_template.jinja' beside it); pass one with --chat-template FILE.")),
        ([no_messages], ["--chat-template", str(plain)], "line 1 of '" + no_messages + "' has no 'messages' list"),
        ([no_reply], ["--chat-template", str(plain)], "has no assistant message"),
        ([talk], ["--chat-template", str(broken)], "is not valid jinja (line 1"),
        ([str(text)], ["--chat-template", str(plain)], "--chat reads conversations from records"),
    ]
    for i, (inputs, extra, message) in enumerate(cases):
        argv = ["prepare", "--tokenizer", path, "--output", str(tmp_path / f"out{i}"), "--chat", *extra]
        for item in inputs:
            argv += ["--input", item]
        assert cli.main(argv) == 2, message
        err = capsys.readouterr().err
        assert err.startswith("error: ") and err.count("\n") == 1 and message in err, err
    assert cli.main(["prepare", "--tokenizer", "byte", "--input", talk, "--output", str(tmp_path / "x"),
                     "--chat-template", str(plain)]) == 2
    assert "--chat-template is used only with --chat" in capsys.readouterr().err


def test_the_builtin_conversations_ask_about_documented_functions(tmp_path):
    from jaxtron.data.corpus import function_questions

    source = tmp_path / "mod.py"
    source.write_text('def shown(a, b=1, *rest):\n    """Add things together.\n\n    More."""\n\n'
                      'def _hidden():\n    """Not public at all."""\n\ndef bare(x):\n    pass\n')
    (conversation,) = function_questions(str(source), "pkg.mod")
    assert conversation["messages"] == [
        {"role": "user", "content": "What does pkg.mod.shown do?"},
        {"role": "assistant", "content": "`pkg.mod.shown(a, b=1, *rest)`: Add things together."}]


def test_real_templates_render_and_tokenize_as_transformers_apply_chat_template():
    """Qwen2.5's and GLM-4.5's own templates (tests/fixtures/chat/README.md), with tools, tool calls and generation
    prompts: the text and token ids equal transformers' (expected.json, written by scripts/chat_fixtures.py)."""
    from jaxtron.data.tokenizers import load_tokenizer

    with open(os.path.join(FIXTURES, "expected.json"), encoding="utf-8") as f:
        expected = json.load(f)
    tokenizer = load_tokenizer(os.path.join(FIXTURES, "tokenizer.json"))
    assert len(expected["cases"]) == 16
    for case in expected["cases"]:
        with open(os.path.join(FIXTURES, case["template"]), encoding="utf-8") as f:
            template = ChatTemplate(f.read(), case["special_tokens"])
        text = template.render(case["messages"], case["add_generation_prompt"], tools=case["tools"])
        assert text == case["text"], (case["template"], case["conversation"])
        assert tokenizer.encode(text).tolist() == case["ids"]


@pytest.mark.parametrize("name, replies", [
    ("qwen2_5.jinja", ["Hello, how can I help?<|im_end|>\n", "4.<|im_end|>\n"]),
    ("glm4moe.jinja", ["\n<think></think>\nHello, how can I help?", "\n<think></think>\n4."])])
def test_a_real_templates_assistant_tokens_are_its_replies(name, replies):
    from jaxtron.data.tokenizers import load_tokenizer

    tokenizer = load_tokenizer(os.path.join(FIXTURES, "tokenizer.json"))
    template = load_template(os.path.join(FIXTURES, "tokenizer.json"), os.path.join(FIXTURES, name))
    ids, mask = encode_conversation(tokenizer, template, TALK[:1] + [
        {"role": "user", "content": "Hi!"}, {"role": "assistant", "content": "Hello, how can I help?"},
        {"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4."}])
    pieces = tokenizer._tok.id_to_token  # the fixture's tokens are single characters and the templates' markers
    assert _marked(ids, mask, lambda t: "".join(pieces(i) for i in t)) == "|".join(replies)


@pytest.mark.integration
@pytest.mark.slow
def test_a_tiny_model_fine_tuned_on_conversations_learns_the_assistants_format(tmp_path, capsys):
    """A conversation set (count from a to b) prepared with `jaxtron prepare --chat` and fine-tuned on from a base
    run (train.init_from): the validation loss, on the assistant's tokens only, falls far below their unigram
    entropy, and a greedy reply to a question it never saw has the answers' shape and ends at the template's
    end-of-turn marker."""
    import re

    import jax
    from helpers import metrics_lines, tiny_config

    from jaxtron import cli
    from jaxtron.training.loop import run

    pairs = [(a, b) for a in range(1, 16) for b in range(a + 1, 16) if (a, b) != (4, 9)]
    talk = [{"messages": [{"role": "user", "content": f"Count from {a} to {b}."},
                          {"role": "assistant", "content": ", ".join(map(str, range(a, b + 1))) + "."}]}
            for a, b in pairs]
    data = _write(tmp_path / "count.jsonl", talk)
    template = tmp_path / "plain.jinja"
    template.write_text(PLAIN_TEMPLATE)
    store = str(tmp_path / "store")
    assert cli.main(["prepare", "--input", data, "--tokenizer", "byte", "--output", store, "--chat",
                     "--chat-template", str(template)]) == 0
    base = str(tmp_path / "base")
    run(tiny_config(train=dict(steps=1), checkpoint=dict(every=0)), base, use_tqdm=False, devices=jax.devices()[:1])
    cfg = tiny_config(model=dict(max_seq_len=128),
                      train=dict(steps=100, global_batch_size=16, log_every=50, eval_every=100, eval_batches=2,
                                 init_from=base),
                      optimizer=dict(learning_rate=5e-3, warmup_steps=10),
                      data=dict(source="store", path=store, seq_len=64, validation_fraction=0.1),
                      checkpoint=dict(every=0))
    summary = run(cfg, str(tmp_path / "sft"), use_tqdm=False, devices=jax.devices()[:1])
    entropy = summary.data["unigram_entropy"]  # of the assistant's tokens: digits, commas, blanks, the marker
    losses = [line["eval/loss"] for line in metrics_lines(tmp_path / "sft") if "eval/loss" in line]
    assert losses and losses[-1] < entropy - 1.0, (losses, entropy)
    assert cli.main(["generate", "--run", str(tmp_path / "sft"), "--chat", "--prompt", "Count from 4 to 9.",
                     "--max-new-tokens", "60"]) == 0
    reply = capsys.readouterr().out.split("<|assistant|>\n", 1)[1]
    assert re.fullmatch(r"\d+(, \d+)*\.\n", reply), reply  # ended at <|end|>, which is cut from the text


def test_the_sft_config_fine_tunes_the_main_jobs_model():
    from conftest import REPO

    from jaxtron.config.loader import load_config

    sft, default = (load_config(os.path.join(REPO, "configs", f"{name}.py")) for name in ("sft", "default"))
    assert sft.model == default.model and sft.mesh == default.mesh
    assert sft.train.init_from == "runs/default" and sft.data.prepare == "stdlib-chat" and sft.lora.rank == 0
