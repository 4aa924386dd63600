"""Gated DeltaNet blocks in a model: generation's cache against the full forward, packed documents against each
alone, the stacks a hybrid model builds."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from helpers import tiny_config

from jaxtron.models import build_model

LINEAR = dict(every=4, key_heads=2, value_heads=4, key_head_dim=8, value_head_dim=16, conv_kernel=4)


def _hybrid(**model):
    """A 4-block model: 3 Gated DeltaNet blocks, then one with gated attention and partial RoPE; parameters
    drawn away from their initial values (norm scales, decays, biases)."""
    cfg = tiny_config(model=dict(num_layers=4, linear=LINEAR, attention=dict(output_gate=True),
                                 rope=dict(fraction=0.5), **model))
    model_ = build_model(cfg.model, cfg.execution, 0)
    leaves, tree = jax.tree.flatten(nnx.state(model_, nnx.Param))
    keys = jax.random.split(jax.random.key(3), len(leaves))
    nnx.update(model_, jax.tree.unflatten(tree, [x + 0.2 * jax.random.normal(k, x.shape)
                                                 for x, k in zip(leaves, keys, strict=True)]))
    return cfg, model_


def test_a_hybrid_model_keeps_each_kind_of_block_in_its_stack():
    cfg, model = _hybrid()
    assert [kind.linear for kind in cfg.model.period_blocks()] == [True, True, True, False]
    assert model.linear_layers.attn.wq.weight.shape == (3, 64, 2, 8)
    assert model.layers.attn.wg.weight.shape == (1, 64, 4, 16)
    assert model.moe_layers is None and model.linear_moe_layers is None
    cfg, model = _hybrid(moe=dict(num_experts=4, experts_per_token=2, expert_dim=32))
    assert model.linear_moe_layers.attn.a_log.shape == (3, 4) and model.moe_layers.attn.wq.weight.shape[0] == 1
    assert model.layers is None and model.linear_layers is None


def test_decoding_with_the_state_equals_the_full_forward():
    """Prompts of 7 and 4 tokens in one right-padded prefill, then one token a step at each row's own position:
    every step's float32 logits equal the full forward's."""
    _, model = _hybrid()
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 256, (2, 14)), jnp.int32)
    want = np.asarray(model(tokens).logits())
    lengths = np.array([7, 4])
    columns = np.arange(7)
    positions = jnp.asarray(np.where(columns < lengths[:, None], columns, -1), jnp.int32)
    step = jax.jit(lambda m, t, p, c: m.decode(t, p, c))
    logits, cache = step(model, tokens[:, :7], positions, model.empty_cache(2, 16, jnp.float32))
    for row, n in enumerate(lengths):
        np.testing.assert_allclose(np.asarray(logits)[row, :n], want[row, :n], rtol=1e-5, atol=3e-5)
    at = lengths.copy()
    for _ in range(6):
        logits, cache = step(model, jnp.asarray(tokens[np.arange(2), at][:, None]), jnp.asarray(at[:, None]), cache)
        for row in range(2):
            np.testing.assert_allclose(np.asarray(logits)[row, 0], want[row, at[row]], rtol=1e-5, atol=3e-5,
                                       err_msg=f"row {row} at {at[row]}")
        at += 1


def test_packed_documents_equal_each_document_alone():
    """A row of two documents (segment ids): each one's logits equal a forward of it alone, so neither the
    convolution nor the state carries across the boundary."""
    _, model = _hybrid()
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, 256, (1, 24)), jnp.int32)
    segments = jnp.asarray([[1] * 10 + [2] * 14], jnp.int32)
    positions = jnp.asarray([list(range(10)) + list(range(14))], jnp.int32)
    packed = np.asarray(model(tokens, positions, segments).logits())
    np.testing.assert_allclose(packed[:, :10], np.asarray(model(tokens[:, :10]).logits()), rtol=1e-5, atol=3e-5)
    np.testing.assert_allclose(packed[:, 10:], np.asarray(model(tokens[:, 10:]).logits()), rtol=1e-5, atol=3e-5)
