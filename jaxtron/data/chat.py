"""Conversations rendered with a tokenizer's chat template, with the assistant's tokens marked for the loss.

A conversation is a JSON object with ``messages``: a list of ``{"role": ..., "content": ...}``. It is rendered
to text by the tokenizer's own chat template (the ``chat_template`` of a Hugging Face ``tokenizer_config.json``,
or a ``chat_template.jinja`` beside the tokenizer), with jinja2 set up as transformers' ``apply_chat_template``
sets it up: a sandboxed environment with ``trim_blocks`` and ``lstrip_blocks``, loop controls, a ``tojson`` that
does not escape HTML, ``raise_exception`` and ``strftime_now``, and the tokenizer's special tokens (``bos_token``,
``eos_token``, ...) as variables.

Which characters the assistant wrote is found from the template itself: the text of assistant message ``i``
runs from the end of the conversation up to ``i`` rendered with a generation prompt to the end of the
conversation up to and including ``i``. That span holds the reply and the template's end-of-turn marker, so a
model learns to end its turn. Templates that render earlier turns differently once later ones follow (ones that
drop earlier reasoning, say) have no such prefixes and are refused with a sentence saying so.
"""

from __future__ import annotations

import datetime
import itertools
import json
import os
from collections.abc import Sequence
from typing import Any, ClassVar

import numpy as np

from jaxtron.data.errors import DataError

TEMPLATE_FILE = "chat_template.jinja"
CONFIG_FILE = "tokenizer_config.json"
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
MARK = "\x00reply\x00"  # stands for a reply when the end-of-turn marker is read off the template

# A template for byte-level models, whose tokenizer has no configuration file: role markers as plain text.
PLAIN_TEMPLATE = ("{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}<|end|>\n"
                  "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken object."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


class ChatTemplate:
    """A compiled chat template and the special tokens it may refer to. Pickles as its source."""

    def __init__(self, source: str, special_tokens: dict[str, str] | None = None, origin: str = "template"):
        self.source, self.special_tokens, self.origin = source, dict(special_tokens or {}), origin
        self._compiled = _compile(source, origin)

    def __getstate__(self):
        return {"source": self.source, "special_tokens": self.special_tokens, "origin": self.origin}

    def __setstate__(self, state):
        self.__init__(state["source"], state["special_tokens"], state["origin"])

    def describe(self) -> dict:
        return {"source": self.source, "special_tokens": self.special_tokens, "origin": self.origin}

    def render(self, messages: Sequence[dict], add_generation_prompt: bool = False, **variables: Any) -> str:
        import jinja2
        try:
            return self._compiled.render(messages=[_plain(m) for m in messages],
                                         add_generation_prompt=add_generation_prompt,
                                         tools=variables.pop("tools", None), documents=variables.pop("documents", None),
                                         **{**self.special_tokens, **variables})
        except jinja2.TemplateError as e:
            raise DataError(f"the chat template ({self.origin}) refused a conversation: {e}; fix the conversation "
                            "or use a template that accepts it.") from None

    def assistant_spans(self, messages: Sequence[dict]) -> tuple[str, list[tuple[int, int]]]:
        """The rendered conversation and the character spans [start, end) of its assistant messages."""
        text = self.render(messages)
        spans = []
        for i, message in enumerate(messages):
            if message.get("role") != "assistant":
                continue
            prompt = self.render(messages[:i], add_generation_prompt=True)
            upto = self.render(messages[:i + 1])
            if not (text.startswith(prompt) and text.startswith(upto) and len(upto) > len(prompt)):
                raise DataError(f"the chat template ({self.origin}) renders a conversation's earlier turns "
                                f"differently once later ones follow (at message {i}), so the assistant's tokens "
                                "cannot be told apart; use a template whose renderings extend each other.")
            spans.append((len(prompt), len(upto)))
        return text, spans

    def end_of_turn(self) -> str:
        """The text the template puts after an assistant's reply (its end-of-turn marker), stripped of blanks."""
        messages = [{"role": "user", "content": "question"}, {"role": "assistant", "content": MARK}]
        text = self.render(messages)
        return text[text.rindex(MARK) + len(MARK):].strip() if MARK in text else ""


REASONING = ("reasoning_content", "thinking", "reasoning")  # one message's reasoning, by the names templates read


def _plain(message: dict) -> dict:
    """A message as transformers hands it to a template: keys holding None dropped, reasoning under every name."""
    message = {k: v for k, v in message.items() if v is not None}
    reasoning = next((message[k] for k in REASONING if k in message), None)
    return message if reasoning is None else {"thinking": reasoning, **message, "reasoning_content": reasoning}


def _compile(source: str, origin: str):
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(jinja2.ext.Extension):
        """``{% generation %}...{% endgeneration %}`` marks assistant text for transformers; here it renders its body
        (the spans come from the renderings' prefixes, which works with or without the tag)."""

        tags: ClassVar[set[str]] = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.TemplateError(message)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise DataError(f"the chat template ({origin}) is not valid jinja (line {e.lineno}: {e.message}); "
                        "fix the template file.") from None


def load_template(tokenizer: str, template: str | None = None) -> ChatTemplate:
    """The chat template for ``tokenizer`` (a tokenizer.json path, a model directory or 'byte').

    ``template`` if given (a .jinja file or a tokenizer_config.json), else the tokenizer's own from the files
    beside it or in the model directory. DataError if there is none."""
    directory = "" if tokenizer == "byte" else os.path.abspath(tokenizer)
    directory = directory if os.path.isdir(directory) else os.path.dirname(directory)  # a model directory, or a file
    config: dict = {}
    config_path = os.path.join(directory, CONFIG_FILE) if directory else ""
    if config_path and os.path.isfile(config_path):
        config = _read_json(config_path)
    special = {k: t for k in SPECIAL_TOKENS if (t := _token_text(config.get(k))) is not None}
    if template:
        if not os.path.isfile(template):
            raise DataError(f"--chat-template '{template}' is not a file; pass a .jinja file or a "
                            "tokenizer_config.json.")
        if template.endswith(".json"):
            given = _read_json(template)
            special.update({k: t for k in SPECIAL_TOKENS if (t := _token_text(given.get(k))) is not None})
            return ChatTemplate(_config_template(given, template), special, template)
        with open(template, encoding="utf-8") as f:
            return ChatTemplate(f.read(), special, template)
    jinja_path = os.path.join(directory, TEMPLATE_FILE) if directory else ""
    if jinja_path and os.path.isfile(jinja_path):
        with open(jinja_path, encoding="utf-8") as f:
            return ChatTemplate(f.read(), special, jinja_path)
    if config.get("chat_template"):
        return ChatTemplate(_config_template(config, config_path), special, config_path)
    raise DataError(f"the tokenizer '{tokenizer}' has no chat template (no '{CONFIG_FILE}' with a chat_template and "
                    f"no '{TEMPLATE_FILE}' beside it); pass one with --chat-template FILE.")


def _read_json(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except (ValueError, UnicodeDecodeError):
        raise DataError(f"'{path}' is not valid JSON; fix or replace the file.") from None
    if not isinstance(value, dict):
        raise DataError(f"'{path}' does not hold a JSON object; pass a tokenizer_config.json.")
    return value


def _config_template(config: dict, path: str) -> str:
    """tokenizer_config.json's chat_template: a string, or a list of named ones of which 'default' is used."""
    value = config.get("chat_template")
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        value = named.get("default")
    if not isinstance(value, str) or not value:
        raise DataError(f"'{path}' has no chat_template string; pass a .jinja file with --chat-template.")
    return value


def conversation(record: Any, where: str) -> list[dict]:
    """The messages of one JSONL record, checked: DataError naming ``where`` otherwise."""
    messages = record.get("messages") if isinstance(record, dict) else None
    if not isinstance(messages, list) or not messages or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages):
        raise DataError(f"{where} has no 'messages' list of {{\"role\": ..., \"content\": ...}} objects with text "
                        "content; fix the record.")
    if not any(m["role"] == "assistant" for m in messages):
        raise DataError(f"{where} has no assistant message, so nothing in it would be trained on; add one or drop it.")
    return messages


def encode_conversation(tokenizer, template: ChatTemplate, messages: Sequence[dict],
                        last_only: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """Token ids of the rendered conversation and a uint8 mask: 1 on the tokens the assistant wrote (with
    ``last_only``: in its last message alone, a preference pair's response).

    A tokenizer with character offsets (Hugging Face) encodes the whole text once, as transformers does, and
    a token counts as the assistant's if it begins inside an assistant span; others encode span by span."""
    text, spans = template.assistant_spans(messages)
    spans = spans[-1:] if last_only else spans
    offsets = getattr(tokenizer, "encode_offsets", None)
    if offsets is not None:
        ids, starts = offsets(text)
        mask = np.zeros(len(ids), np.uint8)
        for a, b in spans:
            mask[(starts >= a) & (starts < b)] = 1
        return ids, mask
    cuts = sorted({0, len(text), *(c for span in spans for c in span)})
    parts, masks = [], []
    for a, b in itertools.pairwise(cuts):
        ids = tokenizer.encode(text[a:b])
        parts.append(ids)
        masks.append(np.full(len(ids), any(s <= a < e for s, e in spans), np.uint8))
    return np.concatenate(parts).astype(np.uint32), np.concatenate(masks)
