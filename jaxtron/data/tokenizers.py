"""Tokenizers for preparing token stores: built-in bytes, Hugging Face tokenizer.json, SentencePiece.

Each has an end-of-document id (``eos_id``) that prepare appends to every document, so a model learns
where text ends. ``eos`` picks it: "auto" finds the tokenizer's own (an error if it has none), a token
string names one, None prepares without. The byte tokenizer has none (see ByteTokenizer).
A Hugging Face model directory stands for its tokenizer.json (or tokenizer.model); the eos_token of the
tokenizer_config.json beside a tokenizer.json comes first.
"""

from __future__ import annotations

import functools
import json
import os
from typing import Protocol

import numpy as np

from jaxtron.data.errors import DataError
from jaxtron.data.store import file_sha256

AUTO = "auto"
# End-of-document tokens of common families, tried in this order when the post-processor names none:
# Llama 2 / Mistral / T5, Llama 3, GPT-2 / Qwen / GPT-NeoX, Gemma.
EOS_NAMES = ("</s>", "<|end_of_text|>", "<|endoftext|>", "<eos>")


class Tokenizer(Protocol):
    kind: str
    vocab_size: int
    eos_id: int | None

    def encode(self, text: str) -> np.ndarray: ...

    def decode(self, ids, skip_special: bool = False) -> str: ...

    def describe(self) -> dict: ...


class ByteTokenizer:
    """UTF-8 bytes as tokens 0..255, with no end-of-document token.

    All 256 ids are bytes, and an extra id 256 would not fit the byte-level models (vocab_size 256) and the
    built-in corpus store: byte-level models here do not learn to stop, and text they generate ends at a
    length limit. Document boundaries still hold: attention never crosses them and the first token of a
    document is never a target.
    """

    kind = "byte"
    vocab_size = 256
    eos_id = None

    def __init__(self, eos: str | None = AUTO):
        if eos not in (AUTO, None):
            raise DataError(f"--eos '{eos}' cannot be used with the byte tokenizer, which has no end-of-document "
                            "token; leave --eos out.")

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.uint32)

    def decode(self, ids, skip_special: bool = False) -> str:
        return bytes(np.asarray(ids, dtype=np.uint8)).decode("utf-8", errors="replace")

    def describe(self) -> dict:
        return {"kind": self.kind, "vocab_size": self.vocab_size, "eos_id": None}


class HFTokenizer:
    """A Hugging Face ``tokenizer.json`` through the tokenizers library (``encode`` adds no special tokens)."""

    kind = "huggingface"

    def __init__(self, path: str, eos: str | None = AUTO):
        from tokenizers import Tokenizer as _Tokenizer
        self.path, self.eos = path, eos
        try:
            self._tok = _Tokenizer.from_file(path)
        except Exception as e:  # noqa: BLE001 - the library raises its own exception types for malformed files
            raise DataError(f"tokenizer file '{path}' is not a Hugging Face tokenizer.json ({str(e).splitlines()[0]}); "
                            "pass a tokenizer.json, a SentencePiece .model or 'byte'.") from None
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        if eos is None:
            self.eos_id = None
        elif eos != AUTO:
            self.eos_id = self._tok.token_to_id(eos)
            if self.eos_id is None:
                raise DataError(f"--eos '{eos}' is not a token of '{path}'; name one of its tokens or pass --no-eos.")
        else:
            self.eos_id = self._find_eos()

    def _find_eos(self) -> int:
        """The model's eos_token (tokenizer_config.json beside the file), else the token the post-processor
        appends after the text, else the first of EOS_NAMES that exists."""
        named = self.config.get("eos_token")
        named = named.get("content") if isinstance(named, dict) else named
        if isinstance(named, str) and self._tok.token_to_id(named) is not None:
            return int(self._tok.token_to_id(named))
        with open(self.path, encoding="utf-8") as f:
            processor = json.load(f).get("post_processor") or {}
        processors = processor.get("processors", [processor]) if isinstance(processor, dict) else []
        for p in processors:
            single = p.get("single") if isinstance(p, dict) and p.get("type") == "TemplateProcessing" else None
            if not isinstance(single, list) or not single or not all(isinstance(i, dict) for i in single):
                continue
            if "SpecialToken" in single[-1] and any("Sequence" in item for item in single):
                ids = p.get("special_tokens", {}).get(single[-1]["SpecialToken"]["id"], {}).get("ids", [])
                if len(ids) == 1:
                    return int(ids[0])
        for name in EOS_NAMES:
            found = self._tok.token_to_id(name)
            if found is not None:
                return int(found)
        raise DataError(f"tokenizer file '{self.path}' has no end-of-document token that jaxtron recognises "
                        f"(none of {', '.join(EOS_NAMES)}); name it with --eos TOKEN or pass --no-eos.")

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self._tok.encode(text, add_special_tokens=False).ids, dtype=np.uint32)

    def encode_offsets(self, text: str) -> tuple[np.ndarray, np.ndarray]:
        """Token ids and the character offset where each token begins."""
        encoding = self._tok.encode(text, add_special_tokens=False)
        return (np.asarray(encoding.ids, dtype=np.uint32),
                np.asarray([a for a, _ in encoding.offsets], dtype=np.int64).reshape(-1))

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        # encode_batch_fast skips the character offsets, which a document does not need (tokenizers >= 0.21)
        encode = getattr(self._tok, "encode_batch_fast", self._tok.encode_batch)
        return [np.asarray(e.ids, dtype=np.uint32) for e in encode(texts, add_special_tokens=False)]

    def decode(self, ids, skip_special: bool = False) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special)

    @functools.cached_property
    def config(self) -> dict:
        """The tokenizer_config.json beside the file ({} if none or unreadable)."""
        path = os.path.join(os.path.dirname(os.path.abspath(self.path)), "tokenizer_config.json")
        try:
            with open(path, encoding="utf-8") as f:
                config = json.load(f)
        except (OSError, ValueError):
            return {}
        return config if isinstance(config, dict) else {}

    @functools.cached_property
    def bos_id(self) -> int | None:
        """The beginning-of-sequence token tokenizer_config.json beside the file names, if any."""
        bos = self.config.get("bos_token")
        bos = bos.get("content") if isinstance(bos, dict) else bos
        return self._tok.token_to_id(bos) if isinstance(bos, str) else None

    def describe(self) -> dict:
        return {"kind": self.kind, "path": os.path.abspath(self.path), "sha256": file_sha256(self.path),
                "vocab_size": self.vocab_size, "eos_id": self.eos_id,
                "eos": None if self.eos_id is None else self._tok.id_to_token(self.eos_id)}

    def __getstate__(self):  # worker processes reload the file instead of pickling the Rust object
        return {"path": self.path, "eos": self.eos}

    def __setstate__(self, state):
        self.__init__(state["path"], state["eos"])


class SentencePieceTokenizer:
    """A SentencePiece ``.model`` file (``encode`` adds no BOS/EOS)."""

    kind = "sentencepiece"

    def __init__(self, path: str, eos: str | None = AUTO):
        import sentencepiece
        self.path, self.eos = path, eos
        self._sp = sentencepiece.SentencePieceProcessor()
        try:
            self._sp.Load(path)
        except Exception as e:  # noqa: BLE001 - OSError or RuntimeError depending on the version
            raise DataError(f"tokenizer file '{path}' is not a SentencePiece model ({str(e).splitlines()[0]}); "
                            "pass a tokenizer.json, a SentencePiece .model or 'byte'.") from None
        self.vocab_size = self._sp.GetPieceSize()
        if eos is None:
            self.eos_id = None
        elif eos != AUTO:
            self.eos_id = self._sp.PieceToId(eos)
            if self._sp.IdToPiece(self.eos_id) != eos:  # unknown pieces map to the unk id
                raise DataError(f"--eos '{eos}' is not a piece of '{path}'; name one of its pieces or pass --no-eos.")
        else:
            self.eos_id = self._sp.eos_id()
            if self.eos_id < 0:  # trained with --eos_id=-1
                raise DataError(f"tokenizer file '{path}' was trained without an end-of-document piece; name one "
                                "with --eos PIECE or pass --no-eos.")

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self._sp.EncodeAsIds(text), dtype=np.uint32)

    def decode(self, ids, skip_special: bool = False) -> str:
        return self._sp.DecodeIds([int(i) for i in ids])

    def describe(self) -> dict:
        return {"kind": self.kind, "path": os.path.abspath(self.path), "sha256": file_sha256(self.path),
                "vocab_size": self.vocab_size, "eos_id": self.eos_id,
                "eos": None if self.eos_id is None else self._sp.IdToPiece(self.eos_id)}

    def __getstate__(self):
        return {"path": self.path, "eos": self.eos}

    def __setstate__(self, state):
        self.__init__(state["path"], state["eos"])


MODEL_FILES = ("tokenizer.json", "tokenizer.model")  # what a Hugging Face model directory holds, in preference


def tokenizer_file(spec: str) -> str:
    """The tokenizer file ``spec`` names: itself, or the tokenizer of a Hugging Face model directory."""
    if not os.path.isdir(spec):
        return spec
    for name in MODEL_FILES:
        if os.path.isfile(os.path.join(spec, name)):
            return os.path.join(spec, name)
    raise DataError(f"tokenizer directory '{spec}' holds neither {' nor '.join(MODEL_FILES)}; pass a model "
                    "directory with its tokenizer, or the tokenizer file itself.")


def load_tokenizer(spec: str, eos: str | None = AUTO) -> Tokenizer:
    """'byte', a tokenizer.json path, a SentencePiece .model path, or a Hugging Face model directory, with
    end-of-document choice ``eos``."""
    if spec == "byte":
        return ByteTokenizer(eos)
    spec = tokenizer_file(spec)
    if not os.path.isfile(spec):
        raise DataError(f"tokenizer '{spec}' is neither 'byte' nor an existing file; pass 'byte', a tokenizer.json "
                        "or a SentencePiece .model.")
    with open(spec, "rb") as f:
        head = f.read(1)
    if head in (b"{", b"["):  # JSON: only Hugging Face tokenizer files are JSON
        try:
            with open(spec, encoding="utf-8") as f:
                json.load(f)
        except (ValueError, UnicodeDecodeError):
            raise DataError(f"tokenizer file '{spec}' starts like JSON but is not valid JSON; "
                            "pass a complete tokenizer.json.") from None
        return HFTokenizer(spec, eos)
    return SentencePieceTokenizer(spec, eos)
