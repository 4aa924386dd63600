"""The tokenizer of an exported model, in the files Hugging Face's ``AutoTokenizer.from_pretrained`` reads.

- a converted model: the tokenizer files ``convert from-hf`` copied beside it, copied on;
- a run on a store of a ``tokenizer.json``: that file, with the ``tokenizer_config.json``,
  ``special_tokens_map.json`` and ``chat_template.jinja`` found beside it (a minimal config where there is none);
- a run on a store of the byte tokenizer: a ``tokenizer.json`` built here whose ids are the UTF-8 bytes, as the
  run's: a byte-level BPE with the 256 bytes as its vocabulary and no merges;
- a run on a SentencePiece store: its ``.model`` as ``tokenizer.model``.
A run on synthetic tokens has no tokenizer; an export says so.
"""

from __future__ import annotations

import json
import logging
import os
import shutil

log = logging.getLogger(__name__)

# a Hugging Face directory's tokenizer files, copied into a converted model as they are, and out of it again
FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
         "chat_template.jinja")
FAST = "PreTrainedTokenizerFast"  # the tokenizer_class that reads tokenizer.json alone


def byte_symbols() -> list[str]:
    """The character that stands for each byte 0..255 in a byte-level BPE vocabulary: the byte's own Latin-1
    character where that is printable (33-126, 161-172, 174-255), else the next unused code point from 256 on."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    symbols, spare = {}, 256
    for byte in range(256):
        if byte in printable:
            symbols[byte] = chr(byte)
        else:
            symbols[byte] = chr(spare)
            spare += 1
    return [symbols[b] for b in range(256)]


def byte_tokenizer_json(path: str) -> None:
    """Writes a ``tokenizer.json`` that encodes text as its UTF-8 bytes (id = byte value) and decodes them back,
    with no special tokens: jaxtron's byte tokenizer for Hugging Face tools."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tokenizer = Tokenizer(models.BPE(vocab={s: i for i, s in enumerate(byte_symbols())}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.save(path)


def _config(path: str, max_length: int, eos: str | None) -> None:
    config = {"tokenizer_class": FAST, "model_max_length": max_length, "clean_up_tokenization_spaces": False}
    if eos:
        config["eos_token"] = eos
    with open(path, "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)


def export(source_dir: str, manifest: dict | None, max_length: int, out_dir: str) -> str:
    """Writes the tokenizer of the model in ``source_dir`` (a converted model, or a run whose first token store
    has ``manifest``; None for a converted model) into ``out_dir``; returns a phrase saying what it wrote."""
    if manifest is None:
        copied = [n for n in FILES if os.path.isfile(os.path.join(source_dir, n))]
        for name in copied:
            shutil.copyfile(os.path.join(source_dir, name), os.path.join(out_dir, name))
        return f"the converted model's {', '.join(copied)}" if copied else "no tokenizer (the model came without)"
    tokenizer = manifest.get("tokenizer") or {}
    if not tokenizer:
        return "no tokenizer (the run's data is no token store that names one)"
    kind, path = tokenizer.get("kind"), tokenizer.get("path") or ""
    if kind == "byte":
        byte_tokenizer_json(os.path.join(out_dir, "tokenizer.json"))
        _config(os.path.join(out_dir, "tokenizer_config.json"), max_length, None)
        return "a byte-level tokenizer.json (ids are UTF-8 bytes, as the run's)"
    if not os.path.isfile(path):
        log.warning("the run's tokenizer %s is not there any more; the export has no tokenizer (copy it in "
                    "beside the weights)", path or "(unnamed)")
        return "no tokenizer (the run's tokenizer file is gone)"
    if kind == "sentencepiece":
        shutil.copyfile(path, os.path.join(out_dir, "tokenizer.model"))
        return f"{path} as tokenizer.model (pick its tokenizer class in tokenizer_config.json)"
    shutil.copyfile(path, os.path.join(out_dir, "tokenizer.json"))
    beside = os.path.dirname(path)
    for name in FILES[1:]:
        if name != "tokenizer.model" and os.path.isfile(os.path.join(beside, name)):
            shutil.copyfile(os.path.join(beside, name), os.path.join(out_dir, name))
    if not os.path.isfile(os.path.join(out_dir, "tokenizer_config.json")):
        _config(os.path.join(out_dir, "tokenizer_config.json"), max_length, tokenizer.get("eos"))
    return f"{path} and what lies beside it"
