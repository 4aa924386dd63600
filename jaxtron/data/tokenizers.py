"""Tokenizers for preparing token stores: built-in bytes, Hugging Face tokenizer.json, SentencePiece."""

from __future__ import annotations

import json
import os
from typing import Protocol

import numpy as np

from jaxtron.data.errors import DataError
from jaxtron.data.store import file_sha256


class Tokenizer(Protocol):
    kind: str
    vocab_size: int

    def encode(self, text: str) -> np.ndarray: ...

    def decode(self, ids) -> str: ...

    def describe(self) -> dict: ...


class ByteTokenizer:
    """UTF-8 bytes as tokens 0..255."""

    kind = "byte"
    vocab_size = 256

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.uint32)

    def decode(self, ids) -> str:
        return bytes(np.asarray(ids, dtype=np.uint8)).decode("utf-8", errors="replace")

    def describe(self) -> dict:
        return {"kind": self.kind, "vocab_size": self.vocab_size}


class HFTokenizer:
    """A Hugging Face ``tokenizer.json`` through the tokenizers library (no special tokens added)."""

    kind = "huggingface"

    def __init__(self, path: str):
        from tokenizers import Tokenizer as _Tokenizer
        self.path = path
        try:
            self._tok = _Tokenizer.from_file(path)
        except Exception as e:  # the library raises its own exception types for malformed files
            raise DataError(f"tokenizer file '{path}' is not a Hugging Face tokenizer.json ({str(e).splitlines()[0]}); "
                            "pass a tokenizer.json, a SentencePiece .model or 'byte'.") from None
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self._tok.encode(text, add_special_tokens=False).ids, dtype=np.uint32)

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        return [np.asarray(e.ids, dtype=np.uint32) for e in self._tok.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def describe(self) -> dict:
        return {"kind": self.kind, "path": os.path.abspath(self.path), "sha256": file_sha256(self.path),
                "vocab_size": self.vocab_size}

    def __getstate__(self):  # worker processes reload the file instead of pickling the Rust object
        return {"path": self.path}

    def __setstate__(self, state):
        self.__init__(state["path"])


class SentencePieceTokenizer:
    """A SentencePiece ``.model`` file (no BOS/EOS added)."""

    kind = "sentencepiece"

    def __init__(self, path: str):
        import sentencepiece
        self.path = path
        self._sp = sentencepiece.SentencePieceProcessor()
        try:
            self._sp.Load(path)
        except Exception as e:  # OSError or RuntimeError depending on the version
            raise DataError(f"tokenizer file '{path}' is not a SentencePiece model ({str(e).splitlines()[0]}); "
                            "pass a tokenizer.json, a SentencePiece .model or 'byte'.") from None
        self.vocab_size = self._sp.GetPieceSize()

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self._sp.EncodeAsIds(text), dtype=np.uint32)

    def decode(self, ids) -> str:
        return self._sp.DecodeIds([int(i) for i in ids])

    def describe(self) -> dict:
        return {"kind": self.kind, "path": os.path.abspath(self.path), "sha256": file_sha256(self.path),
                "vocab_size": self.vocab_size}

    def __getstate__(self):
        return {"path": self.path}

    def __setstate__(self, state):
        self.__init__(state["path"])


def load_tokenizer(spec: str) -> Tokenizer:
    """'byte', a tokenizer.json path, or a SentencePiece .model path."""
    if spec == "byte":
        return ByteTokenizer()
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
        return HFTokenizer(spec)
    return SentencePieceTokenizer(spec)
