"""The gated delta rule: the chunked form against the token-by-token recurrence, values and gradients, and the
recurrence against the rule written out in float64 numpy."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxtron.ops import delta_rule


def _inputs(seed: int, b: int, t: int, h: int, dk: int, dv: int, decay: float = 2.0):
    """Normalised keys and queries (as Gated DeltaNet feeds them), decays down to -``decay`` a step, a start state."""
    rng = np.random.default_rng(seed)
    q, k = rng.normal(size=(b, t, h, dk)), rng.normal(size=(b, t, h, dk))
    q = q / np.linalg.norm(q, axis=-1, keepdims=True) / np.sqrt(dk)
    k = k / np.linalg.norm(k, axis=-1, keepdims=True)
    v = rng.normal(size=(b, t, h, dv))
    g, beta = -rng.uniform(0, decay, size=(b, t, h)), rng.uniform(0, 1, size=(b, t, h))
    state = rng.normal(size=(b, h, dk, dv))
    return q, k, v, g, beta, state


def _numpy_rule(q, k, v, g, beta, state):
    """The rule as the module docstring writes it, one step and one head at a time, in float64."""
    b, t, h, _ = k.shape
    out = np.zeros(v.shape)
    s = state.copy()
    for i in range(b):
        for j in range(h):
            for n in range(t):
                decayed = np.exp(g[i, n, j]) * s[i, j]
                w = beta[i, n, j] * (v[i, n, j] - decayed.T @ k[i, n, j])
                s[i, j] = decayed + np.outer(k[i, n, j], w)
                out[i, n, j] = s[i, j].T @ q[i, n, j]
    return out, s


def test_the_recurrence_is_the_rule_written_out():
    arrays = _inputs(0, 2, 9, 2, 4, 3)
    want_out, want_state = _numpy_rule(*arrays)
    out, state = delta_rule.recurrent(*(jnp.asarray(a, jnp.float32) for a in arrays))
    np.testing.assert_allclose(out, want_out, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(state, want_state, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("t,chunk,decay", [(150, 64, 2.0), (40, 64, 2.0), (128, 64, 0.05), (70, 16, 30.0)])
def test_the_chunked_form_equals_the_recurrence(t, chunk, decay):
    """Outputs and final state to 1e-5 in float32: a length not a multiple of the chunk, one shorter than a chunk,
    slow decay (a long memory) and decay strong enough to underflow within a chunk."""
    arrays = [jnp.asarray(a, jnp.float32) for a in _inputs(1, 2, t, 3, 16, 8, decay)]
    want_out, want_state = delta_rule.recurrent(*arrays)
    out, state = delta_rule.chunked(*arrays, chunk=chunk)
    np.testing.assert_allclose(out, want_out, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(state, want_state, rtol=1e-5, atol=1e-5)


def test_the_chunked_form_starts_from_zero_without_a_state():
    q, k, v, g, beta, _ = (jnp.asarray(a, jnp.float32) for a in _inputs(2, 1, 70, 2, 8, 8))
    zero = jnp.zeros((1, 2, 8, 8), jnp.float32)
    np.testing.assert_allclose(delta_rule.chunked(q, k, v, g, beta)[0], delta_rule.recurrent(q, k, v, g, beta, zero)[0],
                               rtol=1e-5, atol=1e-6)


def test_the_chunked_gradient_equals_the_recurrences():
    """The gradient of a loss of the outputs and the final state, for every input and the start state."""
    arrays = tuple(jnp.asarray(a, jnp.float32) for a in _inputs(3, 2, 100, 2, 8, 4))
    weights = jnp.asarray(np.random.default_rng(4).normal(size=(2, 100, 2, 4)), jnp.float32)

    def loss(form, *xs):
        out, state = form(*xs)
        return jnp.sum(out * weights) + jnp.sum(jnp.sin(state))

    want = jax.grad(lambda *xs: loss(delta_rule.recurrent, *xs), argnums=range(6))(*arrays)
    got = jax.grad(lambda *xs: loss(lambda *a: delta_rule.chunked(*a, chunk=32), *xs), argnums=range(6))(*arrays)
    for name, w, gv in zip(("q", "k", "v", "g", "beta", "state"), want, got, strict=True):
        scale = float(jnp.max(jnp.abs(w)))
        np.testing.assert_allclose(gv, w, rtol=1e-5, atol=1e-5 * max(scale, 1.0), err_msg=name)


def test_bfloat16_inputs_run_in_float32_and_return_their_dtype():
    arrays = [jnp.asarray(a, jnp.float32) for a in _inputs(5, 1, 64, 2, 8, 8)]
    low = [a.astype(jnp.bfloat16) for a in arrays[:3]] + arrays[3:]
    out, state = delta_rule.chunked(*low)
    want, _ = delta_rule.recurrent(*[a.astype(jnp.float32) for a in low])
    assert out.dtype == jnp.bfloat16 and state.dtype == jnp.float32
    np.testing.assert_allclose(out.astype(jnp.float32), want.astype(jnp.bfloat16).astype(jnp.float32), atol=2e-2)


@pytest.mark.parametrize("chunk", [pytest.param(16, marks=pytest.mark.extended), 64])  # chunks of 16: extended
def test_packed_documents_start_from_zero_state(chunk):
    """Segments that change within a chunk and at a chunk's edge: each document equals it run alone from zero,
    in both forms (the first continues the given start state)."""
    q, k, v, g, beta, state = (jnp.asarray(a, jnp.float32) for a in _inputs(6, 2, 80, 2, 8, 4))
    cuts = [(0, 16, 21, 50, 80), (0, 33, 80)]
    segments = np.zeros((2, 80), np.int32)
    for row, ends in enumerate(cuts):
        for n, (a, e) in enumerate(itertools.pairwise(ends)):
            segments[row, a:e] = n + 1
    out, final = delta_rule.chunked(q, k, v, g, beta, state, jnp.asarray(segments), chunk=chunk)
    ref_out, ref_final = delta_rule.recurrent(q, k, v, g, beta, state, jnp.asarray(segments))
    np.testing.assert_allclose(out, ref_out, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(final, ref_final, rtol=1e-5, atol=1e-5)
    for row, ends in enumerate(cuts):
        for a, e in itertools.pairwise(ends):
            part = (x[row:row + 1, a:e] for x in (q, k, v, g, beta))
            alone, alone_final = delta_rule.recurrent(*part, state[row:row + 1] if a == 0 else None)
            np.testing.assert_allclose(out[row:row + 1, a:e], alone, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(final[row:row + 1], alone_final, rtol=1e-5, atol=1e-5)


def test_the_unit_lower_inverse_inverts():
    """(I + A)^-1 by doubling against numpy's inverse, for A strictly lower with entries as large as the rule's."""
    a = np.tril(np.random.default_rng(7).uniform(-1, 1, size=(2, 3, 64, 64)), -1)
    got = np.asarray(delta_rule.unit_lower_inverse(jnp.asarray(a, jnp.float32)))
    want = np.linalg.inv(np.eye(64) + a)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
