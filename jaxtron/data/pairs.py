"""Preference pairs: a chosen and a rejected response to one prompt, for DPO.

A pair record is a JSON object with the prompt, as text (``prompt``) or as messages (``prompt`` or ``messages``),
and two responses, ``chosen`` and ``rejected``: each a text, an assistant message, or a list of messages ending
with the assistant's. Each side is rendered as a conversation with the chat template (``jaxtron.data.chat``) and
its loss mask is 1 on the final assistant message alone: the response and the template's end-of-turn marker.

A pair store is a conversation store whose documents come in twos, chosen then rejected, with ``"pairs": true``
in its manifest. ``PairSplit`` reads it as rows: sample ``2 p`` is pair ``p``'s chosen side and ``2 p + 1`` its
rejected side, each its own row from the row's start, cut at ``seq_len + 1`` tokens and padded after. A batch of
``2 P`` rows holds ``P`` whole pairs, and every data shard whole pairs when its row count is even.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from jaxtron.data.chat import ChatTemplate, encode_conversation
from jaxtron.data.errors import DataError
from jaxtron.data.shuffle import EpochPermutation
from jaxtron.data.store import TokenStore

SIDES = ("chosen", "rejected")


def prompt_messages(record: dict, where: str) -> list[dict]:
    """A record's prompt as messages: ``prompt`` (a text, the user's message, or messages) or ``messages``."""
    prompt = record.get("prompt", record.get("messages"))
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    if isinstance(prompt, list) and prompt and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in prompt):
        return prompt
    raise DataError(f"{where} has no 'prompt' (a text, or a list of {{\"role\": ..., \"content\": ...}} messages); "
                    "fix the record.")


def _response(record: dict, side: str, where: str) -> list[dict]:
    if side not in record:
        raise DataError(f"{where} has no '{side}' response; every pair needs 'chosen' and 'rejected'.")
    value = record[side]
    messages = [value] if isinstance(value, dict) else value
    if isinstance(value, str):
        messages = [{"role": "assistant", "content": value}]
    if not (isinstance(messages, list) and messages and all(
            isinstance(m, dict) and isinstance(m.get("content"), str) for m in messages)
            and messages[-1].get("role", "assistant") == "assistant"):
        raise DataError(f"{where}'s '{side}' is not a text, an assistant message or a list of messages ending with "
                        "the assistant's; fix the record.")
    return [{"role": "assistant", **m} if "role" not in m else m for m in messages]


def preference_pair(record: Any, where: str) -> tuple[list[dict], list[dict]]:
    """The chosen and the rejected conversation of one pair record, checked: DataError naming ``where``."""
    if not isinstance(record, dict):
        raise DataError(f"{where} is not a JSON object with 'prompt', 'chosen' and 'rejected'; fix the record.")
    prompt = prompt_messages(record, where)
    return tuple(prompt + _response(record, side, where) for side in SIDES)


def encode_pair(tokenizer, template: ChatTemplate, record: Any, where: str) -> list[tuple[np.ndarray, np.ndarray]]:
    """A pair record's two documents, chosen then rejected: (token ids, loss mask on the final response), each
    ending with the tokenizer's end-of-document token (not a target) if it has one."""
    docs = []
    for messages in preference_pair(record, where):
        ids, mask = encode_conversation(tokenizer, template, messages, last_only=True)
        if tokenizer.eos_id is not None:
            ids, mask = np.append(ids, np.uint32(tokenizer.eos_id)), np.append(mask, np.uint8(0))
        docs.append((ids, mask))
    return docs


def split_items(count: int, split: str, validation_fraction: float, what: str) -> np.ndarray:
    """The indices of ``split`` among ``count`` pairs or prompts (``what`` names them): ceil(fraction * count) held
    out for validation, evenly spaced through the store (so from all of its inputs); the rest train."""
    held = math.ceil(count * validation_fraction) if validation_fraction > 0 else 0
    if held >= count:
        raise DataError(f"{what} holds {count}, too few to hold out {validation_fraction:.0%} for validation; lower "
                        "data.validation_fraction.")
    validation = np.unique((np.arange(held) * count + count // 2) // max(held, 1)).astype(np.int64)
    if split == "validation":
        return validation
    return np.setdiff1d(np.arange(count, dtype=np.int64), validation)


class DocumentRows:
    """One document a row, from the row's start, cut at ``seq_len + 1`` tokens and padded after: items of
    ``per_item`` neighbouring documents (a pair's two, or one) in a seeded order per epoch, sample ``per_item * i
    + j`` being document j of item i. Unpacked supervised fine-tuning (``data.packing=False``) reads a store so."""

    def __init__(self, store: TokenStore, seq_len: int, split: str, validation_fraction: float, seed: int,
                 per_item: int = 1, what: str = "documents"):
        self.store, self.seq_len, self.per_item = store, seq_len, per_item
        self.items = split_items(store.num_documents // per_item, split, validation_fraction,
                                 f"the {what} of store '{store.path}'")
        if not len(self.items):
            raise DataError(f"the {split} split of store '{store.path}' holds none of its {what}; use more.")
        self._order = EpochPermutation(len(self.items), seed)

    def documents(self, samples: np.ndarray) -> np.ndarray:
        """The store document of each global sample (a pair's chosen side at even samples, rejected at odd)."""
        samples = np.asarray(samples, np.int64)
        return self.per_item * self.items[self._order(samples // self.per_item)] + samples % self.per_item

    def rows(self, samples: np.ndarray) -> dict[str, np.ndarray]:
        length = self.seq_len + 1
        docs = self.documents(samples)
        begin, end = self.store.doc_start(docs), self.store.doc_start(docs + 1)
        count = np.minimum(end - begin, length)  # a longer document keeps its start: the end of its response is cut
        where = begin[:, None] + np.minimum(np.arange(length), count[:, None] - 1)
        real = np.arange(length) < count[:, None]
        tokens = np.where(real, self.store.take(where), 0).astype(np.int32)
        mask = real[:, 1:] & self.store.take_mask(where[:, 1:]).astype(bool)
        ones = np.ones((len(docs), self.seq_len), np.int32)  # one document a row; its padding comes after it
        return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "segment_ids": ones,
                "positions": np.broadcast_to(np.arange(self.seq_len, dtype=np.int32), ones.shape).copy(),
                "loss_mask": mask.astype(np.int32)}


class PairSplit(DocumentRows):
    """The rows of one split of a pair store (see the module's docstring): two a pair, in a seeded order."""

    def __init__(self, store: TokenStore, seq_len: int, split: str, validation_fraction: float, seed: int):
        if not store.manifest.get("pairs") or store.num_documents % 2:
            raise DataError(f"store '{store.path}' holds no chosen/rejected pairs; prepare one with "
                            "jaxtron prepare --pairs.")
        super().__init__(store, seq_len, split, validation_fraction, seed, per_item=2, what="pairs")
