"""GRPO's batches: completions sampled on the training mesh from the parameters being trained, scored by the
reward function, and laid out as rows for the update (``grpo.py``).

Step ``s`` takes prompts ``s P .. s P + P - 1`` of the prompt store's order (``P = global_batch_size /
group_size``), repeats each ``group_size`` times, and samples each row's completion with a KV cache (the model's
``decode``, one compiled program: the prefill, then ``rl.max_new_tokens`` steps in a loop). The key comes from the
seed and the step alone, so a resumed run samples the same completions. A completion ends at the end-of-document
token or the chat template's end-of-turn marker, both kept (the model learns to stop); the reward function sees
its text without them. Prompts longer than ``data.seq_len - rl.max_new_tokens`` keep their end.
"""

from __future__ import annotations

import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxtron.config.schema import Config
from jaxtron.data.loader import place_rows
from jaxtron.models.projection import Projection
from jaxtron.models.sampling import Sampling, next_tokens
from jaxtron.parallel.sharding import rows_sharding
from jaxtron.training.rewards import Reward, score
from jaxtron.training.working_copy import working_copy

ROLLOUT_TAG = 0x524F4C4C  # folded into the step's key, so that rollouts draw apart from LoRA's dropout


def sampler(graphdef: Any, cfg: Config):
    """``f(params, prompts [rows, width], lengths [rows], key) -> completions [rows, rl.max_new_tokens]``: each
    row's prompt (right-padded) prefilled, then one token a step at the row's own position."""
    rl, steps = cfg.rl, cfg.rl.max_new_tokens
    sampling = Sampling(rl.temperature, rl.top_k, rl.top_p)

    def sample(params, prompts, lengths, key):
        if cfg.optimizer.distributed:  # the masters gathered once, not in every decoding step
            params = working_copy(graphdef, params)
        model = cast_once(nnx.merge(graphdef, params), jnp.dtype(cfg.execution.dtype))
        cache = model.empty_cache(prompts.shape[0], prompts.shape[1] + steps, jnp.dtype(cfg.execution.dtype))
        columns = jnp.arange(prompts.shape[1], dtype=jnp.int32)[None, :]
        positions = jnp.where(columns < lengths[:, None], columns, -1)  # padding writes no cache slot
        logits, cache = model.decode(prompts, positions, cache, last=lengths - 1)
        last = logits[:, 0]

        def body(carry, i):
            logits, cache, position = carry
            token = next_tokens(logits, jax.random.fold_in(key, i), sampling)
            logits, cache = model.decode(token[:, None], position[:, None], cache)
            return (logits[:, 0], cache, position + 1), token

        _, tokens = jax.lax.scan(body, (last, cache, lengths), jnp.arange(steps))
        return tokens.T

    return sample


def cast_once(model: nnx.Module, dtype) -> nnx.Module:
    """``model`` with its projections' weights and its embedding and head in the compute ``dtype``: cast once before
    the decoding loop, not in each of its steps (XLA left the casts inside it: 910 of the 2916 ms budget of
    Llama-3 8B's sampler at 4 layers, 16 rows of 512 tokens, on the H200 target). Each value is the one the
    projection's own cast makes, so the draws are unchanged."""
    if dtype == jnp.float32:
        return model
    for _, module in nnx.iter_modules(model):
        if isinstance(module, Projection):
            module.weight.set_value(module.weight[...].astype(module.dtype))
    for name in ("embedding", "head"):  # the lookup and the head cast to the compute dtype themselves
        if getattr(model, name, None) is not None:
            getattr(model, name).set_value(getattr(model, name)[...].astype(dtype))
    return model


def completion_end(tokens: list[int], decode, eos_id: int | None, stops: list[str]) -> int:
    """How many of ``tokens`` the completion keeps: through its first end-of-document token or stop string."""
    end = len(tokens)
    if eos_id is not None and eos_id in tokens:
        end = tokens.index(eos_id) + 1
    text = decode(tokens[:end])
    found = [text.index(s) + len(s) for s in stops if s and s in text]
    if not found:
        return end
    low, high = 1, end  # the fewest tokens whose text holds the first stop string: decoded lengths only grow
    while low < high:
        middle = (low + high) // 2
        low, high = (middle + 1, high) if len(decode(tokens[:middle])) < min(found) else (low, middle)
    return low


def advantages(rewards: np.ndarray, group: int, scale: bool) -> tuple[np.ndarray, np.ndarray]:
    """(each reward less its group's mean, over the group's standard deviation with ``scale``; each row's group
    standard deviation). Rows ``g * group .. g * group + group - 1`` are one prompt's completions."""
    grouped = rewards.reshape(-1, group)
    spread = grouped.std(axis=1, keepdims=True)
    centred = grouped - grouped.mean(axis=1, keepdims=True)
    out = centred / (spread + 1e-4) if scale else centred
    return out.reshape(-1).astype(np.float32), np.repeat(spread[:, 0], group).astype(np.float32)


def decoding(store: Any) -> tuple[Any, int | None, list[str]]:
    """(tokenizer, end-of-document id, stop strings) of a prompt store: its tokenizer, and its chat template's
    end-of-turn marker."""
    from jaxtron.data.chat import ChatTemplate
    from jaxtron.data.tokenizers import load_tokenizer
    spec = store.manifest.get("tokenizer") or {}
    tokenizer = load_tokenizer("byte" if spec.get("kind") == "byte" else spec.get("path", ""), spec.get("eos"))
    template = store.manifest.get("chat_template")
    stop = ChatTemplate(template["source"], template.get("special_tokens")).end_of_turn() if template else ""
    return tokenizer, store.eos_id, [stop] if stop else []


class Rollouts:
    """A GRPO run's batches: batch ``step`` sampled from the parameters ``state_fn()`` holds when it is asked for
    (the loop asks once the step before it is dispatched: on policy). ``log_values`` says what generation took."""

    def __init__(self, cfg: Config, source: Any, mesh: Any, graphdef: Any, param_shardings: Any, state_fn,
                 step: int, reward: Reward):
        self.cfg, self.source, self.mesh, self.state_fn, self.step, self.reward = (cfg, source, mesh, state_fn,
                                                                                   step, reward)
        self.tokenizer, self.eos_id, self.stops = decoding(source.store)
        self.group = cfg.rl.group_size
        self.prompts = cfg.train.global_batch_size // self.group
        self.width = cfg.data.seq_len - cfg.rl.max_new_tokens
        rows = rows_sharding(mesh)
        self._sample = jax.jit(sampler(graphdef, cfg), in_shardings=(param_shardings, rows, rows, None),
                               out_shardings=rows)
        self.reset()

    def reset(self) -> None:
        self.made: dict[int, tuple[float, float, int, int]] = {}  # step -> (sampling s, scoring s, tokens, rows)

    def __next__(self) -> dict[str, jax.Array]:
        batch = self.batch(self.step)
        self.step += 1
        return batch

    def __iter__(self):
        return self

    def close(self) -> None:
        pass

    def batch(self, step: int) -> dict[str, jax.Array]:
        """The rows of step ``step``: prompts and their sampled completions, rewards and advantages."""
        picked = self.source.prompts(step * self.prompts + np.arange(self.prompts))
        prompts = [ids[-self.width:] for ids, _ in picked for _ in range(self.group)]
        tokens = np.zeros((len(prompts), self.width), np.int32)
        for row, ids in enumerate(prompts):
            tokens[row, :len(ids)] = ids
        lengths = np.asarray([len(ids) for ids in prompts], np.int32)
        key = jax.random.fold_in(jax.random.fold_in(jax.random.key(self.cfg.train.seed), step), ROLLOUT_TAG)
        params = jax.block_until_ready(self.state_fn().params)  # the update before: not generation's time
        start = time.perf_counter()
        with jax.set_mesh(self.mesh):
            sharding = rows_sharding(self.mesh)
            placed = [jax.device_put(a, sharding) for a in (tokens, lengths)]
            completions = _host(self._sample(params, *placed, key))
        scored = time.perf_counter()
        records = [record for _, record in picked for _ in range(self.group)]
        rows = self._rows(prompts, completions, records)
        kept = int(rows["loss_mask"].sum())
        self.made[step] = (scored - start, time.perf_counter() - scored, kept, len(prompts))
        return place_rows(rows, self.mesh)

    def _rows(self, prompts: list[np.ndarray], completions: np.ndarray, records: list[dict]) -> dict[str, np.ndarray]:
        """The update's rows: each prompt and its kept completion, the loss on the completion, the advantages."""
        rows, length = len(prompts), self.cfg.data.seq_len
        out = {k: np.zeros((rows, length), np.int32) for k in ("inputs", "targets", "loss_mask")}
        rewards = np.zeros(rows, np.float32)
        for row, (prompt, completion, record) in enumerate(zip(prompts, completions.tolist(), records, strict=True)):
            kept = completion[:completion_end(completion, self.tokenizer.decode, self.eos_id, self.stops)]
            text = self.tokenizer.decode(kept[:-1] if kept and kept[-1] == self.eos_id else kept)
            for stop in self.stops:
                text = text.split(stop, 1)[0]
            rewards[row] = score(self.reward, self.cfg.rl.reward, self.tokenizer.decode(prompt), text, record)
            sequence = np.concatenate([prompt, np.asarray(kept, np.int32)])
            n = len(sequence) - 1
            out["inputs"][row, :n], out["targets"][row, :n] = sequence[:-1], sequence[1:]
            out["loss_mask"][row, len(prompt) - 1:n] = 1
        advantage, spread = advantages(rewards, self.group, self.cfg.rl.scale_rewards)
        widen = lambda values: np.repeat(values[:, None], length, axis=1)  # per token: sharded like the tokens
        out.update(positions=np.broadcast_to(np.arange(length, dtype=np.int32), (rows, length)).copy(),
                   segment_ids=np.ones((rows, length), np.int32), advantages=widen(advantage),
                   rewards=widen(rewards), group_stds=widen(spread))
        return out

    def log_values(self, done: int, values: dict[str, float]) -> dict[str, float]:
        """Generation's share of the steps up to ``done`` since the last log (``values``, the meter's): sampling's
        seconds a step and tokens a second, the mean completion length, the reward function's seconds a step,
        and the update's tokens a second with those two left out."""
        logged = [self.made.pop(step) for step in sorted(self.made) if step < done]
        steps = max(len(logged), 1)
        sampling, scoring, tokens, rows = (sum(x) for x in zip(*logged, strict=True)) if logged else (0, 0, 0, 0)
        update = max(values.get("step_time_s", 0.0) - (sampling + scoring) / steps, 1e-9)
        return {"grpo/generation_s": sampling / steps, "grpo/scoring_s": scoring / steps,
                "grpo/generation_tokens_per_s": tokens / max(sampling, 1e-9),
                "grpo/completion_tokens": tokens / max(rows, 1),
                "grpo/train_tokens_per_s": self.cfg.train.global_batch_size * self.cfg.data.seq_len / update}


def _host(array: jax.Array) -> np.ndarray:
    """A global array whole on every process."""
    if array.is_fully_addressable:
        return np.asarray(jax.device_get(array))
    from jax.experimental import multihost_utils
    return np.asarray(multihost_utils.process_allgather(array, tiled=True))
