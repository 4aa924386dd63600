"""Score token ids with a jaxtron model: the float32 logits of a forward pass, to compare with another implementation.

    jaxtron score --checkpoint DIR --tokens TOKENS.npy --output LOGITS.npy [--dtype float32]

DIR is a converted model (``jaxtron convert from-hf``) or a training run's workdir (its latest
checkpoint). TOKENS.npy holds int token ids of shape [batch, length]; LOGITS.npy receives float32 logits of
shape [batch, length, vocab]. Runs on one device, in float32 unless --dtype says otherwise.
"""

from __future__ import annotations

import argparse
import logging

import numpy as np

from jaxtron.common.files import atomic_path, user_path
from jaxtron.config.schema import ConfigError, ExecutionConfig, ModelConfig

log = logging.getLogger(__name__)


def read_tokens(path: str, cfg: ModelConfig) -> np.ndarray:
    """int32 [batch, length] token ids from a .npy file; ConfigError for anything else."""
    try:
        tokens = np.load(path, allow_pickle=False)
    except (OSError, ValueError) as e:
        raise ConfigError(f"--tokens '{path}' is not a readable .npy array ({e}).") from None
    if tokens.ndim != 2 or not np.issubdtype(tokens.dtype, np.integer) or tokens.size == 0:
        raise ConfigError(f"--tokens '{path}' holds a {tokens.dtype} array of shape {tokens.shape}; it must be "
                          "integer token ids of shape [batch, length].")
    if tokens.min() < 0 or tokens.max() >= cfg.vocab_size:
        raise ConfigError(f"--tokens '{path}' has ids from {tokens.min()} to {tokens.max()}, outside the model's "
                          f"vocabulary of {cfg.vocab_size}.")
    if tokens.shape[1] > cfg.max_seq_len:
        raise ConfigError(f"--tokens '{path}' has length {tokens.shape[1]}, beyond the model's max_seq_len "
                          f"{cfg.max_seq_len}.")
    return tokens.astype(np.int32)


def score(checkpoint: str, tokens_path: str, dtype: str = "float32") -> np.ndarray:
    import jax
    from flax import nnx

    from jaxtron.checkpoint.params import nest
    from jaxtron.interop.convert import load
    from jaxtron.models import build_model
    cfg, params = load(checkpoint)
    tokens = read_tokens(tokens_path, cfg)
    model = build_model(cfg, ExecutionConfig(dtype=dtype), 0)
    state = nnx.state(model, nnx.Param)
    nnx.replace_by_pure_dict(state, nest(params))
    graphdef = nnx.graphdef(model)
    forward = jax.jit(lambda state, tokens: nnx.merge(graphdef, state)(tokens).logits())
    return np.asarray(forward(state, tokens), dtype=np.float32)


def main(argv: list[str]) -> int:
    """`jaxtron score`: writes the logits the command line ``argv`` asks for."""
    from jaxtron.common.console import console_logging

    console_logging()
    parser = argparse.ArgumentParser(prog="jaxtron score", description=__doc__.split("\n")[0])
    parser.add_argument("--checkpoint", required=True, help="converted model or training workdir")
    parser.add_argument("--tokens", required=True, help=".npy of int token ids [batch, length]")
    parser.add_argument("--output", required=True, help=".npy file for float32 logits [batch, length, vocab]")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="compute dtype")
    args = parser.parse_args(argv)
    args.checkpoint, args.tokens, args.output = map(user_path, (args.checkpoint, args.tokens, args.output))
    logits = score(args.checkpoint, args.tokens, args.dtype)
    args.output += "" if args.output.endswith(".npy") else ".npy"  # as np.save names it
    with atomic_path(args.output) as aside, open(aside, "wb") as f:
        np.save(f, logits)
    log.info("wrote %s: float32 logits of shape %s", args.output, logits.shape)
    return 0

