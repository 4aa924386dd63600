"""The timetable of the 1F1B pipeline schedules (``training/pipeline/one_f_one_b.py``), in one place: which unit of
work each stage runs in each iteration. The schedule runs it; the report (``metrics/bubble.py``) reads a trace by it.

S stages, M microbatches, V chunks of layers a stage (1: '1f1b'; 'interleaved' takes ``pipeline.virtual_stages``).
A stage's k-th forward unit is microbatch ``k // (S V) * S + k % S`` through chunk ``k % (S V) // S``: the
microbatches go in waves of S, each wave through chunk 0, then 1, ..., so what stage S - 1 hands on in one
iteration is what stage 0 takes in the next. Its k-th backward unit takes the same microbatch through chunk V - 1 -
that. Iteration t runs forward unit t - s and backward unit t - (V S - 1) - (S - 1 - s) on stage s. The arithmetic
works on ints, numpy arrays and jax arrays alike.
"""

from __future__ import annotations

from typing import Any


def iterations(stages: int, microbatches: int, virtual: int = 1) -> int:
    """The schedule's iterations: M V + V S + S - 2 (M + 2(S - 1) for 1F1B)."""
    return microbatches * virtual + virtual * stages + stages - 2


def forward_iterations(stages: int, microbatches: int, virtual: int = 1) -> int:
    """The iterations that run a forward phase: the first M V + S - 1."""
    return microbatches * virtual + stages - 1


def first_backward(stages: int, virtual: int = 1) -> int:
    """The first iteration that runs a backward phase: V S - 1."""
    return virtual * stages - 1


def forward_unit(t: Any, stage: Any) -> Any:
    return t - stage


def backward_unit(t: Any, stage: Any, stages: int, virtual: int = 1) -> Any:
    return t - first_backward(stages, virtual) - (stages - 1 - stage)


def unit(k: Any, stages: int, microbatches: int, virtual: int = 1, backward: bool = False) -> tuple[Any, Any, Any]:
    """A stage's k-th forward (or backward) unit -> (whether it is one, its microbatch, its chunk)."""
    wave, r = k // (stages * virtual), k % (stages * virtual)
    chunk = r // stages
    valid = (k >= 0) & (k < microbatches * virtual)
    return valid, wave * stages + r % stages, (virtual - 1 - chunk) if backward else chunk


def forward_unit_of_backward(j: Any, stages: int, virtual: int = 1) -> Any:
    """The forward unit of the microbatch and chunk that backward unit ``j`` takes (whose kept inputs it reads)."""
    _, _, chunk = unit(j, stages, 0, virtual, backward=True)
    return j // (stages * virtual) * (stages * virtual) + chunk * stages + j % stages


def kept(stages: int, virtual: int = 1) -> int:
    """Units whose inputs a stage holds between their forward and their backward: the most iterations apart is
    2 V S - 2 (stage 0's chunk 0), one forward an iteration."""
    return 2 * virtual * stages - 1
