"""Local windows and attention sinks: the written-out reference against a NumPy reading of transformers' eager
attention, each kernel (blockwise, the dispatcher's paths, the sink fold's own gradient) against the reference with
gradients, context parallelism that gathers only a window's keys, and the ring cache of generation."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxtron.ops import blockwise, dense, sinks
from jaxtron.ops.attention import dot_product_attention


def _numpy_attention(q, k, v, window, sink, segments=None):
    """transformers' eager attention, in NumPy float64: scores, a causal (and windowed: query minus key below the
    window) mask, the sink's logit as one more column, softmax, the sink column dropped."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    b, t, n, h = q.shape
    k, v = np.repeat(k, n // k.shape[2], axis=2), np.repeat(v, n // v.shape[2], axis=2)
    scores = np.einsum("bqnh,bknh->bnqk", q, k) / np.sqrt(h)
    i, j = np.arange(t)[:, None], np.arange(t)[None, :]
    seen = (j <= i) & ((i - j < window) if window else True)
    seen = np.broadcast_to(seen, (b, 1, t, t))
    if segments is not None:
        seen = seen & (segments[:, None, :, None] == segments[:, None, None, :])
    scores = np.where(seen, scores, -np.inf)
    if sink is not None:
        column = np.broadcast_to(np.asarray(sink, np.float64)[None, :, None, None], (b, n, t, 1))
        scores = np.concatenate([scores, column], axis=-1)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs = probs / probs.sum(-1, keepdims=True)
    if sink is not None:
        probs = probs[..., :-1]
    return np.einsum("bnqk,bknh->bqnh", probs, v)


def _inputs(seed, b=2, t=32, n=4, g=2, h=8):
    keys = jax.random.split(jax.random.key(seed), 4)
    q, k, v = (jax.random.normal(keys[i], (b, t, heads, h)) for i, heads in enumerate((n, g, g)))
    return q, k, v, 2.0 * jax.random.normal(keys[3], (n,))


def _loss(out):
    return jnp.sum(jnp.sin(out) * jnp.arange(out.size).reshape(out.shape) / out.size)


def _packed(t=32):
    """Documents of 5, 12 and 15 tokens in row 0, one of t in row 1, with positions restarting at each."""
    seg = np.stack([np.repeat([1, 2, 3], [5, 12, 15]), np.ones(t, np.int64)]).astype(np.int32)
    pos = np.stack([np.concatenate([np.arange(5), np.arange(12), np.arange(15)]), np.arange(t)]).astype(np.int32)
    return jnp.asarray(seg), jnp.asarray(pos)


@pytest.mark.parametrize("window,with_sinks", [(0, True), (6, False), (6, True), (1, True)])
def test_reference_is_transformers_eager_attention(window, with_sinks):
    q, k, v, s = _inputs(window)
    pos = jnp.broadcast_to(jnp.arange(32), (2, 32))
    got = dense.attention(q, k, v, dense.visible(pos, pos, None, None, window), s if with_sinks else None)
    want = _numpy_attention(q, k, v, window, np.asarray(s) if with_sinks else None)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("packed", [False, True])
def test_blockwise_kernel_with_window_and_folded_sinks_equals_the_reference(packed):
    q, k, v, s = _inputs(3)
    seg, pos = _packed() if packed else (None, jnp.broadcast_to(jnp.arange(32), (2, 32)))

    def kernel(q, k, v, s):
        out, lse = blockwise.blockwise_attention(q, k, v, pos, pos, seg, seg, block_q=8, block_k=4, window=6)
        return sinks.fold(out, lse, s)

    def reference(q, k, v, s):
        return dense.attention(q, k, v, dense.visible(pos, pos, seg, seg, 6), s)

    np.testing.assert_allclose(kernel(q, k, v, s), reference(q, k, v, s), rtol=1e-5, atol=1e-5)
    grads = jax.grad(lambda *a: _loss(kernel(*a)), argnums=(0, 1, 2, 3))(q, k, v, s)
    expected = jax.grad(lambda *a: _loss(reference(*a)), argnums=(0, 1, 2, 3))(q, k, v, s)
    for a, b in zip(grads, expected, strict=True):
        assert float(jnp.abs(b).max()) > 1e-3  # every gradient, the sinks' too, is exercised
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


class _BlockwiseStats:
    """The blockwise kernel behind the ``sinks.StatsKernel`` protocol: its backward differentiates whatever output
    and statistics it is given, as cuDNN's does."""

    def __init__(self, window):
        self.window = window

    def forward(self, q, k, v, extras):
        (pos,) = extras
        return blockwise.forward(q, k, v, pos, pos, None, None, 8, 8, self.window)

    def backward(self, q, k, v, extras, out, lse, d_out):
        (pos,) = extras
        return blockwise.backward(q, k, v, pos, pos, None, None, out, lse, d_out, None, 8, 8, self.window)

    def __hash__(self):
        return hash(self.window)

    def __eq__(self, other):
        return isinstance(other, _BlockwiseStats) and other.window == self.window


@pytest.mark.parametrize("window", [0, 5])
def test_sink_fold_gradient_runs_the_kernels_own_backward_on_the_sunk_output(window):
    """The custom gradient cuDNN's path uses (``sinks.with_sinks``): the kernel's backward given the sunk output and
    the scaled cotangent, the sinks' gradient from the share the keys keep. Against autodiff of the reference."""
    q, k, v, s = _inputs(11)
    pos = jnp.broadcast_to(jnp.arange(32), (2, 32))
    kernel = _BlockwiseStats(window)

    def reference(q, k, v, s):
        return dense.attention(q, k, v, dense.visible(pos, pos, None, None, window), s)

    got = sinks.with_sinks(kernel, q, k, v, s, (pos,))
    np.testing.assert_allclose(got, reference(q, k, v, s), rtol=1e-5, atol=1e-5)
    grads = jax.grad(lambda *a: _loss(sinks.with_sinks(kernel, *a, (pos,))), argnums=(0, 1, 2, 3))(q, k, v, s)
    expected = jax.grad(lambda *a: _loss(reference(*a)), argnums=(0, 1, 2, 3))(q, k, v, s)
    for a, b in zip(grads, expected, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("implementation", ["xla", "blockwise"])
def test_dispatcher_paths_agree_on_windows_and_sinks_with_packed_documents(implementation):
    q, k, v, s = _inputs(5)
    seg, pos = _packed()
    got = dot_product_attention(q, k, v, implementation=implementation, segment_ids=seg, positions=pos, window=4,
                                sinks=s)
    want = np.concatenate([_numpy_attention(q[:1, a:b], k[:1, a:b], v[:1, a:b], 4, np.asarray(s))
                           for a, b in ((0, 5), (5, 17), (17, 32))], axis=1)
    np.testing.assert_allclose(got[:1], want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got[1:], _numpy_attention(q[1:], k[1:], v[1:], 4, np.asarray(s)), rtol=1e-5,
                               atol=1e-5)


@pytest.mark.parametrize("mesh_shape,balanced", [(dict(sequence=4), True), (dict(data=2, sequence=2, tensor=2), False)])
def test_context_parallel_window_gathers_only_the_windows_keys_and_equals_one_device(mesh_shape, balanced):
    """A window shorter than half a shard: each device gathers the last window - 1 keys of each half of every
    shard, not the row, and outputs and gradients (the sinks' too) equal one device's, in the loader's balanced
    layout and in the plain split, with packed documents."""
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    from jaxtron.parallel.sharding import sequence_order

    length, window = 64, 5
    q, k, v, s = _inputs(21, t=length)
    seg = jnp.stack([jnp.repeat(jnp.array([1, 2, 3]), jnp.array([9, 30, 25]), total_repeat_length=length),
                     jnp.ones(length, jnp.int32)])
    pos = jnp.stack([jnp.concatenate([jnp.arange(9), jnp.arange(30), jnp.arange(25)]), jnp.arange(length)])
    shards = mesh_shape["sequence"]
    order = np.asarray(sequence_order(length, shards)) if balanced else np.arange(length)

    def reference(q, k, v, s):
        return dense.attention(q, k, v, dense.visible(pos, pos, seg, seg, window), s)[:, order]

    want = reference(q, k, v, s)
    want_grads = jax.grad(lambda *a: _loss(reference(*a)), argnums=(0, 1, 2, 3))(q, k, v, s)
    names = ("pipeline", "data", "fsdp", "sequence", "expert", "tensor")
    mesh = jax.make_mesh(tuple(mesh_shape.get(a, 1) for a in names), names, axis_types=(AxisType.Explicit,) * 6)
    with jax.set_mesh(mesh):
        rows = NamedSharding(mesh, P(("data", "fsdp", "expert"), "sequence"))
        heads = NamedSharding(mesh, P(("data", "fsdp", "expert"), "sequence", "tensor"))
        args = [jax.device_put(x[:, order], heads) for x in (q, k, v)]
        pos_s, seg_s = jax.device_put(pos[:, order], rows), jax.device_put(seg[:, order], rows)
        f = jax.jit(lambda q, k, v, s: blockwise.context_parallel_attention(
            q, k, v, pos_s, seg_s, block_q=8, block_k=8, window=window, sinks=s))
        got = f(*args, s)
        grad_fn = jax.jit(jax.grad(lambda *a: _loss(f(*a)), argnums=(0, 1, 2, 3)))
        grads = grad_fn(*args, s)
        hlo = f.lower(*args, s).compile().as_text()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    for a, b in zip(grads, [g[:, order] for g in want_grads[:3]] + [want_grads[3]], strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
    # the keys' gather: 2 * (window - 1) columns from each of the shards, not the row's 64
    gathered = {int(m) for m in re.findall(r"f32\[\d+,(\d+),\d+,\d+\]\{[^}]*\} all-gather", hlo)}
    assert gathered == {2 * (window - 1) * shards}, gathered


def test_the_packed_kernels_statistics_are_read_at_each_documents_place_in_jaxs_list():
    """``cudnn.token_stats_index`` against jax's own list of a batch's documents (``_fix_seqlen_offsets``, what
    the kernel is given): each token's document starts where jax says that entry of the list starts, rows with
    fewer documents than the slots leaving no gap."""
    from jax._src.cudnn import fused_attention_stablehlo as private

    from jaxtron.ops import cudnn

    seg = jnp.asarray(np.stack([np.repeat([1, 2, 3], [5, 12, 15]), np.ones(32), np.repeat([1, 2], [30, 2])]),
                      jnp.int32)
    m, heads, size = 4, 2, 8
    lengths, offsets = cudnn.segment_layout(seg, m)
    q = jnp.zeros((3, 32, heads, size), jnp.bfloat16)
    _, _, starts, _ = private._fix_seqlen_offsets(lengths, lengths, offsets, offsets, q, q)
    # each listed document's first token, counted over the batch
    token_start = np.asarray(starts).reshape(-1) // (heads * size)
    document, place = (np.asarray(a) for a in cudnn.token_stats_index(seg, m))
    rows = np.arange(3)[:, None] * 32
    np.testing.assert_array_equal(token_start[document] + place, rows + np.arange(32)[None, :])
    assert document.max() == 5 and place.max() == 31 and place[0, 5] == 0 and place[0, 6] == 1


def test_cudnn_by_chunks_with_windows_or_sinks_is_refused_with_the_config():
    """cuDNN on a sharded sequence runs by chunks, which take neither: one sentence before anything runs."""
    from helpers import tiny_config

    from jaxtron.config.checks import ConfigError
    from jaxtron.parallel.checks import check_devices

    for attention in (dict(window=8, global_every=2), dict(sinks=True)):
        cfg = tiny_config(dict(fsdp=1, sequence=2), model=dict(attention=attention),
                          execution=dict(attention="cudnn"))
        with pytest.raises(ConfigError, match="'execution.attention' is 'cudnn' on a sequence split 2 ways"):
            check_devices(cfg, 2)
        check_devices(tiny_config(dict(fsdp=1, sequence=2), model=dict(attention=attention)), 2)  # 'auto' runs
