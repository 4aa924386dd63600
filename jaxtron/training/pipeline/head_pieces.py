"""The 1F1B schedules' head with its tokens split over the stages: each stage runs the head and the loss of every
S-th token of the last stage's output (``one_f_one_b.py``), where every stage once ran all of them.

The pieces travel by one all-to-all over the pipeline each way. The last stage's output is cut into the S pieces
and each goes to its stage; their gradients come back the same way and join on the last stage in token order.
Taken from the whole output instead, XLA broadcast the output to every stage as a sum over the pipeline, and
joined the gradients by a gather and a second sum: on GPT-3 175B's published layout (pipeline=8 data=4 tensor=4,
H100 target) a 151 MB float32 sum and three 75 MB bf16 collectives over the stages each iteration, where the two
all-to-alls move 75 MB each.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxtron.models.transformer import EMBED_AXES
from jaxtron.parallel.sharding import constrain, shard_count

# [stages, stages, rows, tokens / stages, embed]: the pieces by stage, with the other stage's index beside
PIECES_AXES = ("stages", None, *EMBED_AXES)


def head_pieces(stages: int, tokens: int, depth: int) -> int:
    """How many pieces the head's tokens split into, one a stage: ``stages`` where each stage's piece keeps whole
    shards of the tokens' own split (sequence, tensor), else 1 (every stage runs the whole head). The prediction
    modules (``depth``) read the tokens beside each one, so their heads run whole."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or stages == 1 or depth:
        return 1
    if tokens % (stages * shard_count(dict(mesh.shape), EMBED_AXES[1])):
        return 1
    return stages


def at_stage(grads: list, stage: int, stages: int) -> list:
    """Gradients as the stages' sums take them, [S, ...]: ``grads`` at ``stage``, zeros at the others (the head's
    whole on every stage, its parameters' gradients counted once)."""
    at = jnp.arange(stages) == stage
    return [jnp.where(at.reshape(-1, *(1,) * g.ndim), g[None], 0.0) for g in grads]


def token_pieces(a: jax.Array, pieces: int) -> jax.Array:
    """[b, T, ...] -> [S, b, T / S, ...]: piece j holds tokens j, S + j, 2S + j, ... (each shard of the tokens'
    split keeps its own, so the cut moves nothing)."""
    return jnp.moveaxis(a.reshape(a.shape[0], a.shape[1] // pieces, pieces, *a.shape[2:]), 2, 0)


def to_stages(out: jax.Array) -> jax.Array:
    """The last stage's output cut into pieces, piece j on stage j: [S, b, T, D] held by stage -> [S, b, T / S, D]
    held by stage. Every stage sends its own output's pieces (one all-to-all); each keeps the last stage's."""
    s_, b, t, d = out.shape
    by_source = constrain(out.reshape(s_, b, t // s_, s_, d).transpose(0, 3, 1, 2, 4), PIECES_AXES)
    by_target = constrain(jnp.swapaxes(by_source, 0, 1), PIECES_AXES)  # [target, source, ...]
    return by_target[:, s_ - 1]


def to_last(d_pieces: jax.Array) -> jax.Array:
    """The pieces' gradients joined on the last stage in token order: [S, b, T / S, D] held by stage -> [S, b, T, D]
    held by stage, the last stage's the whole gradient and the others' zeros (one all-to-all)."""
    s_, b, t, d = d_pieces.shape
    last = (jnp.arange(s_) == s_ - 1).reshape(1, s_, 1, 1, 1)
    by_source = constrain(jnp.where(last, d_pieces[:, None], 0).astype(d_pieces.dtype), PIECES_AXES)
    by_target = constrain(jnp.swapaxes(by_source, 0, 1), PIECES_AXES)  # [target, piece, ...]
    return jnp.moveaxis(by_target, 1, 3).reshape(s_, b, t * s_, d)
