"""Attention paths: the packed-document layout handed to cuDNN (CPU), the private JAX function that takes it
(any backend), and cuDNN against XLA (GPU only)."""

import inspect
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxtron.data.errors import DataError
from jaxtron.data.loader import check_segments
from jaxtron.ops import cudnn as cudnn_ops
from jaxtron.ops.attention import dot_product_attention
from jaxtron.ops.cudnn import segment_layout

RNG = np.random.default_rng(0)


def _packed_segment_ids(batch: int, length: int, documents: list[int]) -> np.ndarray:
    """Rows of ``documents[i]`` documents of random lengths, numbered 1, 2, ... like the loader does."""
    rows = []
    for n in documents:
        cuts = np.sort(RNG.choice(np.arange(1, length), n - 1, replace=False))
        rows.append(np.searchsorted(cuts, np.arange(length), side="right") + 1)
    return np.stack(rows[:batch]).astype(np.int32)


def _mask_from_layout(lengths: np.ndarray, offsets: np.ndarray, length: int) -> np.ndarray:
    """Which key each query may see, rebuilt from lengths and offsets alone (causal within a document)."""
    mask = np.zeros((len(lengths), length, length), bool)
    for b in range(len(lengths)):
        for j, n in enumerate(lengths[b]):
            if n < 0:
                assert np.all(lengths[b, j:] == -1) and np.all(offsets[b, j:] == -1)
                break
            start = offsets[b, j]
            assert start == (0 if j == 0 else offsets[b, j - 1] + lengths[b, j - 1])  # contiguous documents
            mask[b, start:start + n, start:start + n] = np.tril(np.ones((n, n), bool))
    assert np.all(offsets[:, -1] == -1)  # starts only: the batch's end is jax's to add
    return mask


@pytest.mark.parametrize("documents,max_segments", [([1, 3, 7, 2], 8), ([8, 8], 8), ([5, 1], 64), ([40], 40)])
def test_segment_layout_describes_exactly_the_documents(documents, max_segments):
    length = 48
    ids = _packed_segment_ids(len(documents), length, documents)
    lengths, offsets = map(np.asarray, jax.jit(segment_layout, static_argnums=1)(jnp.asarray(ids), max_segments))
    assert lengths.shape == (len(documents), max_segments) and offsets.shape == (len(documents), max_segments + 1)
    want = (ids[:, :, None] == ids[:, None, :]) & np.tril(np.ones((length, length), bool))
    np.testing.assert_array_equal(_mask_from_layout(lengths, offsets, length), want)
    assert [int((n > 0).sum()) for n in lengths] == documents


@pytest.mark.parametrize("documents,max_segments", [([3, 5], 8), ([8, 1, 4], 8), ([2, 2], 2)])
def test_jax_turns_the_layout_into_each_documents_own_tokens(documents, max_segments):
    """What cuDNN is given: jax's own conversion of the layout (``_fix_seqlen_offsets``: the batch's rows as one
    packed list of documents, offsets in elements) must give document i of the batch, in order, exactly its
    tokens. Rows after the first are where a wrong layout goes wrong (a row's end written among its starts shifted
    every later window, and cuDNN returned NaN on a GPU)."""
    from jax._src.cudnn import fused_attention_stablehlo as cudnn

    length, heads, head_dim = 32, 2, 8
    ids = _packed_segment_ids(len(documents), length, documents)
    lengths, offsets = jax.jit(segment_layout, static_argnums=1)(jnp.asarray(ids), max_segments)
    q = jnp.zeros((len(documents), length, heads, head_dim), jnp.bfloat16)
    fixed = cudnn._fix_seqlen_offsets(lengths, lengths, offsets, offsets, q, q)
    seqlen, starts = np.asarray(fixed[0]).ravel(), np.asarray(fixed[2]).ravel()
    flat = (ids + 1000 * np.arange(len(documents))[:, None]).ravel()  # each token's document, unique in the batch
    want = [np.flatnonzero(flat == d) for d in dict.fromkeys(flat)]  # each document's tokens, in order
    assert len(want) == sum(documents)
    for i, tokens in enumerate(want):
        assert starts[i] % (heads * head_dim) == 0
        begin = starts[i] // (heads * head_dim)
        np.testing.assert_array_equal(np.arange(begin, begin + seqlen[i]), tokens)
    assert np.all(seqlen[len(want):] == 0) and np.all(starts[len(want):] == len(documents) * length * heads * head_dim)


def test_rows_with_more_documents_than_the_kernel_takes_are_refused():
    ids = _packed_segment_ids(2, 32, [3, 9])
    check_segments({"segment_ids": ids}, 9, step=5)
    check_segments({"segment_ids": ids}, None, step=5)
    with pytest.raises(DataError, match=r"a row of batch 5 packs 9 documents, more than "
                                        r"execution.attention_max_segments \(8\)"):
        check_segments({"segment_ids": ids}, 8, step=5)


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="cuDNN flash attention needs an NVIDIA GPU")
@pytest.mark.parametrize("packed", [False, True])
def test_cudnn_matches_the_xla_reference_on_a_gpu(packed):
    b, t, n, g, h = 2, 512, 8, 2, 128
    q, k, v = (jax.random.normal(key, (b, t, heads, h), jnp.float32)
               for key, heads in zip(jax.random.split(jax.random.key(0), 3), (n, g, g), strict=True))
    ids = jnp.asarray(_packed_segment_ids(b, t, [5, 17])) if packed else None
    reference = dot_product_attention(q, k, v, implementation="xla", segment_ids=ids)  # float32
    bf = [x.astype(jnp.bfloat16) for x in (q, k, v)]
    out = jax.jit(lambda *a: dot_product_attention(*a, implementation="cudnn", segment_ids=ids))(*bf)
    err = jnp.linalg.norm((out.astype(jnp.float32) - reference).ravel()) / jnp.linalg.norm(reference.ravel())
    assert float(err) < 1e-2

    def loss(impl, *a):
        return jnp.sum(dot_product_attention(*a, implementation=impl, segment_ids=ids).astype(jnp.float32) ** 2)

    want = jax.grad(lambda *a: loss("xla", *a), argnums=(0, 1, 2))(q, k, v)
    got = jax.jit(jax.grad(lambda *a: loss("cudnn", *a), argnums=(0, 1, 2)))(*bf)
    for w, gr in zip(want, got, strict=True):
        rel = jnp.linalg.norm((gr.astype(jnp.float32) - w).ravel()) / jnp.linalg.norm(w.ravel())
        assert float(rel) < 2e-2


@pytest.mark.gpu
def test_the_private_cudnn_function_still_takes_the_call_jaxtron_makes(monkeypatch):
    """Packed documents reach cuDNN through ``jax._src.cudnn.fused_attention_stablehlo`` (JAX exposes offsets
    nowhere else): the very call ``cudnn.packed_attention`` (ops/cudnn.py) makes must bind to that function's current
    signature."""
    from jax._src.cudnn import fused_attention_stablehlo as cudnn

    signature, calls = inspect.signature(cudnn.dot_product_attention), []

    def bind_only(*args, **kwargs):
        calls.append(signature.bind(*args, **kwargs).arguments)  # TypeError if a name or position changed
        return args[0], jnp.zeros((8, 4, 16), jnp.float32)  # the output and the statistics

    monkeypatch.setattr(cudnn, "dot_product_attention", bind_only)
    q = jnp.zeros((2, 16, 4, 8), jnp.bfloat16)
    kv = jnp.zeros((2, 16, 2, 8), jnp.bfloat16)
    ids = jnp.asarray(_packed_segment_ids(2, 16, [3, 2]))
    cudnn_ops.packed_attention(q, kv, kv, ids, max_segments=4)
    (bound,) = calls
    assert bound["mask_type"] is cudnn.MaskType.PADDING_CAUSAL and bound["qkv_layout"] == "BTNH"
    assert bound["q_offsets"].shape == (2, 5) and bound["q_seqlen"].shape == (2, 4)
    assert bound["scale"] == pytest.approx(8 ** -0.5) and bound["return_residual"]


def _document_attention(q, k, v, offsets):
    """Causal attention inside each document of the packed layout's ``offsets`` (an XLA reference) and each query's
    log-sum-exp [b, heads, length]."""
    t = jnp.arange(q.shape[1])
    starts = jnp.where(offsets[:, :-1] >= 0, offsets[:, :-1], q.shape[1] + 1)
    doc = jnp.sum(starts[:, None, :] <= t[None, :, None], axis=-1)  # [b, length]: each token's document
    seen = (doc[:, :, None] == doc[:, None, :]) & (t[None, None, :] <= t[None, :, None])  # [b, q, k]
    group = q.shape[2] // k.shape[2]
    kk, vv = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, kk) / math.sqrt(q.shape[-1])
    scores = jnp.where(seen[:, None], scores, -1e30)
    lse = jax.nn.logsumexp(scores, axis=-1)
    return jnp.einsum("bhqk,bkhd->bqhd", jnp.exp(scores - lse[..., None]), vv), lse


def test_packed_cudnn_attention_takes_vmap_and_grad_in_either_order(monkeypatch):
    """Under a pipeline's vmap, jax's batching rule for the cuDNN kernel reshapes the packed layout's lengths as if
    there were one per row and fails; ``packed_attention`` folds the mapped axis into the rows itself, around its
    forward and its backward. Here the two cuDNN calls are replaced by the XLA reference, whose backward checks that
    it got the forward's own output and statistics: the values and gradients must equal the reference's, mapped
    over stages, differentiated inside or outside the map."""
    from jax._src.cudnn import fused_attention_stablehlo as cudnn

    def forward(q, k, v, *, q_offsets, return_residual, **_):
        assert return_residual
        return _document_attention(q, k, v, q_offsets)

    def backward_rule(*args):
        q, k, v, _, _, _, offsets, _, _, _, stats, out = args[-2]
        (want_out, want_stats), vjp = jax.vjp(lambda *a: _document_attention(*a, offsets), q, k, v)
        wrong = jnp.maximum(jnp.max(jnp.abs(out - want_out)), jnp.max(jnp.abs(stats - want_stats))) > 1e-5
        grads = vjp((args[-1], jnp.zeros_like(want_stats)))
        return (*(jnp.where(wrong, jnp.nan, g) for g in grads), None, None, None, None, None, None, None)

    monkeypatch.setattr(cudnn, "dot_product_attention", forward)
    monkeypatch.setattr(cudnn, "_dot_product_attention_bwd_rule", backward_rule)
    stages, length = 3, 16
    q = jax.random.normal(jax.random.key(0), (stages, 2, length, 4, 8))
    kv = jax.random.normal(jax.random.key(1), (stages, 2, length, 2, 8))
    ids = jnp.stack([jnp.asarray(_packed_segment_ids(2, length, [3, 2])) for _ in range(stages)])

    def ours(q, kv, ids):
        return jnp.sum(jnp.sin(cudnn_ops.packed_attention(q, kv, kv, ids, 4)))

    def reference(q, kv, ids):
        return jnp.sum(jnp.sin(_document_attention(q, kv, kv, cudnn_ops.segment_layout(ids, 4)[1])[0]))

    want = [jax.value_and_grad(reference, argnums=(0, 1))(q[i], kv[i], ids[i]) for i in range(stages)]
    inside = jax.jit(jax.vmap(jax.value_and_grad(ours, argnums=(0, 1))))(q, kv, ids)
    outside = jax.jit(jax.grad(lambda q, kv: jnp.sum(jax.vmap(ours)(q, kv, ids)), argnums=(0, 1)))(q, kv)
    for i, (value, (dq, dkv)) in enumerate(want):
        np.testing.assert_allclose(inside[0][i], value, rtol=1e-4)  # jitted against eager float32 sums
        for got in (inside[1], outside):
            np.testing.assert_allclose(got[0][i], dq, rtol=1e-4, atol=1e-6)
            np.testing.assert_allclose(got[1][i], dkv, rtol=1e-4, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="cuDNN flash attention needs an NVIDIA GPU")
@pytest.mark.parametrize("packed", [False, True])
def test_cudnn_windows_and_sinks_match_the_xla_reference_on_a_gpu(packed):
    """cuDNN's sliding window, and sinks folded in from its statistics (the packed kernel's read at each document's
    place in jax's list), forward and gradients (the sinks' too) against the float32 reference."""
    b, t, n, g, h, window = 2, 512, 8, 2, 128, 100
    keys = jax.random.split(jax.random.key(4), 4)
    q, k, v = (jax.random.normal(key, (b, t, heads, h), jnp.float32)
               for key, heads in zip(keys[:3], (n, g, g), strict=True))
    sinks = jax.random.normal(keys[3], (n,))
    ids = jnp.asarray(_packed_segment_ids(b, t, [5, 17])) if packed else None
    positions = None
    if packed:  # each token's position in its document
        starts = jnp.concatenate([jnp.ones((b, 1), bool), ids[:, 1:] != ids[:, :-1]], axis=1)
        first = jax.lax.cummax(jnp.where(starts, jnp.arange(t), 0), axis=1)
        positions = jnp.arange(t)[None, :] - first

    def loss(impl, q, k, v, s):
        out = dot_product_attention(q, k, v, implementation=impl, segment_ids=ids, positions=positions,
                                    window=window, sinks=s)
        return jnp.sum(out.astype(jnp.float32) ** 2), out

    (_, reference), want = jax.value_and_grad(lambda *a: loss("xla", *a), argnums=(0, 1, 2, 3), has_aux=True)(
        q, k, v, sinks)
    bf = [x.astype(jnp.bfloat16) for x in (q, k, v)]
    (_, out), got = jax.jit(jax.value_and_grad(lambda *a: loss("cudnn", *a), argnums=(0, 1, 2, 3),
                                               has_aux=True))(*bf, sinks)
    err = jnp.linalg.norm((out.astype(jnp.float32) - reference).ravel()) / jnp.linalg.norm(reference.ravel())
    assert float(err) < 1e-2
    for w, gr in zip(want, got, strict=True):
        rel = jnp.linalg.norm((gr.astype(jnp.float32) - w).ravel()) / jnp.linalg.norm(w.ravel())
        assert float(rel) < 2e-2


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="cuDNN flash attention needs an NVIDIA GPU")
def test_cudnn_returns_the_softmax_statistics_that_blockwise_attention_combines():
    """Ring or blockwise attention merges per-block outputs by their log-sum-exp: cuDNN's must equal the
    reference's (same layout [batch, length, heads], natural log of the scaled scores)."""
    b, t, n, g, h = 2, 512, 8, 2, 128
    q, k, v = (jax.random.normal(key, (b, t, heads, h), jnp.float32)
               for key, heads in zip(jax.random.split(jax.random.key(3), 3), (n, g, g), strict=True))
    want, want_lse = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="xla",
                                                  return_residual=True)
    bf = [x.astype(jnp.bfloat16) for x in (q, k, v)]
    got, got_lse = jax.jit(lambda *a: jax.nn.dot_product_attention(
        *a, is_causal=True, implementation="cudnn", return_residual=True))(*bf)
    assert got_lse.shape == want_lse.shape == (b, t, n)
    err = jnp.linalg.norm((got.astype(jnp.float32) - want).ravel()) / jnp.linalg.norm(want.ravel())
    assert float(err) < 1e-2
    assert float(jnp.max(jnp.abs(got_lse.astype(jnp.float32) - want_lse))) < 5e-2
