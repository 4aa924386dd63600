"""Context-parallel attention by chunks (``ops/chunked.py``): with the XLA kernel, outputs and gradients equal
whole-matrix attention on several meshes and document layouts; the cuDNN kernel's private JAX calls still bind
(any backend) and equal the XLA kernel's (GPU only)."""

import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from test_blockwise import _loss, _reference

from jaxtron.ops import chunked
from jaxtron.parallel.sharding import sequence_order

KERNEL = chunked.XlaKernel(block_q=8, block_k=4)
NAMES = ("pipeline", "data", "fsdp", "sequence", "expert", "tensor")


def _documents(*rows: list[int]) -> tuple[jax.Array, jax.Array]:
    """Segment ids (1, 2, ...) and positions restarting at each document, as the loader packs rows."""
    seg = [np.repeat(np.arange(1, len(r) + 1), r) for r in rows]
    pos = [np.concatenate([np.arange(n) for n in r]) for r in rows]
    return jnp.asarray(np.stack(seg), jnp.int32), jnp.asarray(np.stack(pos), jnp.int32)


def _inputs(seed, b, length, heads=4, kv_heads=2, d=8, dtype=jnp.float32):
    keys = jax.random.split(jax.random.key(seed), 3)
    return tuple(jax.random.normal(key, (b, length, n, d), dtype)
                 for key, n in zip(keys, (heads, kv_heads, kv_heads), strict=True))


# a document crossing several chunk boundaries, one ending exactly at a boundary, a row that is one document
# (every chunk but the first is all head), and short documents (chunks that begin a document)
LAYOUTS = {"mixed": ([9, 30, 25], [64]), "boundaries": ([8, 8, 16, 32], [1, 2, 3, 58]),
           "short": ([5, 7, 3, 11, 6, 9, 4, 19], [40, 24])}


def _expected(q, k, v, seg, order):
    """Whole-matrix attention in token order, its columns then laid out as ``order``, and its gradients."""
    col = jnp.broadcast_to(jnp.arange(q.shape[1]), seg.shape)
    out = _reference(q, k, v, col, col, seg, seg)[0]
    grads = jax.grad(lambda *a: _loss(_reference(*a, col, col, seg, seg)[0][:, order], 0.0), argnums=(0, 1, 2))
    return out[:, order], [g[:, order] for g in grads(q, k, v)]


@pytest.mark.slow
@pytest.mark.parametrize("layout,shards", [("boundaries", 2),  # four shards (the meshes below run them): extended
                                           pytest.param("boundaries", 4, marks=pytest.mark.extended),
                                           pytest.param("short", 4, marks=pytest.mark.extended)])
def test_each_shard_by_chunks_equals_whole_matrix_attention(layout, shards):
    """Each shard's two chunks against the gathered row, one shard at a time on one device (the meshes below
    run the 'mixed' layout)."""
    length = 64
    q, k, v = _inputs(shards, 2, length)
    seg, pos = _documents(*LAYOUTS[layout])
    order = sequence_order(length, shards)
    want, want_grads = _expected(q, k, v, seg, order)
    width = length // shards

    def by_shards(q, k, v):
        qz, kz, vz, pz, sz = (x[:, order] for x in (q, k, v, pos, seg))
        return jnp.concatenate([chunked.shard_attention(
            KERNEL, qz[:, c], kz[:, c], vz[:, c], pz[:, c], sz[:, c], kz, vz, i, shards, max_segments=8)
            for i, c in enumerate(slice(i * width, (i + 1) * width) for i in range(shards))], axis=1)

    np.testing.assert_allclose(jax.jit(by_shards)(q, k, v), want, rtol=1e-5, atol=1e-5)
    grads = jax.jit(jax.grad(lambda *a: _loss(by_shards(*a), 0.0), argnums=(0, 1, 2)))(q, k, v)
    inverse = np.argsort(order)
    for got, w in zip(grads, want_grads, strict=True):
        np.testing.assert_allclose(got, w[:, inverse], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("mesh_shape", [dict(sequence=8), dict(data=2, sequence=2, tensor=2),
                                        dict(fsdp=2, sequence=4)])
def test_context_parallel_attention_by_chunks_equals_one_device(mesh_shape):
    """The sequence split over the mesh (batch and heads too), rows in the loader's load-balanced layout."""
    length, shards = 64, mesh_shape["sequence"]
    q, k, v = _inputs(5, 2, length)
    seg, pos = _documents(*LAYOUTS["mixed"])
    order = sequence_order(length, shards)
    want, want_grads = _expected(q, k, v, seg, order)
    mesh = jax.make_mesh(tuple(mesh_shape.get(a, 1) for a in NAMES), NAMES, axis_types=(AxisType.Explicit,) * 6)
    with jax.set_mesh(mesh):
        rows = NamedSharding(mesh, P(("data", "fsdp", "expert"), "sequence"))
        heads = NamedSharding(mesh, P(("data", "fsdp", "expert"), "sequence", "tensor"))
        args = [jax.device_put(x[:, order], heads) for x in (q, k, v)]
        pos_s, seg_s = jax.device_put(pos[:, order], rows), jax.device_put(seg[:, order], rows)
        f = jax.jit(lambda q, k, v: chunked.context_parallel_attention(q, k, v, pos_s, seg_s, kernel=KERNEL,
                                                                       max_segments=8))
        got = f(*args)
        grads = jax.jit(jax.grad(lambda *a: _loss(f(*a), 0.0), argnums=(0, 1, 2)))(*args)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)
    for g, w in zip(grads, want_grads, strict=True):
        np.testing.assert_allclose(np.asarray(g), w, rtol=1e-4, atol=1e-5)


def test_merged_calls_backpropagate_through_the_merged_statistics():
    """Two disjoint key sets merged: the gradient must use the merged softmax (each call's own would be wrong,
    which is what differentiating the calls one by one gives when their statistics carry no gradient)."""
    q, k, v = _inputs(9, 2, 16)
    n = jnp.full((2,), 16, jnp.int32)
    lengths = ((n, jnp.array([8, 3], jnp.int32), None, None), (n, jnp.array([8, 0], jnp.int32), None, None))
    below = jnp.arange(8)[None]
    keep = jnp.concatenate([below < jnp.array([[8], [3]]), below < jnp.array([[8], [0]])], 1)

    def reference(q, k, v):  # the same keys as one full (non-causal) set
        s = jnp.einsum("bqhd,bkhd->bhqk", q, jnp.repeat(k, 2, axis=2)) / np.sqrt(8)
        p = jax.nn.softmax(jnp.where(keep[:, None, None], s, -jnp.inf), axis=-1)
        return jnp.einsum("bhqk,bkhd->bqhd", p, jnp.repeat(v, 2, axis=2))

    def merged(q, k, v):
        c = ((k[:, :8], v[:, :8]) + lengths[0], (k[:, 8:], v[:, 8:]) + lengths[1])
        return chunked.merged(KERNEL, (False, False), q, c)

    np.testing.assert_allclose(merged(q, k, v), reference(q, k, v), rtol=1e-5, atol=1e-5)
    got = jax.grad(lambda *a: _loss(merged(*a), 0.0), argnums=(0, 1, 2))(q, k, v)
    want = jax.grad(lambda *a: _loss(reference(*a), 0.0), argnums=(0, 1, 2))(q, k, v)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)


def test_the_private_cudnn_functions_still_take_the_calls_the_cudnn_kernel_makes(monkeypatch):
    """The cuDNN kernel reaches JAX's cuDNN attention through ``jax._src.cudnn.fused_attention_stablehlo`` (the
    statistics and a backward that takes them exist nowhere else): its forward and backward calls must bind to
    the current signatures, and the backward's residuals must be laid out as the forward rule saves them."""
    from jax._src.cudnn import fused_attention_stablehlo as cudnn

    calls, rule = {}, list(inspect.signature(cudnn._dot_product_attention_bwd_rule).parameters)

    def recorder(name, fn, result):
        signature = inspect.signature(fn)

        def bind_only(*args, **kwargs):
            calls[name] = signature.bind(*args, **kwargs).arguments  # TypeError if a name or position changed
            return result(*args, **kwargs)
        return bind_only

    q = jnp.zeros((2, 16, 4, 8), jnp.bfloat16)
    kv = jnp.zeros((2, 16, 2, 8), jnp.bfloat16)
    stats = jnp.zeros((2, 4, 16), jnp.float32)
    monkeypatch.setattr(cudnn, "dot_product_attention", recorder(
        "forward", cudnn.dot_product_attention, lambda *a, **k: (a[0], stats)))
    monkeypatch.setattr(cudnn, "_dot_product_attention_bwd_rule", recorder(
        "backward", cudnn._dot_product_attention_bwd_rule, lambda *a, **k: (q, kv, kv)))
    monkeypatch.setattr(cudnn, "check_cudnn_version", lambda: 90800)
    lengths = jnp.array([0, 16], jnp.int32)
    out, lse = chunked.CUDNN.forward(q, kv, kv, lengths, lengths, True)
    assert lse.shape == (2, 16, 4)
    chunked.CUDNN.backward(q, kv, kv, lengths, lengths, False, out, lse, out)
    forward, backward = calls["forward"], calls["backward"]
    assert forward["return_residual"] and forward["mask_type"] is cudnn.MaskType.PADDING_CAUSAL
    np.testing.assert_array_equal(forward["q_seqlen"], [1, 16])  # lengths of 0 raised to 1
    assert backward["mask_type"] is cudnn.MaskType.PADDING and backward["return_residual"] is False
    # the forward rule's residuals, in the order the backward rule unpacks them
    source = inspect.getsource(cudnn._dot_product_attention_fwd_rule)
    assert "res = (query, key, value, bias, q_seqlen, kv_seqlen, q_offsets,\n         kv_offsets, page_table_k, " \
           "page_table_v, outputs[1], outputs[0])" in source
    res = backward["res"]
    assert len(res) == 12 and res[10].shape == (2, 4, 16) and res[10].dtype == jnp.float32
    assert rule[:7] == [
        "scale", "seed", "dropout_rate", "variadic_args", "mask_type", "layout", "sliding_window_length"]


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="cuDNN flash attention needs an NVIDIA GPU")
@pytest.mark.parametrize("causal", [True, False])
def test_cudnn_chunk_calls_match_the_xla_kernel_on_a_gpu(causal):
    """Each kind of call (lengths 0, partial and whole): outputs and statistics, then the backward given other
    statistics (a merge's), against the XLA kernel on the same bf16 inputs computed in float32."""
    b, t, s = 3, 256, 512
    q, k, v = _inputs(11, b, s, heads=8, kv_heads=2, d=128, dtype=jnp.bfloat16)
    q = q[:, :t]
    q_len = jnp.array([0, 100, t], jnp.int32)
    kv_len = q_len if causal else jnp.array([0, 300, s], jnp.int32)
    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    want_out, want_lse = chunked.XLA.forward(*f32, q_len, kv_len, causal)
    out, lse = jax.jit(lambda *a: chunked.CUDNN.forward(*a, q_len, kv_len, causal))(q, k, v)
    rows = (jnp.arange(t)[None] < q_len[:, None]) & (kv_len[:, None] > 0)
    # rows with no keys hold each kernel's own stand-in (infinite or huge), which nothing reads: left out
    err = jnp.where(rows[..., None, None], jnp.abs(out.astype(jnp.float32) - want_out), 0)
    assert float(jnp.max(err)) < 3e-2
    assert float(jnp.max(jnp.where(rows[..., None], jnp.abs(lse - want_lse), 0))) < 3e-2
    merged_lse = jnp.where(rows[..., None], want_lse + 0.5, -chunked.blockwise.MASKED)  # a larger merged softmax
    d_out = jnp.where(rows[..., None, None], jax.random.normal(jax.random.key(2), q.shape), 0)
    want = chunked.XLA.backward(*f32, q_len, kv_len, causal, want_out, merged_lse, d_out)
    got = jax.jit(lambda *a: chunked.CUDNN.backward(*a, q_len, kv_len, causal, want_out.astype(q.dtype),
                                                    merged_lse, d_out.astype(q.dtype)))(q, k, v)
    for g, w in zip(got, want, strict=True):
        rel = jnp.linalg.norm((g.astype(jnp.float32) - w).ravel()) / jnp.linalg.norm(w.ravel())
        assert float(rel) < 2e-2


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="cuDNN flash attention needs an NVIDIA GPU")
def test_cudnn_chunks_equal_whole_matrix_attention_on_a_gpu():
    """Every shard of a sequence split 4 ways, one at a time on one GPU, packed documents: output and
    gradients of the cuDNN chunks against float32 whole-matrix attention."""
    length, shards = 2048, 4
    q, k, v = _inputs(13, 2, length, heads=8, kv_heads=2, d=128)
    seg, pos = _documents([100, 700, 900, 348], [length])
    order = sequence_order(length, shards)
    want, want_grads = _expected(q, k, v, seg, order)
    width = length // shards

    def by_shards(q, k, v):
        qz, kz, vz = (x[:, order].astype(jnp.bfloat16) for x in (q, k, v))
        pz, sz = pos[:, order], seg[:, order]
        return jnp.concatenate([chunked.shard_attention(
            chunked.CUDNN, qz[:, c], kz[:, c], vz[:, c], pz[:, c], sz[:, c], kz, vz, i, shards, max_segments=8)
            for i, c in enumerate(slice(i * width, (i + 1) * width) for i in range(shards))], axis=1)

    def relative(got, want):
        return float(jnp.linalg.norm((got.astype(jnp.float32) - want).ravel()) / jnp.linalg.norm(want.ravel()))

    assert relative(jax.jit(by_shards)(q, k, v), want) < 1e-2
    grads = jax.jit(jax.grad(lambda *a: _loss(by_shards(*a).astype(jnp.float32), 0.0), argnums=(0, 1, 2)))(q, k, v)
    inverse = np.argsort(order)
    for g, w in zip(grads, want_grads, strict=True):
        assert relative(g, w[:, inverse]) < 2e-2

    # the same calls inside the shard_map a mesh runs (one GPU: a sequence axis of 1, the row in two chunks)
    mesh = jax.make_mesh((1,) * 6, NAMES, axis_types=(AxisType.Explicit,) * 6)
    want, want_grads = _expected(q, k, v, seg, np.arange(length))
    with jax.set_mesh(mesh):
        rows = NamedSharding(mesh, P(("data", "fsdp", "expert"), "sequence"))
        heads = NamedSharding(mesh, P(("data", "fsdp", "expert"), "sequence", "tensor"))
        pos_s, seg_s = jax.device_put(pos, rows), jax.device_put(seg, rows)
        f = jax.jit(lambda q, k, v: chunked.context_parallel_attention(q, k, v, pos_s, seg_s, max_segments=8))
        bf = [jax.device_put(x.astype(jnp.bfloat16), heads) for x in (q, k, v)]
        assert relative(f(*bf), want) < 1e-2
        grads = jax.jit(jax.grad(lambda *a: _loss(f(*a).astype(jnp.float32), 0.0), argnums=(0, 1, 2)))(*bf)
    for g, w in zip(grads, want_grads, strict=True):
        assert relative(g, w) < 2e-2
