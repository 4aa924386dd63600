"""A verifiable task for RL, built in: adding two numbers, asked in words a byte-level model reads.

``arithmetic-chat`` holds conversations (a question and its answer) for a base model's supervised fine-tuning;
``arithmetic-prompts`` holds the same questions as RL prompts, each record with its operands, and ``reward``
checks a completion against them. The problems are every sum of two numbers below ``LIMIT``, in an order
shuffled by a fixed seed; the conversations take the first half, the prompts the second, so RL asks questions
fine-tuning never showed.
"""

from __future__ import annotations

import random

LIMIT = 20  # operands 0..19: answers of one or two digits


def problems() -> list[tuple[int, int]]:
    """Every (a, b) with both below ``LIMIT``, in a fixed shuffled order."""
    pairs = [(a, b) for a in range(LIMIT) for b in range(LIMIT)]
    random.Random(0).shuffle(pairs)
    return pairs


def question(a: int, b: int) -> str:
    return f"What is {a} + {b}?"


def conversations() -> list[dict]:
    """The first half of the problems as conversations: the assistant answers with the sum alone."""
    half = problems()
    return [{"messages": [{"role": "user", "content": question(a, b)}, {"role": "assistant", "content": str(a + b)}]}
            for a, b in half]


def prompts() -> list[dict]:
    """The second half as RL prompts: each record keeps its operands for ``reward``."""
    return [{"prompt": question(a, b), "a": a, "b": b} for a, b in problems()]


def reward(prompt: str, completion: str, record: dict) -> float:
    """1 for the right sum, written alone (blanks around it allowed), else 0."""
    return 1.0 if completion.strip() == str(record["a"] + record["b"]) else 0.0
