"""How generation draws the next token from a model's logits (``Sampling``, ``next_tokens``): the same draws in
`jaxtron generate` and in RL's rollouts on the training mesh."""

from __future__ import annotations

import dataclasses

from jaxtron.config.schema import ConfigError


@dataclasses.dataclass(frozen=True)
class Sampling:
    """How the next token is drawn: greedy at temperature 0, else from the softmax of logits / temperature, kept
    to the ``top_k`` most likely tokens (0: all) and the fewest whose probabilities sum to ``top_p`` (1: all)."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self):
        if self.temperature < 0:
            raise ConfigError(f"--temperature must be 0 (greedy) or positive, not {self.temperature}.")
        if self.top_k < 0:
            raise ConfigError(f"--top-k must be 0 (all tokens) or positive, not {self.top_k}.")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"--top-p must be in (0, 1], not {self.top_p}.")


def next_tokens(logits, key, sampling: Sampling):
    """The next token of each row from its float32 logits [b, vocab]."""
    import jax  # on use: `jaxtron generate` parses its flags before jax starts
    import jax.numpy as jnp

    if sampling.temperature == 0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = logits / sampling.temperature
    if sampling.top_k:
        kth = jax.lax.top_k(logits, min(sampling.top_k, logits.shape[-1]))[0][:, -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    if sampling.top_p < 1:
        ordered = jnp.sort(logits, axis=-1)[:, ::-1]
        probs = jax.nn.softmax(ordered, axis=-1)
        before = jnp.cumsum(probs, axis=-1) - probs  # the mass of the likelier tokens
        kept = jnp.where(before < sampling.top_p, ordered, jnp.inf)  # the first is always kept
        logits = jnp.where(logits < jnp.min(kept, axis=-1, keepdims=True), -jnp.inf, logits)
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)
