"""Dry run: lower and compile the real train step for one mesh with abstract inputs (no parameter memory),
then read XLA's memory analysis, the collectives and the matmul FLOPs of the compiled program.

``dry_run`` compiles for the devices jax has: fake CPU devices (``--xla_force_host_platform_device_count``) stand
in for GPUs. XLA:CPU partitions the program like XLA:GPU does, but attention runs as the XLA implementation (no
cuDNN kernel), 16-bit matmul operands become float32, and its buffers differ from a GPU's. ``dry_run_on_target``
compiles the program a GPU runs, for compile-only H100s or H200s (``jaxtron.gpu.target``), and
``on_target_in_subprocess`` does so in a process of its own.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import time
from typing import Any

import jax
import jax.numpy as jnp

from jaxtron.checkpoint.train_state import abstract_with_shardings
from jaxtron.common.files import write_atomic
from jaxtron.config.schema import Config, ConfigError
from jaxtron.metrics import schedule as gpu_schedule
from jaxtron.metrics.collectives import collectives
from jaxtron.metrics.hlo import matmul_flops
from jaxtron.ops.attention import cpu_implementation
from jaxtron.parallel.checks import check_devices
from jaxtron.parallel.mesh import make_mesh
from jaxtron.parallel.sharding import batch_sharding, per_device_sharding, rows_sharding, shard_count
from jaxtron.planning.estimate import choose_remat
from jaxtron.planning.gpus import GPUS
from jaxtron.planning.remat import resolve_for_devices
from jaxtron.training import state as state_lib
from jaxtron.training.rollouts import sampler
from jaxtron.training.step import rollout_step, train_step

BATCH_KEYS = ("inputs", "targets", "segment_ids", "positions", "loss_mask")
ROLLOUT_KEYS = ("advantages", "rewards", "group_stds")  # GRPO's batch: float32 per token beside the tokens


@dataclasses.dataclass
class DryRun:
    mesh: dict[str, int]
    compile_s: float
    argument_bytes: int  # per device: parameters, optimizer state, batch
    output_bytes: int
    alias_bytes: int  # outputs written in place of donated inputs
    temp_bytes: int  # activations and working space
    collectives: dict[str, dict[str, float]]  # kind -> {"count", "bytes"} per step and device
    # matmul FLOPs per device and step, recompute included, read from the partitioned program
    # (jaxtron.metrics.hlo.matmul_flops: dots, cuBLAS GEMMs and cuDNN attention counted from their shapes)
    flops: float
    # GRPO: the optimized HLO of the sampler that makes the step's batch (training/rollouts.py), priced apart
    generation_text: str = dataclasses.field(default="", repr=False)
    # GRPO: what the sampler allocates beside the parameters it reads (its temporaries and outputs): the cast
    # weights, the KV cache, the prefill's working space. The rest of the state stays resident meanwhile.
    generation_bytes: int = 0

    @property
    def peak_bytes(self) -> int:
        """Arguments + outputs not aliased to them + temporaries: what the device holds at the step's peak."""
        return self.argument_bytes + self.output_bytes - self.alias_bytes + self.temp_bytes


def abstract_batch(cfg: Config, mesh) -> dict[str, jax.ShapeDtypeStruct]:
    shape = (cfg.train.global_batch_size, cfg.data.seq_len)
    sharding = batch_sharding(mesh)
    batch = {k: jax.ShapeDtypeStruct(shape, jnp.int32, sharding=sharding) for k in BATCH_KEYS}
    if cfg.train.objective == "grpo":
        batch.update({k: jax.ShapeDtypeStruct(shape, jnp.float32, sharding=sharding) for k in ROLLOUT_KEYS})
    return batch


def _sampler(cfg: Config, setup, shardings, mesh) -> tuple[str, int]:
    """GRPO's sampler compiled for ``mesh`` from abstract inputs: (its optimized HLO text, the bytes of its
    temporaries and outputs)."""
    if cfg.train.objective != "grpo":
        return "", 0
    rows, width = cfg.train.global_batch_size, cfg.data.seq_len - cfg.rl.max_new_tokens
    placed = rows_sharding(mesh)
    prompts = jax.ShapeDtypeStruct((rows, width), jnp.int32, sharding=placed)
    lengths = jax.ShapeDtypeStruct((rows,), jnp.int32, sharding=placed)
    program = jax.jit(sampler(setup.graphdef, cfg), in_shardings=(shardings.params, placed, placed, None),
                      out_shardings=placed)
    key = jax.eval_shape(lambda: jax.random.key(0))
    compiled = program.lower(abstract_with_shardings(setup.abstract_state, shardings).params, prompts, lengths,
                             key).compile()
    memory = compiled.memory_analysis()
    return compiled.as_text(), int(memory.temp_size_in_bytes + memory.output_size_in_bytes)


def device_bytes(tree: Any) -> int:
    """Bytes one device holds of the abstract arrays ``tree`` (each split as its sharding says): a step's inputs,
    which its donated outputs alias."""
    return sum(math.prod(a.sharding.shard_shape(a.shape)) * a.dtype.itemsize for a in jax.tree.leaves(tree))


def dry_run(cfg: Config, devices: list | None = None, implementation: str | None = None) -> DryRun:
    """Compiles ``cfg``'s train step on its mesh over ``devices`` (default: all) without allocating it, with the
    attention ``implementation`` (default: what the config's resolves to on the CPU; 'cudnn' as 'auto')."""
    devices = list(devices if devices is not None else jax.devices())
    if implementation is None:
        sizes = check_devices(cfg, len(devices))
        implementation = cpu_implementation(cfg.execution.attention, jnp.dtype(cfg.execution.dtype),
                                            cfg.model.qk_head_dim, shard_count(sizes, "activation_length"))
    return _compile(cfg, devices, implementation)[0]


def _compile(cfg: Config, devices: list, implementation: str, gpu: str | None = None) -> tuple[DryRun, str]:
    """(the dry run, the optimized HLO text) of ``cfg``'s train step over ``devices`` (compile-only ``gpu``s, or
    the devices jax has); execution.remat='auto' is resolved for those GPUs or devices."""
    sizes = check_devices(cfg, len(devices))
    cfg = choose_remat(cfg, sizes, GPUS[gpu])[0] if gpu else resolve_for_devices(cfg, sizes, devices)
    mesh = make_mesh(sizes, devices)
    with jax.set_mesh(mesh):
        setup = state_lib.setup(cfg, implementation, sizes)
        shardings = state_lib.state_shardings(mesh, setup.abstract_state, setup.distributed_optimizer)
        state = abstract_with_shardings(setup.abstract_state, shardings)
        votes = jax.ShapeDtypeStruct((mesh.size,), jnp.int32, sharding=per_device_sharding(mesh))
        batch = abstract_batch(cfg, mesh)
        one_step = rollout_step if cfg.train.objective == "grpo" else train_step
        step = jax.jit(lambda s, b, v: one_step(setup, s, b, v),
                       in_shardings=(shardings, batch_sharding(mesh), votes.sharding),
                       out_shardings=(shardings, None), donate_argnums=0)
        start = time.perf_counter()
        costs = None
        if setup.budget_schedule:
            costs = gpu_schedule.for_gpu(gpu) if gpu else gpu_schedule.for_devices(devices)
        options = dict(setup.compiler_options)
        if gpu:  # the memory a GPU run gives XLA's scheduler and rematerialization, not a deviceless compile's
            from jaxtron.gpu import target
            options.update(target.memory_limit_options(gpu, device_bytes((state, batch, votes))))
        compiled = gpu_schedule.compile_scheduled(step.lower(state, batch, votes), options, costs)
        compile_s = time.perf_counter() - start
        generation, generation_bytes = _sampler(cfg, setup, shardings, mesh)
    memory, text = compiled.memory_analysis(), compiled.as_text()
    result = DryRun(mesh=dict(mesh.shape), compile_s=compile_s,
                    argument_bytes=int(memory.argument_size_in_bytes), output_bytes=int(memory.output_size_in_bytes),
                    alias_bytes=int(memory.alias_size_in_bytes), temp_bytes=int(memory.temp_size_in_bytes),
                    collectives=collectives(text), flops=sum(matmul_flops(text).values()),
                    generation_text=generation, generation_bytes=generation_bytes)
    return result, text


def dry_run_on_target(cfg: Config, gpu: str, count: int) -> tuple[DryRun, str]:
    """Compiles ``cfg``'s train step for ``count`` compile-only GPUs of the target ``gpu`` ('h100', 'h200'), with
    the attention a GPU run of it picks; -> (the dry run, the optimized HLO text). The process must have started
    jax as ``jaxtron.gpu.target.environment`` says."""
    from jaxtron.gpu import target
    from jaxtron.ops import cudnn, grouped
    from jaxtron.ops.attention import resolve_implementation

    devices = target.devices(gpu, count)
    sizes = check_devices(cfg, count)
    implementation = resolve_implementation(cfg.execution.attention, jnp.dtype(cfg.execution.dtype),
                                            cfg.model.qk_head_dim, shard_count(sizes, "activation_length"),
                                            backend="gpu", capability=target.target(gpu).compute_capability)
    with cudnn.compute_capability(*target.target(gpu).compute_capability), grouped.on_target(devices[0]):
        result, text = _compile(cfg, devices, implementation, gpu)
    return result, text


def on_target_in_subprocess(cfg: Config, gpu: str, count: int, hlo_path: str | None = None,
                            timeout_s: float = 1800) -> dict[str, Any]:
    """``dry_run_on_target`` in a process of its own (jax started as the target needs; an XLA abort ends that
    process, not this one): the dry run's fields, ``peak_bytes``, ``kernels`` (name -> calls), ``float8_gemms``
    ``budget`` (the step's time budget at the target's measured ceilings, ``jaxtron.metrics.budget``) and
    ``overlap`` (which collectives run beside kernels, ``jaxtron.metrics.overlap``). The
    optimized HLO text goes to ``hlo_path`` when given. A failed compile is a ConfigError naming its last line."""
    import json
    import subprocess
    import sys
    import tempfile

    from jaxtron.gpu import preset, target

    target.require_plugin(gpu)
    with tempfile.TemporaryDirectory() as folder:
        config_path = os.path.join(folder, "config.json")
        with open(config_path, "w") as f:
            json.dump(cfg.to_dict(), f)
        worker = "import sys; from jaxtron.planning.dry_run import target_main; sys.exit(target_main(sys.argv[1:]))"
        args = [sys.executable, "-c", worker, config_path, gpu, str(count), hlo_path or ""]
        out = subprocess.run(args, env=target.environment(preset_flags=preset.xla_flags()), capture_output=True,
                             text=True, timeout=timeout_s, check=False)
    if out.returncode == 2:  # bad input, said in one sentence there
        raise ConfigError(out.stderr.strip().splitlines()[-1].removeprefix("error: "))
    if out.returncode != 0:
        errors = [line for line in out.stderr.splitlines() if re.match(r"[\w.]*(Error|Exception)\b", line)]
        last = (errors or out.stderr.strip().splitlines() or ["no output"])[-1]
        raise ConfigError(f"the compile for the {gpu} target failed (exit {out.returncode}: {last[:300]}); the "
                          "program does not build for that GPU as configured.")
    return json.loads(out.stdout.strip().splitlines()[-1])


def target_main(argv: list[str]) -> int:
    """CONFIG_JSON GPU COUNT [HLO_FILE]: ``dry_run_on_target``'s result as one JSON line (bad input: its sentence on
    stderr, exit 2)."""
    import json
    import sys

    from jaxtron.config.loader import from_mapping
    from jaxtron.metrics import overlap
    from jaxtron.metrics.budget import CEILINGS, budget
    from jaxtron.metrics.kernels import float8_operands, kernels
    from jaxtron.planning.gpus import GPUS

    config_path, gpu, count, hlo_path = (argv + [""])[:4]
    with open(config_path) as f:
        cfg = from_mapping(json.load(f))
    try:
        result, text = dry_run_on_target(cfg, gpu, int(count))
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if hlo_path:
        write_atomic(hlo_path, text)
    fields = dataclasses.asdict(result)
    generation = fields.pop("generation_text")
    fields["generation_budget"] = budget(generation, CEILINGS[gpu]).summary() if generation else None
    print(json.dumps({**fields, "peak_bytes": result.peak_bytes, "kernels": kernels(text),
                      "float8_gemms": float8_operands(text), "budget": budget(text, CEILINGS[gpu]).summary(),
                      "overlap": overlap.report(text, CEILINGS[gpu], {"NVLink": GPUS[gpu].nvlink_bandwidth,
                                                                      "the network": GPUS[gpu].network_bandwidth})}))
    return 0


def dry_run_text(result: DryRun) -> str:
    gib = 2.0 ** 30
    lines = [f"mesh {', '.join(f'{k}={v}' for k, v in result.mesh.items())}: compiled in {result.compile_s:.1f} s",
             (f"per device: arguments {result.argument_bytes / gib:.2f} GiB (parameters, optimizer state, batch), "
              f"temporaries {result.temp_bytes / gib:.2f} GiB, outputs {result.output_bytes / gib:.2f} GiB "
              f"({result.alias_bytes / gib:.2f} GiB in place of donated inputs); peak {result.peak_bytes / gib:.2f} "
              "GiB"),
             "collectives per step and device (loop bodies counted once per iteration):"]
    if result.generation_bytes:  # GRPO's sampler: its own program, run while the rest of the state is resident
        lines.insert(2, f"generation: the sampler allocates {result.generation_bytes / gib:.2f} GiB beside the "
                        "parameters it reads (cast weights, KV cache, working space)")
    for kind, c in result.collectives.items():
        if c["count"]:
            lines.append(f"  {kind:<20} {c['count']:>4}  {c['bytes'] / 2**20:10.1f} MiB")
    return "\n".join(lines)

