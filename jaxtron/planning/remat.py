"""``execution.remat='auto'``: the fastest rematerialisation policy whose step fits the device, by the planner's
memory estimate (within 10% of the compiled programs' peaks, ``benchmarks/plan_validation.md``).

The policies from fastest to leanest (``AUTO_ORDER``; it and the choice live in ``jaxtron.planning.estimate``):
save_dots_attention keeps every weight matmul's output and the attention kernel's, so the backward pass recomputes
only elementwise work; save_dots recomputes attention too; save_attention recomputes the projections; full
recomputes the whole block. 'none' is not among them: it keeps every intermediate, norms' float32 statistics and
weight copies included, for a step slower than save_dots_attention's (the time budget of Llama-3 8B's 8-layer step
on one H200: 481 against 443 ms, at 84 against 56 GiB; GPT-3's tensor-parallel shard measured on an H200: 0.391
against save_dots' 0.363 s).
"""

from __future__ import annotations

import dataclasses
import os

from jaxtron.config.schema import Config, ConfigError
from jaxtron.planning.estimate import AUTO, choose_remat
from jaxtron.planning.gpus import GPU, GPUS


def device_gpu(device) -> tuple[GPU, bool]:
    """(the planner's entry for a jax device, whether its program is XLA:CPU's): an H100 or H200 by its kind, another
    GPU as an H100 with the memory the device reports, a CPU device as one with its share of the host's memory."""
    kind = device.device_kind.lower()
    for key, gpu in GPUS.items():
        if key in kind.split() or f"nvidia {key}" in kind:
            return gpu, False
    stats = device.memory_stats() or {}
    if device.platform == "cpu":
        import jax
        host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        share = host // max(1, sum(d.process_index == jax.process_index() for d in jax.devices()))
        return dataclasses.replace(GPUS["h100"], name="CPU", memory_bytes=share), True
    if "bytes_limit" not in stats:
        raise ConfigError(f"execution.remat='auto' needs the device's memory, which the {device.device_kind} does not "
                          "report; name a policy (full, save_attention, save_dots, save_dots_attention).")
    return dataclasses.replace(GPUS["h100"], name=device.device_kind, memory_bytes=stats["bytes_limit"]), False


def resolve_for_devices(cfg: Config, sizes: dict[str, int], devices: list) -> Config:
    """``cfg`` with remat 'auto' resolved for a run on ``devices`` (the mesh ``sizes``); logged."""
    if cfg.execution.remat != AUTO:
        return cfg
    import logging
    gpu, cpu_program = device_gpu(devices[0])
    chosen, need = choose_remat(cfg, sizes, gpu, cpu_program)
    logging.getLogger(__name__).info(
        "execution.remat='auto' chose %s: the planner estimates %.1f GiB a device of %.0f usable on %s",
        chosen.execution.remat, need / 2**30, gpu.usable_bytes / 2**30, gpu.name)
    return chosen
