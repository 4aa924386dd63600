"""Prompt stores for RL: each record's prompt, rendered with the chat template and the assistant's turn begun,
with the record itself kept beside the tokens for the reward function.

A prompt record is a JSON object with ``prompt`` (a text, the user's message, or messages) or ``messages``; its
other fields (a reference answer, say) reach the reward function unchanged. ``jaxtron prepare --prompts`` writes
one document a record (no end-of-document token: the model continues it) and the records, one JSON line each, to
``records.jsonl`` with its checksum in the manifest. ``PromptSplit`` reads them back in a seeded order per epoch.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any

import numpy as np

from jaxtron.data.chat import ChatTemplate
from jaxtron.data.errors import DataError
from jaxtron.data.pairs import prompt_messages, split_items
from jaxtron.data.shuffle import EpochPermutation
from jaxtron.data.store import TokenStore


def encode_prompt(tokenizer, template: ChatTemplate, record: Any, where: str) -> tuple[np.ndarray, str]:
    """(the prompt's token ids, rendered with a generation prompt, the record as one JSON line)."""
    if not isinstance(record, dict):
        raise DataError(f"{where} is not a JSON object with a 'prompt'; fix the record.")
    text = template.render(prompt_messages(record, where), add_generation_prompt=True)
    return np.asarray(tokenizer.encode(text), np.uint32), json.dumps(record, ensure_ascii=False)


def read_records(store: TokenStore) -> list[str]:
    """A prompt store's records, one JSON line each, checked against the manifest's checksum and count."""
    spec = store.manifest.get("records")
    if not spec:
        raise DataError(f"store '{store.path}' holds no prompt records; prepare one with jaxtron prepare --prompts.")
    with open(os.path.join(store.path, spec["file"]), "rb") as f:
        data = f.read()
    lines = data.decode().splitlines()
    if hashlib.sha256(data).hexdigest() != spec["sha256"] or not len(lines) == spec["count"] == store.num_documents:
        raise DataError(f"the records of store '{store.path}' do not match its manifest; the store is corrupted, "
                        "prepare it again.")
    return lines


class PromptSplit:
    """The prompts of one split of a prompt store, each with its record: sample ``g`` of an epoch is a prompt in
    a seeded order (a new permutation each epoch, as pretraining's windows)."""

    def __init__(self, store: TokenStore, seq_len: int, split: str, validation_fraction: float, seed: int):
        self.store, self.seq_len, self.records = store, seq_len, read_records(store)
        self.indices = split_items(store.num_documents, split, validation_fraction,
                                   f"the prompts of store '{store.path}'")
        self._order = EpochPermutation(len(self.indices), seed)

    def prompts(self, samples: np.ndarray) -> list[tuple[np.ndarray, dict]]:
        """(token ids, record) of each global sample."""
        docs = self.indices[self._order(np.asarray(samples, np.int64))]
        begin, end = self.store.doc_start(docs), self.store.doc_start(docs + 1)
        return [(self.store.read(int(b), int(e - b)).astype(np.int32), json.loads(self.records[d]))
                for b, e, d in zip(begin, end, docs, strict=True)]
