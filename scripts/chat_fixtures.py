"""Writes tests/fixtures/chat/expected.json: transformers' own renderings of the real chat templates there.

    pip install transformers && python scripts/chat_fixtures.py

The templates (qwen2_5.jinja, glm4moe.jinja; see tests/fixtures/chat/README.md) are rendered by transformers'
``apply_chat_template`` for a few conversations, with and without a generation prompt, as text and as token ids of
a character-level tokenizer.json written beside them (the templates' markers are its special tokens). The tests
compare jaxtron.data.chat's rendering and tokens with these, without transformers installed.
"""

import json
import os
import string

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "fixtures", "chat")
SPECIALS = ["<unk>", "<|endoftext|>", "<|im_start|>", "<|im_end|>", "[gMASK]", "<sop>", "<|system|>", "<|user|>",
            "<|assistant|>", "<|observation|>", "<think>", "</think>", "<tool_call>", "</tool_call>"]
TEMPLATES = {"qwen2_5.jinja": {"eos_token": "<|im_end|>"}, "glm4moe.jinja": {"eos_token": "<|endoftext|>"}}

TALK = [{"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "Hello, how can I help?"},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4."}]
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city <é>",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
TOOL_TALK = [TALK[1], {"role": "assistant", "content": "", "tool_calls": [
    {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
    {"role": "tool", "content": "sunny"}, {"role": "assistant", "content": "It is sunny."}]
CONVERSATIONS = {"system": TALK, "no_system": TALK[1:], "to_user": TALK[:4], "tools": TOOL_TALK}


def tokenizer_json(path: str) -> None:
    """Characters as tokens, the templates' markers as special tokens."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

    chars = sorted(set(string.printable) | set("é"))
    vocab = {t: i for i, t in enumerate(SPECIALS[:1] + chars)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tokenizer.add_special_tokens([AddedToken(t, special=True) for t in SPECIALS[1:]])
    tokenizer.save(path)


def main() -> None:
    import transformers
    from transformers import PreTrainedTokenizerFast

    path = os.path.join(HERE, "tokenizer.json")
    tokenizer_json(path)
    expected = {"transformers": transformers.__version__, "cases": []}
    for name, special in TEMPLATES.items():
        with open(os.path.join(HERE, name), encoding="utf-8") as f:
            template = f.read()
        tok = PreTrainedTokenizerFast(tokenizer_file=path, unk_token="<unk>", **special)
        tok.chat_template = template
        for label, messages in CONVERSATIONS.items():
            tools = TOOLS if label == "tools" else None
            for prompt in (False, True):
                text = tok.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=prompt)
                ids = tok.apply_chat_template(messages, tools=tools, tokenize=True, add_generation_prompt=prompt)
                ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
                expected["cases"].append({"template": name, "special_tokens": special, "conversation": label,
                                          "messages": messages, "tools": tools, "add_generation_prompt": prompt,
                                          "text": text, "ids": [int(i) for i in ids]})
    with open(os.path.join(HERE, "expected.json"), "w", encoding="utf-8") as f:
        json.dump(expected, f, indent=1, ensure_ascii=False)
    print(f"{len(expected['cases'])} renderings with transformers {transformers.__version__}")


if __name__ == "__main__":
    main()
