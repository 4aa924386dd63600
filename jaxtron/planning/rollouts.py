"""DPO's and GRPO's steps in the estimate. DPO's: an update and the reference's forward pass. GRPO's:
``rl.updates`` train updates, the log-probabilities computed once before them, and the generation of the step's
completions on the training mesh (``jaxtron.training.rollouts``).

- 'logprobs': one forward pass over the step's rows for the sampling parameters and, with a KL penalty, one for
  the reference: a third of an update's matmul and attention each (an update is a forward and a backward twice
  its size).
- 'generation': the prefill, every row's prompt (``data.seq_len - rl.max_new_tokens`` tokens, padding included)
  at the forward's rate; then ``rl.max_new_tokens`` decoding steps. A decoding step reads every weight a device
  multiplies with (its tensor shard, gathered over fsdp first, as the sampler's program does; the layer loop's
  copies too, ``DECODE_WEIGHT_PASSES``) and the keys and values cached so far, at HBM bandwidth, or does its
  matmuls, whichever takes longer; the fsdp gather crosses NVLink each step.
- memory 'generation': what the sampler allocates (``sampler_memory``) beyond the step's own transients.
"""

from __future__ import annotations

import math

from jaxtron.config.schema import Config
from jaxtron.planning.gpus import GPU
from jaxtron.planning.params import Param
from jaxtron.planning.shape import BlockValues, StepShape

TERMS = ("logprobs", "generation")
# The prefill's working space, in bytes per prompt token: per element of the residual stream (whole on every
# device of a tensor group; float32 copies around the norms) and per element of the values split over it (query,
# attention output, keys and values, the MLP's three). Fitted to two compiled samplers of Llama-3 8B at 4 layers:
# one H200 with 16 rows of 512-token prompts (1.21 GiB), and tensor=8 on 8 H100s with 64 rows of 1792 (7.94 GiB)
PREFILL_RESIDUAL_BYTES = 15.2
PREFILL_SPLIT_BYTES = 1.81
# The prefill's attention runs in XLA (the cache's layout), its float32 scores and their transpose live at once:
# 3.2 GB each for Llama-3.2 1B, 16 rows of 1536-token prompts, tensor=2, where they set the sampler's peak
SCORE_BYTES = 8
DECODE_LOGIT_COPIES = 4  # a decoding step's float32 logits, their softmax, and top-k/top-p's sorted values and indices
# Each decoding step reads every weight for its GEMMs, and the layer loop first slices each layer's weights out of
# the stack into a copy: 1.33 passes more, from the compiled sampler of Llama-3 8B at 4 layers on the H200 target
# (its dynamic slices 700 ms beside the GEMMs' 528 ms of weight reads; benchmarks/grpo_generation.md)
DECODE_WEIGHT_PASSES = 1 + 700 / 528


def rollout_time(cfg: Config, shape: StepShape, block: BlockValues, gpu: GPU, params: tuple[Param, ...],
                 update: dict[str, float]) -> dict[str, float]:
    """Seconds of the two terms for one step, given one update's compute terms ``update``."""
    rl, m = cfg.rl, shape.model
    forward = (update["matmul"] + update["attention"]) / 3  # one pass over the step's rows
    passes = 1 + (rl.kl > 0)
    width = shape.seq_len - rl.max_new_tokens
    prefill = forward * width / shape.seq_len
    fsdp = shape.mesh.get("fsdp", 1)
    weights = sum(math.prod(p.shape) for p in params) * shape.value_bytes / shape.tensor  # read whole over fsdp
    rows = cfg.train.global_batch_size / shape.data_parallel  # a device's rows, every token of them
    layers = m.num_layers
    context = width + rl.max_new_tokens / 2  # the mean cached length over the decoding steps
    cache = rows * context * layers * 2 * block.kv_width * shape.value_bytes
    step_compute = forward / shape.seq_len  # one token a row
    decode = max((DECODE_WEIGHT_PASSES * weights + cache) / gpu.hbm_bandwidth, step_compute)
    gather = weights * (fsdp - 1) / fsdp / gpu.nvlink_bandwidth if fsdp > 1 else 0.0
    return {"logprobs": passes * forward, "generation": prefill + rl.max_new_tokens * (decode + gather)}


def sampler_memory(cfg: Config, shape: StepShape, block: BlockValues, params: tuple[Param, ...]) -> float:
    """Bytes GRPO's sampler allocates on a device beside the parameters it reads: their copy in the compute dtype
    (``rollouts.cast_once``), the KV cache of every row the device samples, the prefill's
    working space and a decoding step's logits. Every layer's cache is counted whole: a local layer's window or a
    latent cache would be smaller."""
    rl, m = cfg.rl, shape.model
    weights = 0.0  # the cast copy, gathered over fsdp out of the decoding loop; the embedding too without tensor
    if shape.value_bytes < 4:  # parallelism (with it, the compiled lookups read their shard)
        weights = shape.value_bytes * sum(
            p.shard_elements(shape.mesh) if p.path.startswith("embedding") and shape.tensor > 1
            else p.gathered_elements(shape.mesh) for p in params)
    rows = cfg.train.global_batch_size / shape.data_parallel  # the sampler runs them all at once: no microbatches
    width = shape.seq_len - rl.max_new_tokens
    cache = rows * shape.seq_len * m.num_layers * 2 * block.kv_width * shape.value_bytes
    split = 2 * block.q_width + 2 * block.kv_width + 3 * block.mlp_width
    scores = SCORE_BYTES * rows * block.heads * width * shape.seq_len
    prefill = max(rows * width * (PREFILL_RESIDUAL_BYTES * block.embed + PREFILL_SPLIT_BYTES * split), scores)
    return weights + cache + prefill + DECODE_LOGIT_COPIES * rows * block.vocab * 4.0


RESIDENT = ("parameters", "optimizer", "reference", "cudnn_workspace")  # memory terms held while the sampler runs


def sampler_excess(sampler_bytes: float, held: dict[str, float]) -> float:
    """The memory term 'generation': what the sampler's allocation adds to the device's peak beyond the step's own
    transients (``held`` less the resident state). It is 0 unless sampling sets the peak: many rows at once (the
    step may take them in microbatches, the sampler does not), long sequences, a small step."""
    transients = sum(v for k, v in held.items() if k not in RESIDENT)
    return max(0.0, sampler_bytes - transients)


def with_rollouts(cfg: Config, shape: StepShape, block: BlockValues, gpu: GPU, params: tuple[Param, ...],
                  time: dict[str, float]) -> dict[str, float]:
    """One update's terms ``time`` as GRPO's step: each ``rl.updates`` times, with 'logprobs' and 'generation'.
    DPO's step adds the reference's forward pass over its rows as 'logprobs'."""
    if cfg.train.objective == "dpo":
        return {**time, "logprobs": (time["matmul"] + time["attention"]) / 3}
    if cfg.train.objective != "grpo":
        return time
    step = {k: v * cfg.rl.updates for k, v in time.items()}
    step.update(rollout_time(cfg, shape, block, gpu, params, time))
    return step


def rollout_flops(cfg: Config, update_flops: float) -> float:
    """Model FLOPs a device does in a GRPO step, from one update's (``update_flops``): the updates, the
    log-probabilities' forward passes, and generation's forward over every prompt and completion token."""
    forward = update_flops / 3
    if cfg.train.objective == "dpo":
        return update_flops + forward
    if cfg.train.objective != "grpo":
        return update_flops
    return update_flops * cfg.rl.updates + forward * (1 + (cfg.rl.kl > 0)) + forward
