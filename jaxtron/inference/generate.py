"""Text generation: a model's continuations of prompts, with a KV cache (``Transformer.decode``).

    jaxtron generate --run DIR --prompt "def fib(n):" [--prompt ...] [--prompts FILE.jsonl] [--max-new-tokens N]
                     [--temperature T] [--top-k K] [--top-p P] [--seed S] [--stop STRING ...] [--mesh tensor=2,...]
                     [--chat [--chat-template FILE]]

DIR is a training run (its newest intact checkpoint) or a converted model (``jaxtron convert from-hf``). The
prompts go as one batch, right-padded: the prefill runs them once, then each step decodes one token of every row at
that row's own position; both programs are compiled once per shape bucket (the prompt length and the cache length,
each rounded up to a power of two). A row ends at the tokenizer's end-of-document token, at a stop string, or after
``--max-new-tokens``. One prompt streams to the terminal as it is made; several are printed when done.
``--mesh`` shards the model by the rules table over that many devices (tensor and fsdp: a model that needs several
devices to train also generates); tokens/s of the prefill and of the decoding steps go to stderr.
``--chat`` takes each prompt as a user's message: rendered with the chat template the run was fine-tuned with (its
conversation store's), a converted model's own, or ``--chat-template``'s, with the assistant's turn begun; a reply
ends at the template's end-of-turn marker too.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import os
import sys
import time
from collections.abc import Callable, Sequence

import numpy as np

from jaxtron.common.files import user_path
from jaxtron.config.checks import jsonl_records
from jaxtron.config.schema import ConfigError
from jaxtron.models.sampling import Sampling, next_tokens

log = logging.getLogger(__name__)


def bucket(n: int, least: int = 16) -> int:
    """``n`` rounded up to a power of two, at least ``least``: the shapes programs are compiled for."""
    return max(least, 1 << max(0, n - 1).bit_length())


@dataclasses.dataclass
class Result:
    tokens: list[list[int]]  # each row's generated token ids (its stop token or string not included)
    prefill_tokens: int
    prefill_s: float
    decode_tokens: int
    decode_s: float


class Generator:
    """A model's prefill and decoding step, compiled per shape; ``mesh`` (optional) shards the parameters by the
    rules table and runs the programs over it."""

    def __init__(self, model, mesh=None):
        import jax
        from flax import nnx

        self.cfg = model.cfg
        self.graphdef, state = nnx.split(model)
        self.mesh = mesh
        if mesh is not None:
            from jaxtron.parallel.state_sharding import tree_shardings
            with jax.set_mesh(mesh):
                state = jax.device_put(state, tree_shardings(mesh, state))
        self.state = state
        self._prefill = jax.jit(self._prefill_fn, static_argnums=(5,))
        self._step = jax.jit(self._step_fn, static_argnums=(5,))

    def _model(self, state):
        from flax import nnx
        return nnx.merge(self.graphdef, state)

    def _prefill_fn(self, state, tokens, lengths, cache, key, sampling):
        """Every row's prompt at positions 0.. (right-padded; the padding's position is -1, so that it writes no
        cache slot: a local layer's ring would otherwise lose the prompt's last tokens to it) -> the first new token
        of each row."""
        import jax
        import jax.numpy as jnp

        columns = jnp.arange(tokens.shape[1], dtype=jnp.int32)[None, :]
        positions = jnp.where(columns < lengths[:, None], columns, -1)
        logits, cache = self._model(state).decode(tokens, positions, cache, last=lengths - 1)
        last = logits[:, 0]
        key, sub = jax.random.split(key)
        return next_tokens(last, sub, sampling), cache, key

    def _step_fn(self, state, tokens, positions, cache, key, sampling):
        import jax

        logits, cache = self._model(state).decode(tokens[:, None], positions[:, None], cache)
        key, sub = jax.random.split(key)
        return next_tokens(logits[:, 0], sub, sampling), cache, key

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, sampling: Sampling | None = None,
                 eos_id: int | None = None, stop: Callable[[int, list[int]], bool] | None = None,
                 on_token: Callable[[int, list[int]], None] | None = None, cache_dtype: str = "float32") -> Result:
        """Continues each prompt (token ids) by up to ``max_new_tokens``; a row also ends at ``eos_id`` or where
        ``stop(row, its new tokens)`` says so. ``on_token(row, its new tokens)`` after each token a row gets."""
        import jax
        import jax.numpy as jnp

        sampling = sampling or Sampling()
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ConfigError("every prompt must hold at least one token; an empty prompt has nothing to continue.")
        if max_new_tokens < 1:
            raise ConfigError(f"--max-new-tokens must be at least 1, not {max_new_tokens}.")
        longest = max(len(p) for p in prompts)
        if longest + max_new_tokens > self.cfg.max_seq_len:
            raise ConfigError(f"a prompt of {longest} tokens plus {max_new_tokens} new ones needs a cache of "
                              f"{longest + max_new_tokens} positions, beyond the model's max_seq_len "
                              f"{self.cfg.max_seq_len}; shorten the prompt or lower --max-new-tokens.")
        # rows: the prompts, then padding rows (one token, done from the start) up to a multiple of the devices the
        # rules table splits the batch over
        batch, width = len(prompts), bucket(longest)
        if self.mesh is not None:
            from jaxtron.parallel.sharding import shard_count
            split = shard_count(dict(self.mesh.shape), "activation_batch")
            batch = -(-batch // split) * split
        length = min(bucket(longest + max_new_tokens), self.cfg.max_seq_len)
        tokens = np.zeros((batch, min(width, length)), np.int32)
        for row, prompt in enumerate(prompts):
            tokens[row, :len(prompt)] = prompt
        lengths = np.asarray([len(p) for p in prompts] + [1] * (batch - len(prompts)), np.int32)
        key = jax.random.key(sampling.seed)
        with jax.set_mesh(self.mesh) if self.mesh is not None else contextlib.nullcontext():
            cache = self._model(self.state).empty_cache(batch, length, jnp.dtype(cache_dtype))
            start = time.perf_counter()
            new, cache, key = self._prefill(self.state, jnp.asarray(tokens), jnp.asarray(lengths), cache, key,
                                            sampling)
            new = np.asarray(new)
            prefill_s = time.perf_counter() - start
            out: list[list[int]] = [[] for _ in range(batch)]
            done = np.arange(batch) >= len(prompts)
            positions = lengths.copy()
            start, decoded = time.perf_counter(), 0  # tokens the decoding steps make for rows still going
            for _ in range(max_new_tokens):
                for row in np.flatnonzero(~done):
                    token = int(new[row])
                    if eos_id is not None and token == eos_id:
                        done[row] = True
                        continue
                    out[row].append(token)
                    if on_token is not None:
                        on_token(int(row), out[row])
                    if (stop is not None and stop(int(row), out[row])) or len(out[row]) >= max_new_tokens:
                        done[row] = True
                if done.all():
                    break
                decoded += int((~done[:len(prompts)]).sum())
                new, cache, key = self._step(self.state, jnp.asarray(new), jnp.asarray(positions), cache, key,
                                             sampling)
                new = np.asarray(new)
                positions += 1
            decode_s = time.perf_counter() - start
        live = len(prompts)
        return Result(out[:live], int(lengths[:live].sum()), prefill_s, decoded, decode_s)


def read_prompts(path: str) -> list[str]:
    """The prompts of a JSONL file: one object per line with a "prompt" string."""
    prompts = []
    shape = 'each line must be an object such as {"prompt": "..."}'
    try:
        for number, record in jsonl_records(path, f"--prompts '{path}'", shape):
            if not isinstance(record, dict) or not isinstance(record.get("prompt"), str):
                raise ConfigError(f"--prompts '{path}' line {number} has no \"prompt\" string; {shape}.")
            prompts.append(record["prompt"])
    except OSError as e:
        raise ConfigError(f"--prompts '{path}' cannot be read ({e.strerror}).") from None
    if not prompts:
        raise ConfigError(f"--prompts '{path}' holds no prompts; write one JSON object per line.")
    return prompts


def run_store_manifest(directory: str) -> dict:
    """The manifest of the first token store of a training run's data ({} for a converted model or none)."""
    from jaxtron.data.store import first_manifest
    from jaxtron.interop.convert import _run_config
    try:
        cfg, _ = _run_config(directory)
    except ConfigError:
        return {}
    return first_manifest(cfg.data.path)


def run_tokenizer(directory: str, spec: str | None):
    """The tokenizer ``--tokenizer`` names, else the one the run's token store was prepared with, else a converted
    model's tokenizer.json; ConfigError if none is found."""
    from jaxtron.data.errors import DataError
    from jaxtron.data.tokenizers import load_tokenizer

    candidates = [spec] if spec else []
    if not spec:
        tokenizer = run_store_manifest(directory).get("tokenizer") or {}
        if tokenizer:
            candidates.append("byte" if tokenizer.get("kind") == "byte" else tokenizer.get("path"))
        candidates.append(os.path.join(directory, "tokenizer.json"))
    for candidate in candidates:
        if candidate and (candidate == "byte" or os.path.isfile(candidate)):
            try:
                return load_tokenizer(candidate)
            except DataError as e:
                raise ConfigError(str(e)) from None
    raise ConfigError(f"no tokenizer found for '{directory}' (its run's token store names none, and it holds no "
                      "tokenizer.json); pass --tokenizer 'byte', a tokenizer.json or a SentencePiece .model.")


def run_chat_template(directory: str, spec: str | None, tokenizer):
    """The chat template ``--chat-template`` names, else the run's conversation store's, else the tokenizer's own."""
    from jaxtron.data.chat import ChatTemplate, load_template
    from jaxtron.data.errors import DataError

    stored = None if spec else run_store_manifest(directory).get("chat_template")
    try:
        if stored:
            return ChatTemplate(stored["source"], stored.get("special_tokens"), stored.get("origin", "the run's store"))
        return load_template(getattr(tokenizer, "path", "byte"), spec)
    except DataError as e:
        raise ConfigError(str(e)) from None


def _check_directory(directory: str) -> None:
    if not os.path.isdir(directory):
        raise ConfigError(f"--run '{directory}' is not a directory; pass a training run or a converted model.")


def load_model(directory: str, dtype: str = "float32", mesh_spec: str = ""):
    """(model, mesh or None) of a training run's newest intact checkpoint or a converted model."""
    import jax
    from flax import nnx

    from jaxtron.checkpoint.params import nest
    from jaxtron.config.schema import ExecutionConfig
    from jaxtron.interop.convert import load
    from jaxtron.models import build_model

    _check_directory(directory)
    cfg, params = load(directory)
    model = build_model(cfg, ExecutionConfig(dtype=dtype, moe_mode="dropless"), 0)
    state = nnx.state(model, nnx.Param)
    nnx.replace_by_pure_dict(state, nest(params))
    nnx.update(model, state)
    mesh = None
    if mesh_spec:
        from jaxtron.parallel.mesh import make_mesh
        sizes = {}
        for part in mesh_spec.split(","):
            name, _, value = part.partition("=")
            if not value.isdigit() or int(value) < 1:
                raise ConfigError(f"--mesh '{mesh_spec}' must be AXIS=SIZE pairs such as tensor=2,fsdp=4.")
            sizes[name.strip()] = int(value)
        count = int(np.prod(list(sizes.values())))
        if count > len(jax.devices()):
            raise ConfigError(f"--mesh '{mesh_spec}' needs {count} devices; {len(jax.devices())} are here.")
        try:
            mesh = make_mesh(sizes, jax.devices()[:count])
        except (ValueError, KeyError) as e:
            raise ConfigError(f"--mesh '{mesh_spec}' is not a mesh of jaxtron's axes ({e}).") from None
    return model, mesh


def main(argv: list[str]) -> int:
    """`jaxtron generate`: prints the continuations the command line ``argv`` asks for."""
    from jaxtron.common.console import console_logging

    console_logging()
    parser = argparse.ArgumentParser(prog="jaxtron generate", description=__doc__.split("\n")[0])
    parser.add_argument("--run", required=True, help="training run (newest intact checkpoint) or converted model")
    parser.add_argument("--prompt", action="append", default=[], help="a prompt (repeat for a batch)")
    parser.add_argument("--prompts", help='JSONL file, one {"prompt": "..."} per line')
    parser.add_argument("--max-new-tokens", type=int, default=128,
                        help="tokens to add to each prompt at most, fewer at a stop string or end of text "
                             "(default: 128)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy (the default)")
    parser.add_argument("--top-k", type=int, default=0,
                        help="sample among the K most likely tokens only (default: 0, all tokens)")
    parser.add_argument("--top-p", type=float, default=1.0,
                        help="sample among the fewest tokens whose probabilities sum to P (default: 1, all tokens)")
    parser.add_argument("--seed", type=int, default=0,
                        help="the sampling's random seed: the same seed gives the same text (default: 0)")
    parser.add_argument("--stop", action="append", default=[], help="a string that ends a row (repeatable)")
    parser.add_argument("--tokenizer", help="'byte', a tokenizer.json or a SentencePiece .model (default: the run's)")
    parser.add_argument("--mesh", default="", help="devices to shard over, e.g. tensor=2,fsdp=4 (default: one)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="compute dtype")
    parser.add_argument("--chat", action="store_true", help="each prompt is a user's message in the chat template")
    parser.add_argument("--chat-template", help="with --chat: a .jinja file or tokenizer_config.json (default: the "
                                                "run's conversation store's template, or the tokenizer's own)")
    args = parser.parse_args(argv)
    if args.chat_template and not args.chat:
        raise ConfigError("--chat-template is used only with --chat; add --chat or leave it out.")
    sampling = Sampling(args.temperature, args.top_k, args.top_p, args.seed)
    if args.max_new_tokens < 1:  # checked before any model loads, as every flag
        raise ConfigError(f"--max-new-tokens must be at least 1, not {args.max_new_tokens}.")
    args.run = user_path(args.run)
    texts = list(args.prompt) + (read_prompts(args.prompts) if args.prompts else [])
    if not texts:
        raise ConfigError("no prompt given; pass --prompt TEXT or --prompts FILE.jsonl.")
    _check_directory(args.run)
    tokenizer = run_tokenizer(args.run, args.tokenizer)
    if args.chat:
        template = run_chat_template(args.run, args.chat_template, tokenizer)
        texts = [template.render([{"role": "user", "content": t}], add_generation_prompt=True) for t in texts]
        if template.end_of_turn():
            args.stop.append(template.end_of_turn())
    prompts = [[int(t) for t in tokenizer.encode(text)] for text in texts]
    if not all(prompts):  # refused before the model loads
        raise ConfigError("every prompt must hold at least one token; an empty prompt has nothing to continue.")
    model, mesh = load_model(args.run, args.dtype, args.mesh)
    if tokenizer.vocab_size > model.cfg.vocab_size:
        raise ConfigError(f"the tokenizer has {tokenizer.vocab_size} tokens, more than the model's vocabulary of "
                          f"{model.cfg.vocab_size}; pass the tokenizer the model was trained with.")
    printed = [""] * len(texts)

    def stop(row: int, tokens: list[int]) -> bool:
        return any(s in tokenizer.decode(tokens) for s in args.stop)

    def stream(row: int, tokens: list[int]) -> None:
        text = _held(_cut(tokenizer.decode(tokens), args.stop), args.stop)
        sys.stdout.write(text[len(printed[row]):])
        sys.stdout.flush()
        printed[row] = text

    if len(texts) == 1:
        sys.stdout.write(texts[0])
    result = Generator(model, mesh).generate(prompts, args.max_new_tokens, sampling, tokenizer.eos_id,
                                             stop if args.stop else None, stream if len(texts) == 1 else None,
                                             cache_dtype=args.dtype)
    if len(texts) == 1:
        final = _cut(tokenizer.decode(result.tokens[0]), args.stop)
        sys.stdout.write(final[len(printed[0]):] + "\n")
    else:
        for text, tokens in zip(texts, result.tokens, strict=True):
            sys.stdout.write(json.dumps({"prompt": text, "completion": _cut(tokenizer.decode(tokens), args.stop)})
                             + "\n")
    sys.stdout.flush()
    log.info("prefill: %d tokens in %.3f s (%.0f tokens/s, compile included); decode: %d tokens in %.3f s "
             "(%.1f tokens/s, first step's compile included)", result.prefill_tokens, result.prefill_s,
             result.prefill_tokens / max(result.prefill_s, 1e-9), result.decode_tokens, result.decode_s,
             result.decode_tokens / max(result.decode_s, 1e-9))
    return 0


def _held(text: str, stops: Sequence[str]) -> str:
    """``text`` without an ending that may be the start of a stop string (streamed only once it is not)."""
    held = max((k for stop in stops for k in range(1, len(stop)) if text.endswith(stop[:k])), default=0)
    return text[:len(text) - held]


def _cut(text: str, stops: Sequence[str]) -> str:
    """``text`` up to the first stop string in it."""
    ends = [text.index(s) for s in stops if s in text]
    return text[:min(ends)] if ends else text
