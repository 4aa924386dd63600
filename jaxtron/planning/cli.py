"""Choose the mesh before spending GPU hours.

    jaxtron plan --config=configs/llama3_70b.py --gpus=64 --gpu=h100
    jaxtron plan --config=configs/llama3_70b.py --gpus=32 --gpu=h200 --gpus-per-node=4
    jaxtron plan --config=configs/llama3_8b.py --gpus=8 --gpu=h100 --compile=fsdp=8 [--hlo=step.hlo]

The first form enumerates every valid mesh of the GPU count (divisibility; tensor and expert groups inside a
node; memory fit, raising the microbatch count where that makes a mesh fit), estimates per-device memory and
step time with the analytic model of ``jaxtron.planning.estimate`` and prints them ranked, naming the term
that dominates each row. ``--compile=MESH`` also compiles the real train step for that mesh (abstract inputs:
nothing is allocated) and prints XLA's memory analysis, the kernels and the collectives of the compiled program next
to the estimate for the same program: for compile-only devices of the ``--gpu`` when jax's CUDA plugin is installed
(``jaxtron.gpu.target``), else on fake CPU devices (XLA:CPU's program), and it says which. Sequence length and
global batch come from the config; ``--seq_len``, ``--global_batch_size`` or any
``--config.<section>.<field>=<value>`` override them.
"""

from __future__ import annotations

import dataclasses
import os
import sys

from jaxtron.common.files import write_json

GIB = 2.0**30


def parse_mesh(text: str) -> dict[str, int]:
    """'fsdp=8,tensor=8' -> sizes of all six mesh axes (the ones not named are 1)."""
    from jaxtron.config.schema import MESH_AXES, ConfigError

    sizes = dict.fromkeys(MESH_AXES, 1)
    for part in filter(None, (p.strip() for p in text.split(","))):
        axis, _, value = part.partition("=")
        if axis not in sizes or not value.isdigit() or int(value) < 1:
            raise ConfigError(f"--compile part {part!r} is not AXIS=SIZE with AXIS one of {', '.join(MESH_AXES)} "
                              "and a positive size; write e.g. --compile=fsdp=8,tensor=8.")
        sizes[axis] = int(value)
    return sizes


def _define(values) -> None:
    from absl import flags
    flags.DEFINE_integer("gpus", None, "number of GPUs (whole nodes beyond one node)", flag_values=values)
    flags.DEFINE_string("gpu", "h100", "GPU type from jaxtron/planning/gpus.py (h100, h200)", flag_values=values)
    flags.DEFINE_integer("gpus-per-node", None, "GPUs in a node, joined by NVLink (default 8; 4 on many H200 "
                         "clusters): tensor groups stay inside one, and what crosses nodes goes at the network's "
                         "rate", flag_values=values)
    flags.DEFINE_integer("seq_len", None, "override data.seq_len", flag_values=values)
    flags.DEFINE_integer("global_batch_size", None, "override train.global_batch_size", flag_values=values)
    flags.DEFINE_integer("top", 10, "rows of the ranked table to print (0: all)", flag_values=values)
    flags.DEFINE_string("compile", None, "also compile the train step for this mesh, e.g. fsdp=8,tensor=8 (other "
                        "axes 1)", flag_values=values)
    flags.DEFINE_string("json", None, "write the ranked estimates (and the dry run) to this file", flag_values=values)
    flags.DEFINE_string("hlo", None, "with --compile for a GPU target: write the optimized HLO text to this file",
                        flag_values=values)


def parse_args(argv: list[str]):
    """(Config, parsed flags, config file) of the command line ``argv`` (without the program name)."""
    import dataclasses

    from jaxtron.config.loader import parse_command_line
    from jaxtron.config.schema import ConfigError

    cfg, args, spec = parse_command_line(["jaxtron plan", *argv], "configs/default.py", _define)
    if args.gpus is None:
        raise ConfigError("option '--gpus' is missing; give the GPU count, e.g. --gpus=8.")
    if args.seq_len is not None:
        cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, seq_len=args.seq_len))
    if args.global_batch_size is not None:
        cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, global_batch_size=args.global_batch_size))
    return cfg, args, spec


def _mesh_text(sizes: dict[str, int]) -> str:
    from jaxtron.planning.search import mesh_text
    return mesh_text(sizes)


def _layout_text(e, remat: bool = False) -> str:
    """The mesh, with ``remat`` the rematerialisation policy, the identity layers that fill an uneven pipeline
    split (pipeline.uneven_stages=True), the 1F1B schedule ('1f1b' or 'interleaved') where that is the pipeline's,
    'gather-once' for a stage's weights gathered over fsdp once a step, and 'dopt' for the distributed
    optimizer."""
    return (_mesh_text(e.mesh) + (f" {e.remat}" if remat else "")
            + (f" +{e.identity_layers} identity" if e.identity_layers else "")
            + (f" {e.schedule}" if e.schedule != "fill_drain" else "") + (" gather-once" if e.gather_once else "")
            + (" dopt" if e.distributed_optimizer else ""))


def table(rows, top: int, remat: bool = False) -> str:
    """The ranked rows, each with its rematerialisation policy when ``remat`` (the config's is 'auto'); the mesh
    column as wide as its longest entry."""
    shown = rows[:top] if top else rows
    width = max([34] + [len(_layout_text(r.estimate, remat)) for r in shown])
    head = (f"{'#':>3}  {'mesh':<{width}} {'micro':>5} {'GiB/GPU':>8} {'step s':>8} {'tok/s':>10} {'MFU':>6}  "
            f"{'dominant':<14} terms (s)")
    lines = [head, "-" * len(head)]
    for i, row in enumerate(shown, 1):
        e = row.estimate
        fit = "" if row.fits else "  DOES NOT FIT"
        ordered = sorted(e.time.items(), key=lambda kv: -kv[1])
        terms = ", ".join(f"{k} {v:.3g}" for k, v in ordered if v > 0.005 * e.step_s)
        lines.append(f"{i:>3}  {_layout_text(e, remat):<{width}} {e.microbatches:>5} {e.memory_bytes / GIB:>8.1f} "
                     f"{e.step_s:>8.3g} {e.tokens_per_s:>10.0f} {100 * e.mfu:>5.1f}%  {e.dominant:<14} {terms}{fit}")
    return "\n".join(lines)


def memory_text(e, usable: float) -> str:
    parts = ", ".join(f"{k} {v / GIB:.1f}" for k, v in e.memory.items())
    return f"{e.memory_bytes / GIB:.1f} GiB of {usable / GIB:.0f} usable ({parts})"


def run(argv: list[str]) -> int:
    cfg, args, spec = parse_args(argv)
    from jaxtron.config.schema import ConfigError

    if args.gpus < 1:
        raise ConfigError(f"--gpus is {args.gpus}; give a positive GPU count.")
    from jaxtron.planning.gpus import gpu as gpu_named

    gpu = gpu_named(args.gpu)
    per_node = getattr(args, "gpus-per-node")
    if per_node is not None:
        if per_node < 1:
            raise ConfigError(f"--gpus-per-node is {per_node}; give the positive number of GPUs in a node.")
        gpu = dataclasses.replace(gpu, gpus_per_node=per_node)
    if args.gpus > gpu.gpus_per_node and args.gpus % gpu.gpus_per_node:
        raise ConfigError(f"--gpus={args.gpus} is not a whole number of {gpu.gpus_per_node}-GPU nodes; use a multiple "
                          f"of {gpu.gpus_per_node}.")
    compile_sizes = parse_mesh(args.compile) if args.compile else None
    if compile_sizes is not None:
        # the dry run needs one fake CPU device per GPU, which must be set before jax starts
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                                   f" --xla_force_host_platform_device_count={args.gpus}").strip()
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    from jaxtron.metrics.flops import fp8_flop_share, param_count
    from jaxtron.planning import search
    from jaxtron.planning.estimate import estimate

    m = cfg.model
    print(f"{m.name}: {param_count(m) / 1e9:.2f}B parameters"
          + (f" ({param_count(m, active=True) / 1e9:.2f}B active)" if m.moe.num_experts else "")
          + f", sequence {cfg.data.seq_len}, global batch {cfg.train.global_batch_size}, "
            f"remat {cfg.execution.remat}, {cfg.execution.dtype}"
          + (" with FP8 projections" if cfg.execution.fp8 else "") + f"; {args.gpus} x {gpu.name} "
            f"({gpu.usable_bytes / GIB:.0f} GiB usable each)")
    rows = search.plan(cfg, args.gpus, gpu)
    fitting = [r for r in rows if r.fits]
    report = {"config": spec, "gpus": args.gpus, "gpu": gpu.name,
              "rows": [dict(mesh=r.estimate.mesh, fits=r.fits, microbatches=r.estimate.microbatches,
                            schedule=r.estimate.schedule, pipeline_microbatches=r.estimate.pipeline_microbatches,
                            distributed_optimizer=r.estimate.distributed_optimizer,
                            gather_once=r.estimate.gather_once,
                            memory=r.estimate.memory, time=r.estimate.time, step_s=r.estimate.step_s,
                            mfu=r.estimate.mfu, dominant=r.estimate.dominant) for r in rows]}
    if rows:
        print(f"{len(rows)} valid meshes, {len(fitting)} fit; ranked by estimated step time:")
        print(table(rows, args.top, cfg.execution.remat == "auto"))
        if cfg.execution.fp8:
            share = fp8_flop_share(m, cfg.execution, cfg.data.seq_len)
            print(f"FP8 projections' GEMMs at {gpu.fp8_speedup:g} times the 16-bit rate (fitted on jaxtron's own "
                  f"steps); MFU against the FLOP-weighted dense peak, FP8 matmuls {100 * share:.1f}% of the model "
                  "FLOPs, as a run reports it")
    status = 0
    if not fitting:
        print(f"error: cannot train {m.name} on {args.gpus} x {gpu.name}: {search.refusal(cfg, args.gpus, gpu, rows)}",
              file=sys.stderr)
        status = 2
    else:
        best = fitting[0].estimate
        print(f"\nbest: {_layout_text(best, True)}, {best.microbatches} microbatch(es), attention {best.attention}: "
              f"{memory_text(best, gpu.usable_bytes)}")
    if compile_sizes is not None:
        report["dry_run"] = compile_report(cfg, compile_sizes, args.gpus, args.gpu.strip().lower(), gpu, estimate,
                                           args.hlo)
    if args.json:
        write_json(args.json, report)
    return status


def compile_report(cfg, sizes: dict[str, int], n: int, gpu_name: str, gpu, estimate, hlo_path: str | None) -> dict:
    """Compiles the step for ``sizes`` and prints the compiler's numbers beside the estimate of the same program:
    for ``gpu_name``'s compile-only devices when jax's CUDA plugin is installed (the attention a GPU run picks),
    else on fake CPU devices (XLA:CPU's program: XLA attention, blockwise when the sequence is sharded)."""
    import dataclasses
    import math

    from jaxtron.config.schema import ConfigError
    from jaxtron.gpu import target
    from jaxtron.metrics.flops import hardware_flops_per_token
    from jaxtron.metrics.kernels import describe
    from jaxtron.planning.dry_run import DryRun, dry_run, dry_run_text, on_target_in_subprocess

    if math.prod(sizes.values()) != n:
        raise ConfigError(f"--compile mesh {_mesh_text(sizes)} has {math.prod(sizes.values())} devices but --gpus is "
                          f"{n}; make the sizes multiply to {n}.")
    from jaxtron.planning.estimate import choose_remat
    from jaxtron.planning.search import with_mesh
    cfg = choose_remat(with_mesh(cfg, sizes), sizes, gpu)[0]  # as the table estimated it, remat 'auto' resolved
    on_target = gpu_name in target.TARGETS and target.plugin_installed()
    kernels, float8_gemms, time_budget = None, None, None
    if on_target:
        print(f"\ndry run of {_mesh_text(sizes)} compiled for {n} x {gpu.name} (compile-only devices, no GPU):")
        found = on_target_in_subprocess(cfg, gpu_name, n, hlo_path)
        kernels, float8_gemms, time_budget = found["kernels"], found["float8_gemms"], found["budget"]
        result = DryRun(**{f.name: found[f.name] for f in dataclasses.fields(DryRun)})
    else:
        from jaxtron.ops.attention import cpu_implementation
        attention = cpu_implementation(cfg.execution.attention, cfg.execution.dtype, cfg.model.qk_head_dim,
                                       sizes.get("sequence", 1))
        why = (f"jax's CUDA plugin is not installed; {target.INSTALL} compiles for the {gpu_name}"
               if gpu_name in target.TARGETS else f"no compile-only target for {gpu_name}")
        print(f"\ndry run of {_mesh_text(sizes)} on {n} fake CPU devices ({attention} attention; {why}):")
        result = dry_run(cfg)
    print(dry_run_text(result))
    if kernels is not None:
        print(f"kernels (a loop body's once): {describe(kernels)}")
        if cfg.execution.fp8:
            print(f"GEMMs with float8 operands: {float8_gemms}")
        from jaxtron.metrics.budget import text as budget_text
        print(budget_text(time_budget))
    est = estimate(cfg, sizes, gpu, cpu_program=not on_target)
    state = est.memory["parameters"] + est.memory["optimizer"] + est.memory["batch"]
    unseen = est.unseen_on_target_bytes if on_target else 0.0
    error = (est.memory_bytes - unseen) / result.peak_bytes - 1
    print(f"estimate of the same program: peak {(est.memory_bytes - unseen) / GIB:.2f} GiB ({100 * error:+.1f}% of "
          f"the compiled peak), of which arguments {state / GIB:.2f} GiB, temporaries "
          f"{(est.memory_bytes - state - unseen) / GIB:.2f} GiB"
          + (f"; besides, cuDNN's workspace, which a compile without the GPU cannot see: {unseen / GIB:.2f} GiB"
             if unseen else ""))
    print("estimated collective bytes per step and device: " +
          ", ".join(f"{k} {v / 2**20:.0f} MiB" for k, v in est.collectives.items() if v))
    tokens = cfg.train.global_batch_size * cfg.data.seq_len
    model_flops = hardware_flops_per_token(cfg.model, cfg.execution, cfg.data.seq_len) * tokens / n
    print(f"matmul FLOPs per device and step: compiled {result.flops / 1e12:.4g} T (dots, GEMMs and attention "
          f"kernels counted from their shapes), model {model_flops / 1e12:.4g} T (recompute included): "
          f"{result.flops / model_flops:.3f}x")
    return dict(mesh=sizes, compiled_peak=result.peak_bytes, compiled_arguments=result.argument_bytes,
                compiled_temp=result.temp_bytes, estimated_peak=est.memory_bytes - unseen, estimated_unseen=unseen,
                compile_s=result.compile_s,
                collectives=result.collectives, estimated_collectives=est.collectives,
                target=gpu_name if on_target else "cpu", kernels=kernels, flops=result.flops,
                model_flops=model_flops, budget=time_budget)


def main(argv: list[str]) -> int:
    """`jaxtron plan`: prints the ranked meshes (and the dry run) the command line ``argv`` asks for."""
    from jaxtron.config.loader import HelpRequested

    try:
        return run(argv)
    except HelpRequested as e:
        print(f"usage: jaxtron plan --config=configs/X.py --gpus=N [--gpu=NAME] "
              f"[--config.<section>.<field>=VALUE ...]\n\n{e}")
        return 0

