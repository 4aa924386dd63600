"""The lm-evaluation-harness model: a jaxtron run (or converted model) scored by lm-eval's tasks.

    jaxtron lm-eval --model jaxtron --model_args run=DIR[,dtype=bfloat16,mesh=tensor=2] --tasks T1,T2 \\
                    --include_path TASKS_DIR [any other lm_eval option]

is lm-eval's own command line with the name ``jaxtron`` registered (lm-eval reads no entry points, so its ``lm_eval``
command cannot find a model another package defines; this one imports lm-eval's built-in models too, so ``--model
hf`` works here as well). From Python, importing this module registers the name:
``import jaxtron.inference.harness`` and then ``lm_eval.simple_evaluate(model="jaxtron", model_args="run=DIR", ...)``;
or pass ``JaxtronLM(run=DIR)`` (or ``JaxtronLM.from_model``) as the model. Tasks come from local files: an
``--include_path`` directory of task YAMLs whose data are local JSONL (``dataset_path: json``); no network is
needed.

``loglikelihood`` scores each (context, continuation) pair with one forward pass of the model over both, the
continuation's tokens summed (and whether each was the greedy choice); requests go in batches of ``batch_size`` rows
of similar length, right-padded to a power of two, each shape compiled once. A sequence longer than the model's
``max_seq_len`` keeps its end. ``loglikelihood_rolling`` scores a whole text in windows of ``max_seq_len`` tokens, each
conditioned on the end of the one before (lm-eval's disjoint rolling windows), starting from the prefix token: the
tokenizer's beginning-of-sequence token, else its end-of-document token, else a newline (byte-level models).
``generate_until`` decodes greedily (or samples, if the task asks) with the KV cache of ``jaxtron generate``, ending
at the task's ``until`` strings, the end-of-document token or ``max_gen_toks``.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np

from jaxtron.common.files import user_path
from jaxtron.config.schema import ConfigError
from jaxtron.inference.generate import Generator, Sampling, bucket, load_model, run_tokenizer

log = logging.getLogger(__name__)

try:
    from lm_eval.api.model import TemplateLM
except ImportError:  # the model can still be built and used for scoring without lm-eval installed
    TemplateLM = object

NEWLINE = 10  # the byte-level prefix token


class Scorer:
    """Log-probabilities of token sequences under a model, batched and compiled per padded shape."""

    def __init__(self, generator: Generator, batch_size: int = 8):
        import jax

        self.generator, self.batch_size = generator, max(int(batch_size), 1)
        self.max_length = generator.cfg.max_seq_len
        self._forward = jax.jit(self._forward_fn)

    def _forward_fn(self, state, tokens, targets):
        import jax
        import jax.numpy as jnp

        logits = self.generator._model(state)(tokens).logits().astype(jnp.float32)
        logp = jax.nn.log_softmax(logits, axis=-1)
        return jnp.take_along_axis(logp, targets[..., None], -1)[..., 0], jnp.argmax(logits, -1) == targets

    def score(self, sequences: Sequence[tuple[Sequence[int], int]]) -> list[tuple[float, bool]]:
        """For each (tokens, n): the summed log-probability of its last ``n`` tokens given the ones before, and whether
        each of them was the model's greedy choice. A sequence beyond ``max_seq_len`` + 1 tokens keeps its end."""
        import contextlib

        import jax

        results: list[tuple[float, bool] | None] = [None] * len(sequences)
        order = sorted(range(len(sequences)), key=lambda i: -len(sequences[i][0]))
        mesh = self.generator.mesh
        with jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext():
            for start in range(0, len(order), self.batch_size):
                rows = order[start:start + self.batch_size]
                seqs = [list(sequences[i][0])[-(self.max_length + 1):] for i in rows]
                width = min(bucket(max(len(s) - 1 for s in seqs)), self.max_length)
                batch = self.batch_size if len(order) > self.batch_size else len(rows)
                if mesh is not None:
                    from jaxtron.parallel.sharding import shard_count
                    split = shard_count(dict(mesh.shape), "activation_batch")
                    batch = -(-batch // split) * split
                tokens = np.zeros((batch, width), np.int32)
                targets = np.zeros((batch, width), np.int32)
                for r, s in enumerate(seqs):
                    tokens[r, :len(s) - 1], targets[r, :len(s) - 1] = s[:-1], s[1:]
                logp, greedy = (np.asarray(a) for a in self._forward(self.generator.state, tokens, targets))
                for r, i in enumerate(rows):
                    n, end = min(sequences[i][1], len(seqs[r]) - 1), len(seqs[r]) - 1
                    results[i] = (float(logp[r, end - n:end].sum(dtype=np.float64)), bool(greedy[r, end - n:end].all()))
        return results


class JaxtronLM(TemplateLM):
    """lm-eval's model interface over a jaxtron model and its tokenizer."""

    def __init__(self, run: str = "", tokenizer: str | None = None, dtype: str = "float32", mesh: str = "",
                 batch_size: int | str = 8, max_batch_size: int | None = None, device: str | None = None,
                 pretrained: str = "", **unused: Any):
        if TemplateLM is object:
            raise ConfigError("lm-eval is not installed; install it with pip install -e \".[eval]\".")
        super().__init__()
        run = run or pretrained
        if not run:
            raise ConfigError("--model_args needs run=DIR: a training run or a converted model.")
        if unused:
            log.warning("model_args %s are not used by the jaxtron model", sorted(unused))
        del max_batch_size, device  # batches are batch_size rows; the devices are JAX's (mesh= shards over them)
        run = user_path(run)
        model, mesh_ = load_model(run, dtype, mesh)
        self._setup(Generator(model, mesh_), run_tokenizer(run, tokenizer), batch_size)

    @classmethod
    def from_model(cls, model, tokenizer, mesh=None, batch_size: int = 8) -> JaxtronLM:
        """The interface over a model already in memory (the training loop's evaluation)."""
        self = cls.__new__(cls)
        TemplateLM.__init__(self)
        self._setup(Generator(model, mesh), tokenizer, batch_size)
        return self

    def _setup(self, generator: Generator, tokenizer, batch_size: int | str) -> None:
        if str(batch_size).startswith("auto"):
            batch_size = 8
        self.generator, self.tokenizer = generator, tokenizer
        self.scorer = Scorer(generator, int(batch_size))

    @property
    def eot_token_id(self) -> int:
        return NEWLINE if self.tokenizer.eos_id is None else int(self.tokenizer.eos_id)

    @property
    def prefix_token_id(self) -> int:
        """What an empty context and the first rolling window start from: the tokenizer's beginning-of-sequence
        token if it has one (as lm-eval's Hugging Face model does), else ``eot_token_id``."""
        bos = getattr(self.tokenizer, "bos_id", None)
        return self.eot_token_id if bos is None else int(bos)

    @property
    def max_length(self) -> int:
        return self.generator.cfg.max_seq_len

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs: Any) -> list[int]:
        return [int(t) for t in self.tokenizer.encode(string)]

    def tok_decode(self, tokens: Sequence[int], **kwargs: Any) -> str:
        return self.tokenizer.decode(tokens, skip_special=True)

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs: Any) -> list[tuple[float, bool]]:
        return self.scorer.score([(list(context) + list(continuation), len(continuation))
                                  for _, context, continuation in requests])

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

        windows, owner = [], []
        for i, request in enumerate(requests):
            tokens = self.tok_encode(request.args[0])
            for window in get_rolling_token_windows(tokens, self.prefix_token_id, self.max_length, 1):
                context, continuation = make_disjoint_window(window)
                windows.append((list(context) + list(continuation), len(continuation)))
                owner.append(i)
        totals = [0.0] * len(requests)
        for i, (logp, _) in zip(owner, self.scorer.score(windows), strict=True):
            totals[i] += logp
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        by_settings: dict[tuple, list[int]] = {}
        for i, request in enumerate(requests):
            by_settings.setdefault(_settings(request.args[1]), []).append(i)
        out: list[str] = [""] * len(requests)
        for (until, max_tokens, temperature), rows in by_settings.items():
            max_tokens = min(max_tokens, self.max_length - 1)  # a prompt keeps at least its last token
            room = self.max_length - max_tokens  # a longer prompt keeps its end
            for start in range(0, len(rows), self.scorer.batch_size):
                chunk = rows[start:start + self.scorer.batch_size]
                prompts = [(self.tok_encode(requests[i].args[0]) or [self.prefix_token_id])[-room:] for i in chunk]
                result = self.generator.generate(
                    prompts, max_tokens, Sampling(temperature=temperature), self.tokenizer.eos_id,
                    stop=(lambda row, tokens, until=until: any(s in self.tok_decode(tokens) for s in until))
                    if until else None)
                for i, tokens in zip(chunk, result.tokens, strict=True):
                    text = self.tok_decode(tokens)
                    ends = [text.index(s) for s in until if s in text]
                    out[i] = text[:min(ends)] if ends else text
        return out


def _settings(gen_kwargs: dict) -> tuple[tuple[str, ...], int, float]:
    """(stop strings, new tokens at most, temperature) of a task's generation settings."""
    until = gen_kwargs.get("until") or ()
    until = (until,) if isinstance(until, str) else tuple(until)
    max_tokens = int(gen_kwargs.get("max_gen_toks", gen_kwargs.get("max_new_tokens", 256)))
    temperature = float(gen_kwargs.get("temperature", 0.0)) if gen_kwargs.get("do_sample", False) else 0.0
    return until, max_tokens, temperature


def register() -> None:
    """Makes ``--model jaxtron`` known to lm-eval, its built-in models kept (they register themselves lazily)."""
    import lm_eval.models  # noqa: F401 - fills the registry with the built-in models first
    from lm_eval.api.registry import model_registry

    if "jaxtron" not in model_registry:
        model_registry.register("jaxtron", target=f"{__name__}:JaxtronLM")


def main(argv: list[str]) -> int:
    """`jaxtron lm-eval ARGS`: lm-eval's command line, with ``--model jaxtron`` registered."""
    check_limit(argv)  # before lm-eval loads anything (it refuses a bad --limit only after ~20 s)
    try:
        from lm_eval.__main__ import cli_evaluate
    except ImportError:
        raise ConfigError("lm-eval is not installed; install it with pip install -e \".[eval]\".") from None
    register()
    if not argv or argv[0] in ("-h", "--help"):  # lm-eval's `run` options, under this command's name
        import contextlib
        import io

        text = io.StringIO()
        sys.argv = ["lm-eval", "run", "--help"]
        with contextlib.redirect_stdout(text), contextlib.suppress(SystemExit):
            cli_evaluate()
        print(text.getvalue().replace("usage: lm-eval run", "usage: jaxtron lm-eval", 1))
        return 0
    sys.argv = ["lm-eval", *argv]
    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):  # no network at run time: local task data only
        os.environ.setdefault(name, "1")
    try:
        cli_evaluate()
    except Exception as e:
        reason = unloadable_task(e)
        if reason is None:
            raise
        raise ConfigError(reason) from None
    return 0


def check_limit(argv: list[str]) -> None:
    """A ConfigError for an ``--limit`` (``-L``) that is not a positive number: lm-eval takes a count of documents
    per task, or a fraction of them below 1."""
    for i, arg in enumerate(argv):
        name, eq, value = arg.partition("=")
        if name not in ("--limit", "-L"):
            continue
        if not eq:
            value = argv[i + 1] if i + 1 < len(argv) else ""
        try:
            ok = float(value) > 0
        except ValueError:
            ok = False
        if not ok:
            raise ConfigError(f"option '--limit' is {value!r}; pass a count of documents per task (1 or more) or a "
                              "fraction of them between 0 and 1.")


def unloadable_task(error: BaseException) -> str | None:
    """The sentence for an lm-eval failure that names a task it cannot load (unknown, or its data not on this
    machine), None for any other error."""
    import traceback

    if isinstance(error, ValueError) and str(error).startswith("Tasks not found"):
        names = str(error).partition(":")[2].strip().strip("[]").replace("'", "")
        return (f"lm-eval knows no task {names}; list its tasks with `jaxtron lm-eval "
                "--tasks list`, or pass --include_path DIR holding the task's YAML.")
    frames = traceback.extract_tb(error.__traceback__)
    if frames and f"{os.sep}datasets{os.sep}" in frames[-1].filename:  # raised while loading a task's data
        first = str(error).splitlines()[0] if str(error) else type(error).__name__
        return (f"a task's data cannot be loaded here ({first}); runs have no network, so use a task whose "
                "dataset is on this machine (its YAML's dataset_path naming local files, with --include_path), or "
                "fill the Hugging Face datasets cache first.")
    return None


if TemplateLM is not object:  # importing this module is what lm_eval.simple_evaluate(model="jaxtron") needs
    register()

