"""Blockwise attention: outputs, softmax statistics and gradients equal those of whole-matrix attention, for
grouped queries, packed documents, any query slice against the whole sequence, and combined partial results."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxtron.ops.blockwise import blockwise_attention, combine


def _reference(q, k, v, q_pos, k_pos, q_seg=None, k_seg=None):
    """Whole-matrix attention with the same masks: output and log-sum-exp."""
    g = q.shape[2] // k.shape[2]
    kr, vr = jnp.repeat(k, g, axis=2), jnp.repeat(v, g, axis=2)
    s = jnp.einsum("bqhd,bkhd->bhqk", q, kr) / np.sqrt(q.shape[-1])
    seen = k_pos[:, None, :] <= q_pos[:, :, None]
    if q_seg is not None:
        seen &= k_seg[:, None, :] == q_seg[:, :, None]
    s = jnp.where(seen[:, None], s, -jnp.inf)
    lse = jax.nn.logsumexp(s, axis=-1)
    out = jnp.einsum("bhqk,bkhd->bqhd", jnp.exp(s - lse[..., None]), vr)
    return out, jnp.moveaxis(lse, 1, 2)


def _inputs(seed, b=2, length=32, heads=4, kv_heads=2, d=8):
    keys = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(keys[0], (b, length, heads, d))
    k = jax.random.normal(keys[1], (b, length, kv_heads, d))
    v = jax.random.normal(keys[2], (b, length, kv_heads, d))
    pos = jnp.broadcast_to(jnp.arange(length), (b, length))
    return q, k, v, pos


def _loss(out, lse):
    return jnp.sum(jnp.sin(out) * jnp.arange(out.size).reshape(out.shape) / out.size) + 0.1 * jnp.sum(lse ** 2)


@pytest.mark.parametrize("block_q,block_k,packed", [(8, 4, False), (32, 32, False), (8, 8, True), (16, 4, True)])
def test_blockwise_attention_equals_whole_matrix_attention(block_q, block_k, packed):
    q, k, v, pos = _inputs(block_q * 10 + block_k)
    seg = None
    if packed:  # documents of 5, 12 and 15 tokens in row 0, one of 32 in row 1
        seg = jnp.stack([jnp.repeat(jnp.array([1, 2, 3]), jnp.array([5, 12, 15]), total_repeat_length=32),
                         jnp.ones(32, jnp.int32)])
    got = blockwise_attention(q, k, v, pos, pos, seg, seg, block_q=block_q, block_k=block_k)
    want = _reference(q, k, v, pos, pos, seg, seg)
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    grads = jax.grad(lambda q, k, v: _loss(*blockwise_attention(q, k, v, pos, pos, seg, seg, block_q=block_q,
                                                                 block_k=block_k)), argnums=(0, 1, 2))(q, k, v)
    expected = jax.grad(lambda q, k, v: _loss(*_reference(q, k, v, pos, pos, seg, seg)), argnums=(0, 1, 2))(q, k, v)
    for a, b in zip(grads, expected, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_a_slice_of_queries_against_the_whole_sequence_and_partial_results_combine():
    """The two chunks a device holds in a load-balanced layout (tokens 0-7 and 24-31) against all keys equal
    those rows of the full attention; attention over two halves of the keys combines into the whole."""
    q, k, v, pos = _inputs(7)
    rows = jnp.concatenate([jnp.arange(8), jnp.arange(24, 32)])
    out, lse = blockwise_attention(q[:, rows], k, v, pos[:, rows], pos, block_q=4, block_k=8)
    want_out, want_lse = _reference(q, k, v, pos, pos)
    np.testing.assert_allclose(out, want_out[:, rows], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(lse, want_lse[:, rows], rtol=1e-5, atol=1e-5)

    def halves(q, k, v):
        parts = [blockwise_attention(q, k[:, s], v[:, s], pos, pos[:, s], block_q=8, block_k=8)
                 for s in (slice(0, 16), slice(16, 32))]
        return combine(parts)

    got = halves(q, k, v)
    for a, b in zip(got, (want_out, want_lse), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    grads = jax.grad(lambda *a: _loss(*halves(*a)), argnums=(0, 1, 2))(q, k, v)
    expected = jax.grad(lambda *a: _loss(*_reference(*a, pos, pos)), argnums=(0, 1, 2))(q, k, v)
    for a, b in zip(grads, expected, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def test_no_whole_score_matrix_is_held():
    """At 4096 tokens the compiled gradient's temporaries stay far below one [length, length] float32 matrix
    per head (what whole-matrix attention holds), alone and in a scanned stack of layers (where masks that
    depend on positions only must not be computed ahead of the loop for every pair of blocks)."""
    b, length, heads, d = 1, 4096, 2, 16
    q = jax.ShapeDtypeStruct((b, length, heads, d), jnp.float32)
    pos = jax.ShapeDtypeStruct((b, length), jnp.int32)
    f = jax.jit(jax.grad(lambda q, k, v, p: jnp.sum(blockwise_attention(q, k, v, p, p, block_q=256,
                                                                       block_k=256)[0]), argnums=(0, 1, 2)))
    temp = f.lower(q, q, q, pos).compile().memory_analysis().temp_size_in_bytes
    assert temp < 0.1 * heads * length * length * 4, temp

    def stack(h, weights, p):
        layer = lambda h, w: (h + blockwise_attention(h * w, h, h, p, p, block_q=256, block_k=256)[0], None)
        return jnp.sum(jax.lax.scan(layer, h, weights)[0])

    g = jax.jit(jax.grad(stack, argnums=(0, 1)))
    temp = g.lower(q, jax.ShapeDtypeStruct((2,), jnp.float32), pos).compile().memory_analysis().temp_size_in_bytes
    assert temp < 0.1 * heads * length * length * 4, temp


@pytest.mark.parametrize("mesh_shape", [dict(sequence=8), dict(data=2, sequence=2, tensor=2),
                                        dict(fsdp=2, sequence=4)])
def test_context_parallel_attention_equals_one_device(mesh_shape):
    """Queries split over the sequence axis (with batch and heads split too): outputs and gradients are those of
    the unsharded computation, packed documents included."""
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    from jaxtron.ops.blockwise import context_parallel_attention

    q, k, v, pos = _inputs(3, b=2, length=64, heads=4, kv_heads=2)
    seg = jnp.stack([jnp.repeat(jnp.array([1, 2, 3]), jnp.array([9, 30, 25]), total_repeat_length=64),
                     jnp.ones(64, jnp.int32)])
    want = _reference(q, k, v, pos, pos, seg, seg)[0]
    want_grads = jax.grad(lambda *a: _loss(_reference(*a, pos, pos, seg, seg)[0], 0.0), argnums=(0, 1, 2))(q, k, v)
    names = ("pipeline", "data", "fsdp", "sequence", "expert", "tensor")
    mesh = jax.make_mesh(tuple(mesh_shape.get(a, 1) for a in names), names, axis_types=(AxisType.Explicit,) * 6)
    with jax.set_mesh(mesh):
        rows = NamedSharding(mesh, P(("data", "fsdp", "expert"), "sequence"))
        heads = NamedSharding(mesh, P(("data", "fsdp", "expert"), "sequence", "tensor"))
        args = [jax.device_put(x, heads) for x in (q, k, v)]
        pos_s, seg_s = jax.device_put(pos, rows), jax.device_put(seg, rows)
        f = jax.jit(lambda q, k, v: context_parallel_attention(q, k, v, pos_s, seg_s, block_q=8, block_k=16))
        got = f(*args)
        grads = jax.jit(jax.grad(lambda *a: _loss(f(*a), 0.0), argnums=(0, 1, 2)))(*args)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    for a, b in zip(grads, want_grads, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
