"""A verifiable task for RL, built in: adding two numbers, asked in words a byte-level model reads.

``arithmetic-chat`` holds conversations (a question and its answer) for a base model's supervised fine-tuning;
``arithmetic-prompts`` holds the same questions as RL prompts, each record with its operands, and ``reward``
checks a completion against them. The problems are every sum of two numbers below ``LIMIT``, in an order
shuffled by a fixed seed. One conversation in four answers with the number alone; the others add the terms
("7 (3 + 4)"). The reward takes the number alone. So a fine-tuned base mostly adds the terms, and RL has two
things to learn: the form the checker takes, and the sums the base still gets wrong. The sum comes first in both
forms, so what the base knows of the sums serves either.
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


def answer(a: int, b: int, with_terms: bool) -> str:
    return f"{a + b} ({a} + {b})" if with_terms else str(a + b)


def conversations() -> list[dict]:
    """Every problem as a conversation; three answers in four add the terms, the fourth is the number alone."""
    return [{"messages": [{"role": "user", "content": question(a, b)},
                          {"role": "assistant", "content": answer(a, b, i % 4 != 0)}]}
            for i, (a, b) in enumerate(problems())]


def prompts() -> list[dict]:
    """Every problem as an RL prompt: each record keeps its operands for ``reward``."""
    return [{"prompt": question(a, b), "a": a, "b": b} for a, b in problems()]


def reward(prompt: str, completion: str, record: dict) -> float:
    """1 for the right sum written alone (blanks around it allowed), else 0: an answer with its terms scores 0."""
    return 1.0 if completion.strip() == str(record["a"] + record["b"]) else 0.0
