"""The gated delta rule on a sequence split over devices (``ops/delta_context.py``): each device runs its own
columns, handed the state of the pieces before; outputs and gradients equal one device's, with packed documents
(one starting exactly at a piece's first token) and the convolution's halo across pieces."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxtron.models.delta_net import causal_conv, l2_normalize
from jaxtron.ops import delta_context, delta_rule
from jaxtron.parallel.sharding import sequence_order

NAMES = ("pipeline", "data", "fsdp", "sequence", "expert", "tensor")
LENGTH, KEY_HEADS, VALUE_HEADS, DK, DV, TAPS = 64, 2, 4, 8, 16, 4


def _prepare(q, k, v, convs, segments):
    """The model's convolution and mix (models/delta_net.py), value heads two per key head."""
    q, k, v = (causal_conv(a, c, segments) for a, c in zip((q, k, v), convs, strict=True))
    q = jnp.repeat(l2_normalize(jax.nn.silu(q)) * DK ** -0.5, 2, axis=2)
    k = jnp.repeat(l2_normalize(jax.nn.silu(k)), 2, axis=2)
    return q, k, jax.nn.silu(v).astype(jnp.float32)


def _inputs(seed: int):
    keys = jax.random.split(jax.random.key(seed), 8)
    q = jax.random.normal(keys[0], (2, LENGTH, KEY_HEADS, DK))
    k = jax.random.normal(keys[1], (2, LENGTH, KEY_HEADS, DK))
    v = jax.random.normal(keys[2], (2, LENGTH, VALUE_HEADS, DV))
    convs = (jax.random.normal(keys[3], (TAPS, KEY_HEADS, DK)), jax.random.normal(keys[4], (TAPS, KEY_HEADS, DK)),
             jax.random.normal(keys[5], (TAPS, VALUE_HEADS, DV)))
    g = -jax.nn.softplus(jax.random.normal(keys[6], (2, LENGTH, VALUE_HEADS)))
    beta = jax.nn.sigmoid(jax.random.normal(keys[7], (2, LENGTH, VALUE_HEADS)))
    return q, k, v, convs, g, beta


def _one_device(q, k, v, convs, g, beta, segments):
    out, _ = delta_rule.chunked(*_prepare(q, k, v, convs, segments), g, beta, segments=segments)
    return out


WEIGHTS = np.arange(2 * LENGTH * VALUE_HEADS * DV).reshape(2, LENGTH, VALUE_HEADS, DV) / (2 * LENGTH * 64)


def _loss(out, weights=WEIGHTS):
    return jnp.sum(jnp.sin(out) * weights)


# row 0: documents of 16, 7 and 41 tokens (the second starts where a piece of 8 or 16 does); row 1: one document
SEGMENTS = jnp.asarray(np.stack([np.repeat([1, 2, 3], [16, 7, 41]), np.ones(LENGTH, int)]), jnp.int32)


@pytest.mark.slow
@pytest.mark.parametrize("mesh_shape,packed", [
    (dict(fsdp=2, sequence=2, tensor=2), True),
    # the first tier's time is close to its limit: more shards, and rows of one document, in the extended tier
    *(pytest.param(shape, packed, marks=pytest.mark.extended) for shape, packed in (
        (dict(sequence=2), True), (dict(sequence=4), True), (dict(sequence=4), False)))])
def test_the_rule_on_a_split_sequence_equals_one_device(mesh_shape, packed):
    q, k, v, convs, g, beta = _inputs(3)
    segments = SEGMENTS if packed else None
    want = _one_device(q, k, v, convs, g, beta, segments)
    want_grads = jax.grad(lambda *a: _loss(_one_device(*a, segments)), argnums=(0, 1, 2, 3, 4, 5))(
        q, k, v, convs, g, beta)
    order = sequence_order(LENGTH, mesh_shape["sequence"])  # the loader's columns
    mesh = jax.make_mesh(tuple(mesh_shape.get(a, 1) for a in NAMES), NAMES, axis_types=(AxisType.Explicit,) * 6)
    with jax.set_mesh(mesh):
        rows = NamedSharding(mesh, P(("data", "fsdp", "expert"), "sequence"))
        heads = NamedSharding(mesh, P(("data", "fsdp", "expert"), "sequence", "tensor"))
        args = [jax.device_put(x[:, order], heads) for x in (q, k, v, g, beta)]
        convs = tuple(jax.device_put(c, NamedSharding(mesh, P(None, "tensor"))) for c in convs)
        columns = None if segments is None else jax.device_put(segments[:, order], rows)

        def run(q, k, v, convs, g, beta):
            return delta_context.over_sequence(_prepare, q, k, v, convs, g, beta, columns)

        got = jax.jit(run)(*args[:3], convs, *args[3:])
        # the loss weighs each token as the one-device loss does, in the columns' order
        grads = jax.jit(jax.grad(lambda *a: _loss(run(*a), WEIGHTS[:, order]), argnums=(0, 1, 2, 3, 4, 5)))(
            *args[:3], convs, *args[3:])
    np.testing.assert_allclose(np.asarray(got), np.asarray(want)[:, order], rtol=1e-5, atol=1e-5)
    columns_grads = [grads[i] for i in (0, 1, 2)] + [grads[4], grads[5]]
    token_grads = [want_grads[i] for i in (0, 1, 2)] + [want_grads[4], want_grads[5]]
    for got_grad, want_grad in zip(columns_grads, token_grads, strict=True):
        np.testing.assert_allclose(np.asarray(got_grad), np.asarray(want_grad)[:, order], rtol=1e-4, atol=1e-5)
    for got_grad, want_grad in zip(grads[3], want_grads[3], strict=True):  # the convolutions' weights
        np.testing.assert_allclose(np.asarray(got_grad), np.asarray(want_grad), rtol=1e-4, atol=1e-5)


def test_each_device_holds_the_pieces_of_the_loaders_layout():
    """Zigzag: device i holds pieces i and 2S - 1 - i, as sequence_order lays the columns; each piece's
    predecessor is found in the gathered list."""
    table = delta_context.pieces(4)
    assert table.tolist() == [[0, 7], [1, 6], [2, 5], [3, 4]]
    order = sequence_order(64, 4).reshape(8, 8)[:, 0] // 8  # the first token of each column piece, in pieces
    assert order.tolist() == table.reshape(-1).tolist()
    before = delta_context._predecessors(table)
    assert before.tolist() == [[-1, 3], [0, 5], [2, 7], [4, 6]]
