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
"""

from __future__ import annotations

import math

from jaxtron.config.schema import Config
from jaxtron.planning.gpus import GPU
from jaxtron.planning.params import Param
from jaxtron.planning.shape import BlockValues, StepShape

TERMS = ("logprobs", "generation")
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
