"""The loss of the output head: cross-entropy (and z-loss) over the vocabulary from the final hidden states, with
its gradient made in the same pass.

The logits of a large vocabulary are the largest activation of a step (Llama-3's 128k: 2 GiB of float32 per 4k
tokens), so they are made a slice of the sequence at a time and never kept: each slice's forward also computes the
logits' gradient (softmax minus the one-hot target, weighted) and from it the gradients of the hidden states and of
the head, which wait for the backward pass to scale them by the loss's cotangent. Differentiating the loss the
usual way would keep the logits, or recompute them (the head's largest GEMM a second time) and run the backward's
GEMMs on float32 operands. Here every GEMM takes compute-dtype operands and accumulates in float32, and the head's
gradient is summed over the slices in float32.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxtron.parallel.sharding import constrain

LOGIT_AXES = ("activation_batch", "activation_length", "activation_vocab")
HEAD_AXES = ("embed", "vocab")  # the head's own: its gradient, summed over the batch, is split as the weight is


def logits_of(x: jax.Array, head: jax.Array) -> jax.Array:
    """[batch, length, embed] x [embed, vocab] -> float32 logits, straight out of the matmul (the loss needs
    float32 and no 16-bit copy is kept besides)."""
    logits = jnp.einsum("btd,dv->btv", x, head, preferred_element_type=jnp.float32)
    return constrain(logits, LOGIT_AXES)


def _slices(a: jax.Array, chunks: int) -> jax.Array:
    """[batch, length, ...] -> [chunks, batch, length / chunks, ...]; slice j holds positions j, j + chunks, ...:
    a sequence axis sharded in contiguous blocks stays sharded inside a slice."""
    a = a.reshape(a.shape[0], a.shape[1] // chunks, chunks, *a.shape[2:])
    return jnp.moveaxis(a, 2, 0)


def _unslice(a: jax.Array) -> jax.Array:
    """``_slices``' inverse: [chunks, batch, length / chunks, ...] -> [batch, length, ...]."""
    a = jnp.moveaxis(a, 0, 2)
    return a.reshape(a.shape[0], a.shape[1] * a.shape[2], *a.shape[3:])


def _max_and_scaled_sum(a, b):
    """Merges two (maximum, sum of exp(x - maximum)) pairs of disjoint parts of a row."""
    (m_a, s_a), (m_b, s_b) = a, b
    m = jnp.maximum(m_a, m_b)
    # a part whose maximum is the merged one keeps its sum as is (also where both are -inf: no exp(nan))
    return m, jnp.where(m_a == m, s_a, s_a * jnp.exp(m_a - m)) + jnp.where(m_b == m, s_b, s_b * jnp.exp(m_b - m))


def log_partition(logits: jax.Array) -> jax.Array:
    """log sum exp over the last axis in one pass over the logits: a reduction of (maximum, scaled sum) pairs.
    ``jax.nn.logsumexp`` reads them twice (the maximum, then the sum): Llama-3 8B's float32 logits at sequence
    4096 x 4 are 8.4 GB, 2.9 ms a read on an H200. A vocabulary split over devices reduces each part locally and
    gathers the parts' pairs: one float32 gather of two floats a row and part (the named scope finds it)."""
    init = (jnp.array(-jnp.inf, logits.dtype), jnp.array(0, logits.dtype))
    with jax.named_scope("log_partition"):
        m, s = jax.lax.reduce((logits, jnp.ones_like(logits)), init, _max_and_scaled_sum, (logits.ndim - 1,))
        return m + jnp.log(s)


def _sums(logits: jax.Array, targets: jax.Array, weights: jax.Array):
    """(cross-entropy sum, squared log-partition sum, log-partition [batch, length], one-hot targets)."""
    log_z = log_partition(logits)
    # a one-hot product instead of a gather keeps the vocabulary axis sharded
    one_hot = jax.nn.one_hot(targets, logits.shape[-1], dtype=logits.dtype)
    target_logit = jnp.sum(logits * one_hot, -1)
    return jnp.sum((log_z - target_logit) * weights), jnp.sum(jnp.square(log_z) * weights), log_z, one_hot


def _slice_forward(x, head, targets, weights, z_loss: float, gradient: bool):
    """One slice: (cross-entropy sum, z sum) and, with ``gradient``, the gradients of (cross-entropy + z_loss x z)
    with respect to ``x`` (in its dtype) and ``head`` (float32)."""
    with jax.named_scope("loss"):
        logits = logits_of(x, head)
        ce, zz, log_z, one_hot = _sums(logits, targets, weights)
        if not gradient:
            return ce, zz
        # d/dlogits of sum_t w (log_z - logit[target]) + z_loss w log_z^2 = w (1 + 2 z_loss log_z) softmax - w one_hot
        scale = weights * (1.0 + 2.0 * z_loss * log_z)
        d_logits = jnp.exp(logits - log_z[..., None]) * scale[..., None] - one_hot * weights[..., None]
        d_logits = constrain(d_logits.astype(x.dtype), LOGIT_AXES)
        d_x = jnp.einsum("btv,dv->btd", d_logits, head, preferred_element_type=jnp.float32).astype(x.dtype)
        d_head = constrain(jnp.einsum("btd,btv->dv", x, d_logits, preferred_element_type=jnp.float32), HEAD_AXES)
        return ce, zz, d_x, d_head


def _run(x, head, targets, weights, z_loss: float, chunks: int, gradient: bool):
    """Every slice in turn (a scan): -> (cross-entropy sum, z sum) and with ``gradient`` the two gradients."""
    one = functools.partial(_slice_forward, z_loss=z_loss, gradient=gradient)
    if chunks == 1:
        return one(x, head, targets, weights)
    zero = jnp.zeros((), jnp.float32)

    def body(carry, part):
        out = one(part[0], head, part[1], part[2])
        sums = (carry[0] + out[0], carry[1] + out[1])
        if not gradient:
            return sums, None
        return (*sums, carry[2] + out[3]), out[2]

    parts = (_slices(x, chunks), _slices(targets, chunks), _slices(weights, chunks))
    if not gradient:
        return jax.lax.scan(body, (zero, zero), parts)[0]
    (ce, zz, d_head), d_x = jax.lax.scan(body, (zero, zero, jnp.zeros(head.shape, jnp.float32)), parts)
    return ce, zz, _unslice(d_x), d_head


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def token_sums(x: jax.Array, head: jax.Array, targets: jax.Array, weights: jax.Array, z_loss: float = 0.0,
               chunks: int = 1) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(objective, cross-entropy sum, squared log-partition sum) of hidden states ``x`` [batch, length, embed]
    under ``head`` [embed, vocab], over the positions ``weights`` [batch, length] weighs, with ``targets``
    [batch, length]; the objective is cross-entropy + ``z_loss`` x the squared log-partition. The logits are made
    ``chunks`` slices of the sequence at a time (it must divide the length).

    Only the objective has a gradient (the sums beside it are for reporting: a cotangent given to them is
    ignored); its gradients with respect to ``x`` and ``head`` are made in the forward pass (the module's
    docstring says why)."""
    ce, zz = _run(x, head, targets, weights, z_loss, chunks, gradient=False)
    return ce + z_loss * zz, ce, zz


def _forward(x, head, targets, weights, z_loss, chunks):
    ce, zz, d_x, d_head = _run(x, head, targets, weights, z_loss, chunks, gradient=True)
    # an empty array of the head's dtype tells the backward pass the dtype its gradient must have
    return (ce + z_loss * zz, ce, zz), (d_x, d_head, jnp.zeros((0,), head.dtype))


def _backward(z_loss, chunks, residuals, cotangents):
    d_x, d_head, head_like = residuals
    g = cotangents[0]  # the objective's; a multi-token prediction depth's is its weight in the whole objective
    d_x = (g * d_x.astype(jnp.float32)).astype(d_x.dtype)
    return d_x, (g * d_head).astype(head_like.dtype), None, None


token_sums.defvjp(_forward, _backward)


def target_log_probs(x: jax.Array, head: jax.Array, targets: jax.Array, chunks: int = 1) -> jax.Array:
    """[batch, length] float32: each target's log-probability from hidden states ``x`` under ``head``, per token
    (DPO's and GRPO's terms need them apart). With ``chunks`` > 1 the logits are made that many slices of the
    sequence at a time, and made again in the backward pass, so no slice's logits are kept. GRPO's step of
    Llama-3 8B at 4 layers (64 rows of 2048 tokens, tensor=8 H100s): whole, three float32 copies of the logits
    peak at 35.19 GiB a device; in 8 slices, 20.58 GiB, for 34 ms more of the head's GEMM (563.0 -> 597.4 ms)."""

    def one(x_part: jax.Array, targets_part: jax.Array) -> jax.Array:
        logits = logits_of(x_part, head)
        picked = jnp.take_along_axis(logits, targets_part[..., None], axis=-1)[..., 0]
        # logsumexp, not the one-pass log_partition above: jax cannot differentiate that variadic reduce
        return picked - jax.nn.logsumexp(logits, axis=-1)

    if chunks == 1:
        return one(x, targets)  # the logits kept for the backward: no second GEMM
    one = jax.checkpoint(one)
    return _unslice(jax.lax.map(lambda part: one(*part), (_slices(x, chunks), _slices(targets, chunks))))
