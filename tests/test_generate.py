"""Generation: decoding with the cache equals the full forward at every step, for every family."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import tiny_config
from test_training import QWEN3_STYLE

from jaxtron.models import build_model

FAMILIES = {  # tiny models of each family's architecture
    "llama": {},
    "gpt3": dict(position_embedding="learned", norm="layernorm", activation="gelu", tie_embeddings=True),
    "qwen3": QWEN3_STYLE["qwen3"],
    "mixtral": dict(num_layers=4, moe=dict(num_experts=4, experts_per_token=2, every=2)),
    "deepseek_v3": dict(QWEN3_STYLE["deepseek_v3"], mtp=dict(depth=0)),
}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_decoding_with_the_cache_equals_the_full_forward_at_every_step(family):
    """A prompt's prefill (5 tokens) and then one token at a time: each step's float32 logits equal the full
    forward's at the same positions to 1e-5, with rows at different positions (the second row a step behind)."""
    cfg = tiny_config(model=FAMILIES[family], execution=dict(moe_mode="dropless"))
    model = build_model(cfg.model, cfg.execution, 0)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, cfg.model.vocab_size, (2, 12)), jnp.int32)
    want = np.asarray(model(tokens).logits())
    cache = model.empty_cache(2, 16, jnp.float32)
    step = jax.jit(lambda m, t, p, c: m.decode(t, p, c))
    positions = jnp.broadcast_to(jnp.arange(5, dtype=jnp.int32), (2, 5))
    logits, cache = step(model, tokens[:, :5], positions, cache)
    np.testing.assert_allclose(np.asarray(logits), want[:, :5], rtol=1e-5, atol=1e-5)
    for t in range(5, 12):  # the first row at t, the second at t - 1 (its own position)
        at = jnp.asarray([[t], [t - 1]], jnp.int32)
        logits, cache = step(model, jnp.take_along_axis(tokens, at, axis=1), at, cache)
        np.testing.assert_allclose(np.asarray(logits)[0, 0], want[0, t], rtol=1e-5, atol=1e-5, err_msg=str(t))
        np.testing.assert_allclose(np.asarray(logits)[1, 0], want[1, t - 1], rtol=1e-5, atol=1e-5, err_msg=str(t))
