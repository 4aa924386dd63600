"""The loss of the output head (``ops/cross_entropy.token_sums``): the gradient it makes in its forward pass is the
gradient of the plain formula, by slices or whole, with z-loss, a loss mask and a scaled cotangent; the train
step's gradients equal those of the model's logits under a reference loss."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import tiny_config

from jaxtron.ops.cross_entropy import log_partition, logits_of, target_log_probs, token_sums


def reference(x, head, targets, weights, z_loss):
    """(objective, cross-entropy sum, z sum) by the textbook formula, differentiated by jax."""
    logits = logits_of(x, head)
    log_z = jax.nn.logsumexp(logits, axis=-1)
    target = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    ce, zz = jnp.sum((log_z - target) * weights), jnp.sum(log_z ** 2 * weights)
    return ce + z_loss * zz, ce, zz


def inputs(dtype=jnp.float32, batch=2, length=16, embed=8, vocab=50):
    k = jax.random.split(jax.random.key(0), 4)
    x = jax.random.normal(k[0], (batch, length, embed)).astype(dtype)
    head = (0.3 * jax.random.normal(k[1], (embed, vocab))).astype(dtype)
    targets = jax.random.randint(k[2], (batch, length), 0, vocab)
    weights = (jax.random.uniform(k[3], (batch, length)) > 0.3).astype(jnp.float32)
    return x, head, targets, weights


@pytest.mark.parametrize("chunks", [1, 4])
@pytest.mark.parametrize("z_loss", [0.0, 1e-2])
def test_the_loss_and_its_gradients_equal_the_plain_formulas(chunks, z_loss):
    x, head, targets, weights = inputs()
    got = token_sums(x, head, targets, weights, z_loss, chunks)
    want = reference(x, head, targets, weights, z_loss)
    np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-6)
    # a cotangent other than 1 (a multi-token prediction depth's weight in the objective) scales both gradients
    grad = jax.grad(lambda x, h: 2.5 * token_sums(x, h, targets, weights, z_loss, chunks)[0], argnums=(0, 1))
    expected = jax.grad(lambda x, h: 2.5 * reference(x, h, targets, weights, z_loss)[0], argnums=(0, 1))
    for a, b in zip(grad(x, head), expected(x, head), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6 * float(jnp.abs(b).max()))
        assert a.dtype == b.dtype
    # masked positions get no gradient
    d_x = grad(x, head)[0]
    assert not np.any(np.asarray(d_x)[np.asarray(weights) == 0])


@pytest.mark.parametrize("chunks", [1, 4])
def test_per_token_log_probs_and_their_gradients_equal_the_log_softmax(chunks):
    """DPO's and GRPO's per-token log-probabilities, whole or by slices of the sequence (each recomputed in the
    backward pass): the log-softmax at each target, and the gradients of a weighted sum of them."""
    x, head, targets, weights = inputs()
    want = lambda x, h: jnp.take_along_axis(jax.nn.log_softmax(logits_of(x, h)), targets[..., None], -1)[..., 0]
    np.testing.assert_allclose(target_log_probs(x, head, targets, chunks), want(x, head), rtol=1e-6, atol=1e-6)
    grad = jax.grad(lambda x, h: jnp.sum(target_log_probs(x, h, targets, chunks) * weights), argnums=(0, 1))
    expected = jax.grad(lambda x, h: jnp.sum(want(x, h) * weights), argnums=(0, 1))
    for a, b in zip(grad(x, head), expected(x, head), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6 * float(jnp.abs(b).max()))


def test_in_bf16_the_gradients_are_within_rounding_of_float32():
    x, head, targets, weights = inputs(vocab=512, embed=64, length=64)
    grad = jax.grad(lambda x, h: token_sums(x, h, targets, weights, 0.0, 4)[0], argnums=(0, 1))
    exact = grad(x, head)
    low = grad(x.astype(jnp.bfloat16), head.astype(jnp.bfloat16))
    for a, b in zip(low, exact, strict=True):
        assert a.dtype == jnp.bfloat16
        error = float(jnp.linalg.norm(a.astype(jnp.float32) - b) / jnp.linalg.norm(b))
        assert error < 1e-2, error  # bf16 operands: 8 bits of mantissa


def test_the_train_steps_gradients_are_those_of_the_models_logits():
    """Through the whole model: the step's gradients (z-loss on, a loss mask) against jax's gradient of the
    reference loss over the model's own whole-sequence logits."""
    from jaxtron.data.loader import SyntheticSource
    from jaxtron.training import state as state_lib
    from jaxtron.training.step import gradients

    cfg = tiny_config(dict(fsdp=1), train=dict(z_loss=1e-3, logit_chunks=4))
    batch = {k: jnp.asarray(v) for k, v in SyntheticSource(256, 32, 0).rows(np.arange(4)).items()}
    batch["loss_mask"] = (jnp.arange(32)[None, :] % 3 != 0).astype(jnp.int32) * jnp.ones((4, 1), jnp.int32)
    setup = state_lib.setup(cfg, "xla")
    state = state_lib.init_state(cfg, "xla", None)
    grads, ce_sum, count, _ = jax.jit(lambda p, b: gradients(setup, p, b))(state.params, batch)

    def objective(params):
        out = nnx.merge(setup.graphdef, params)(batch["inputs"], batch.get("positions"), batch.get("segment_ids"))
        return reference(out.hidden, out.head, batch["targets"], batch["loss_mask"].astype(jnp.float32), 1e-3)

    want = jax.jit(jax.grad(lambda p: objective(p)[0]))(state.params)
    assert float(count) == float(jnp.sum(batch["loss_mask"]))
    np.testing.assert_allclose(float(ce_sum), float(objective(state.params)[1]), rtol=1e-6)
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(want), strict=True):
        a, b = np.asarray(a), np.asarray(b)
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5 * np.abs(b).max())


def test_without_a_gradient_the_loss_makes_none():
    """Evaluation calls the loss without differentiating it: its program holds the logits GEMM alone."""
    x, head, targets, weights = inputs()
    text = jax.jit(lambda x, h: token_sums(x, h, targets, weights, 0.0, 1)).lower(x, head).as_text()
    assert text.count("dot_general") == 1
    text = jax.jit(jax.grad(lambda x, h: token_sums(x, h, targets, weights, 0.0, 1)[0], argnums=(0, 1))).lower(
        x, head).as_text()
    assert text.count("dot_general") == 3  # the logits, the hidden states' gradient, the head's: none recomputed


def test_the_log_partition_is_exact_in_one_pass_over_the_logits():
    """The one-pass (maximum, scaled sum) reduction equals float64's log-sum-exp to float32's rounding, on rows of
    a 128k vocabulary spread over 1e3 and on rows dominated by one huge logit; and it reads the logits once: no
    separate maximum (the pass it saves is 2.9 ms of Llama-3 8B's step on an H200)."""
    k1, k2 = jax.random.split(jax.random.key(1))
    rows = jnp.concatenate([300.0 * jax.random.normal(k1, (3, 128256)),
                            jax.random.normal(k2, (2, 128256)).at[:, 7].set(1e4),
                            jnp.full((1, 128256), -5e3)]).astype(jnp.float32)
    exact = np.log(np.sum(np.exp(np.float64(rows) - np.float64(rows).max(-1, keepdims=True)), -1)) \
        + np.float64(rows).max(-1)
    got = np.float64(jax.jit(log_partition)(rows))
    assert np.all(np.abs(got - exact) <= 4 * np.spacing(np.float32(np.abs(exact)))), np.abs(got - exact).max()
    primitives = [e.primitive.name for e in jax.make_jaxpr(log_partition)(rows).eqns]
    assert "reduce_max" not in primitives and primitives.count("reduce") == 1, primitives
