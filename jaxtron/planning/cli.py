"""Choose the mesh before spending GPU hours.

    jaxtron plan --config=configs/llama3_70b.py --gpus=64 --gpu=h100
    jaxtron plan --config=configs/llama3_70b.py --gpus=32 --gpu=h200 --gpus-per-node=4
    jaxtron plan --config=llama3_8b --gpus=8 --gpu=h100 --compile=best [--hlo=step.hlo]

The first form enumerates every valid mesh of the GPU count (divisibility; tensor and expert groups inside a
node; memory fit, raising the microbatch count where that makes a mesh fit), estimates per-device memory and
step time with the analytic model of ``jaxtron.planning.estimate`` and prints them ranked, naming the term
that dominates each row, and the ``--config.*`` options that run each row. ``--compile=best`` (or a row's rank)
also compiles that row's real train step, its schedule, microbatches, optimizer and remat as estimated, and
``--compile=MESH`` the config as it is on that mesh (abstract inputs: nothing is allocated), and prints XLA's
memory analysis, the kernels and the collectives of the compiled program next to the estimate for the same program:
for compile-only devices of the ``--gpu`` when jax's CUDA plugin is installed (``jaxtron.gpu.target``), else on fake
CPU devices (XLA:CPU's program), and it says which. Sequence length and
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
    flags.DEFINE_string("gpu", "h100", "GPU type from jaxtron/planning/gpus.py (h100, h200, b200, gb200)",
                        flag_values=values)
    flags.DEFINE_integer("gpus-per-node", None, "GPUs in a node, joined by NVLink (default 8; 4 on many H200 "
                         "clusters): tensor groups stay inside one, and what crosses nodes goes at the network's "
                         "rate", flag_values=values)
    flags.DEFINE_integer("seq_len", None, "override data.seq_len", flag_values=values)
    flags.DEFINE_integer("global_batch_size", None, "override train.global_batch_size", flag_values=values)
    flags.DEFINE_integer("top", 10, "rows of the ranked table to print (0: all)", flag_values=values)
    flags.DEFINE_string("compile", None, "also compile a row's train step exactly as estimated ('best' or its rank: "
                        "1, 2, ...), or the config as it is on a mesh, e.g. fsdp=8,tensor=8 (other axes 1)",
                        flag_values=values)
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
    return "\n".join(lines + _legend([r.estimate for r in shown], remat))


# what each word after a mesh means, as the legend under the table says it
_WORDS = {"dopt": "the distributed optimizer (its state split over the data axes)",
          "gather-once": "a stage's weights gathered over fsdp once a step",
          "identity": "identity layers filling an uneven pipeline split",
          "1f1b": "the 1F1B pipeline schedule", "interleaved": "the interleaved 1F1B schedule"}


def _legend(estimates, remat: bool) -> list[str]:
    """Lines that explain the words the mesh column uses, those shown only."""
    used = {word for e in estimates for word in _layout_text(e).split()[1:]}
    lines = [f"  {word}: {text}" for word, text in _WORDS.items() if word in used]
    if remat:
        policies = sorted({e.remat for e in estimates})
        lines.insert(0, f"  {', '.join(policies)}: the rematerialisation policy (execution.remat) the row assumes")
    return ["", "mesh column:", *lines] if lines else []


def memory_text(e, usable: float) -> str:
    parts = ", ".join(f"{k} {v / GIB:.1f}" for k, v in e.memory.items())
    return f"{e.memory_bytes / GIB:.1f} GiB of {usable / GIB:.0f} usable ({parts})"


def _gpu(args):
    """The GPU the command line names, with its --gpus-per-node; refuses a GPU count that is no whole node."""
    from jaxtron.config.schema import ConfigError
    from jaxtron.planning.gpus import gpu as gpu_named

    if args.gpus < 1:
        raise ConfigError(f"--gpus is {args.gpus}; give a positive GPU count.")
    gpu = gpu_named(args.gpu)
    per_node = getattr(args, "gpus-per-node")
    if per_node is not None:
        if per_node < 1:
            raise ConfigError(f"--gpus-per-node is {per_node}; give the positive number of GPUs in a node.")
        gpu = dataclasses.replace(gpu, gpus_per_node=per_node)
    if args.gpus > gpu.gpus_per_node and args.gpus % gpu.gpus_per_node:
        raise ConfigError(f"--gpus={args.gpus} is not a whole number of {gpu.gpus_per_node}-GPU nodes; use a multiple "
                          f"of {gpu.gpus_per_node}.")
    return gpu


def parse_compile(text: str | None) -> str | int | dict[str, int] | None:
    """--compile's value: 'best', a row's rank (1 is the best), or a mesh 'AXIS=SIZE,...'."""
    if text is None:
        return None
    text = text.strip().lower()
    if text == "best":
        return text
    if text.isdigit():
        from jaxtron.config.schema import ConfigError
        if int(text) < 1:
            raise ConfigError(f"--compile={text} names no row; the ranks start at 1 (or write --compile=best).")
        return int(text)
    return parse_mesh(text)


def chosen_row(rows, choice: str | int | dict[str, int]):
    """The row --compile names: the best one that fits or the one of that rank; None for a mesh (the config as it
    is, on that mesh)."""
    from jaxtron.config.schema import ConfigError

    if choice == "best":
        fitting = [r for r in rows if r.fits]
        if not fitting:
            raise ConfigError("--compile=best: no row fits; name a row by its rank (--compile=1) or a mesh.")
        return fitting[0]
    if isinstance(choice, int):
        if choice > len(rows):
            raise ConfigError(f"--compile={choice}: the plan has {len(rows)} row(s); name one of 1..{len(rows)}.")
        return rows[choice - 1]
    return None


def _header(cfg, args, gpu) -> str:
    from jaxtron.metrics.flops import param_count

    m = cfg.model
    return (f"{m.name}: {param_count(m) / 1e9:.2f}B parameters"
            + (f" ({param_count(m, active=True) / 1e9:.2f}B active)" if m.moe.num_experts else "")
            + f", sequence {cfg.data.seq_len}, global batch {cfg.train.global_batch_size}, "
              f"remat {cfg.execution.remat}, {cfg.execution.dtype}"
            + (" with FP8 projections" if cfg.execution.fp8 else "") + f"; {args.gpus} x {gpu.name} "
              f"({gpu.usable_bytes / GIB:.0f} GiB usable each)")


def overrides_text(cfg, rows, top: int) -> str:
    """Each shown row's --config options: what `jaxtron train` (and --compile) add to the config to run it."""
    from jaxtron.config.loader import overrides

    shown = rows[:top] if top else rows
    lines = ["the overrides that run each row (jaxtron train --config=... <these>; --compile=RANK compiles it):"]
    lines += [f"{i:>3}: {' '.join(overrides(cfg, r.estimate.config)) or '(the config as it is)'}"
              for i, r in enumerate(shown, 1)]
    return "\n".join(lines)


def _row_json(cfg, r) -> dict:
    from jaxtron.config.loader import overrides

    e = r.estimate
    return dict(mesh=e.mesh, fits=r.fits, microbatches=e.microbatches, schedule=e.schedule,
                pipeline_microbatches=e.pipeline_microbatches, distributed_optimizer=e.distributed_optimizer,
                gather_once=e.gather_once, memory=e.memory, time=e.time, step_s=e.step_s, mfu=e.mfu,
                dominant=e.dominant, overrides=overrides(cfg, e.config))


def run(argv: list[str]) -> int:
    cfg, args, spec = parse_args(argv)
    gpu = _gpu(args)
    choice = parse_compile(args.compile)
    if choice is not None:
        # the dry run needs one fake CPU device per GPU, which must be set before jax starts
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                                   f" --xla_force_host_platform_device_count={args.gpus}").strip()
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    from jaxtron.metrics.flops import fp8_flop_share
    from jaxtron.planning import search

    print(_header(cfg, args, gpu))
    rows = search.plan(cfg, args.gpus, gpu)
    fitting = [r for r in rows if r.fits]
    report = {"config": spec, "gpus": args.gpus, "gpu": gpu.name, "rows": [_row_json(cfg, r) for r in rows]}
    if rows:
        print(f"{len(rows)} valid meshes, {len(fitting)} fit; ranked by estimated step time:")
        print(table(rows, args.top, cfg.execution.remat == "auto"))
        if cfg.execution.fp8:
            share = fp8_flop_share(cfg.model, cfg.execution, cfg.data.seq_len)
            print(f"FP8 projections' GEMMs at {gpu.fp8_speedup:g} times the 16-bit rate (fitted on jaxtron's own "
                  f"steps); MFU against the FLOP-weighted dense peak, FP8 matmuls {100 * share:.1f}% of the model "
                  "FLOPs, as a run reports it")
        print(overrides_text(cfg, rows, args.top))
    status = 0
    if not fitting:
        print(f"error: cannot train {cfg.model.name} on {args.gpus} x {gpu.name}: "
              f"{search.refusal(cfg, args.gpus, gpu, rows)}", file=sys.stderr)
        status = 2
    else:
        best = fitting[0].estimate
        print(f"\nbest: {_layout_text(best, True)}, {best.microbatches} microbatch(es), attention {best.attention}: "
              f"{memory_text(best, gpu.usable_bytes)}")
    if choice is not None:
        row = chosen_row(rows, choice)
        if row is None:
            _same_mesh_note(cfg, rows, choice)
        report["dry_run"] = compile_report(cfg, row, choice, args.gpus, args.gpu.strip().lower(), gpu, args.hlo,
                                           rank=rows.index(row) + 1 if row is not None else None)
    if args.json:
        write_json(args.json, report)
    return status


def _same_mesh_note(cfg, rows, sizes: dict[str, int]) -> None:
    """Says, for --compile=MESH, that the config is compiled as it is, and which row the plan has for that mesh."""
    from jaxtron.config.loader import overrides

    for rank, r in enumerate(rows, 1):
        if {a: r.estimate.mesh.get(a, 1) for a in sizes} == sizes:
            changes = overrides(cfg, r.estimate.config)
            print(f"\n--compile={','.join(f'{a}={v}' for a, v in sizes.items() if v > 1) or 'one device'} compiles the "
                  f"config as it is on that mesh; the plan's row {rank} for it runs "
                  f"{' '.join(changes) or 'the config as it is'} (--compile={rank} compiles that)")
            return


def compile_report(cfg, row, choice, n: int, gpu_name: str, gpu, hlo_path: str | None, rank: int | None) -> dict:
    """Compiles the step of ``row`` (its config: mesh, schedule, microbatches, optimizer and remat as estimated;
    without a row, ``cfg`` on the mesh ``choice``) and prints the compiler's numbers beside the estimate of the
    same program: for ``gpu_name``'s compile-only devices when jax's CUDA plugin is installed (the attention a GPU
    run picks), else on fake CPU devices (XLA:CPU's program: XLA attention, blockwise when the sequence is
    sharded)."""
    import math

    from jaxtron.config.schema import ConfigError
    from jaxtron.gpu import target
    from jaxtron.planning.estimate import choose_remat, estimate
    from jaxtron.planning.search import with_mesh

    if row is not None:
        cfg, sizes = row.estimate.config, row.estimate.mesh
    else:
        sizes = choice
        if math.prod(sizes.values()) != n:
            raise ConfigError(f"--compile mesh {_mesh_text(sizes)} has {math.prod(sizes.values())} devices but --gpus "
                              f"is {n}; make the sizes multiply to {n}.")
        cfg = choose_remat(with_mesh(cfg, sizes), sizes, gpu)[0]  # remat 'auto' resolved as a run would
    on_target = gpu_name in target.TARGETS and target.plugin_installed()
    what = f"row {rank} ({_layout_text(row.estimate, True)})" if row is not None else _mesh_text(sizes)
    result, found = _compiled(cfg, sizes, n, gpu_name, gpu, hlo_path, on_target, what)
    est = estimate(cfg, sizes, gpu, cpu_program=not on_target)
    return _compared(cfg, sizes, n, gpu_name if on_target else "cpu", est, result, found,
                     row.estimate if row is not None else None, rank)


def _compiled(cfg, sizes, n: int, gpu_name: str, gpu, hlo_path: str | None, on_target: bool, what: str):
    """(the dry run, what the target's compile found besides: kernels, float8 GEMMs, the time budget)."""
    from jaxtron.gpu import target
    from jaxtron.metrics.kernels import describe
    from jaxtron.planning.dry_run import DryRun, dry_run, dry_run_text, on_target_in_subprocess

    found = {"kernels": None, "float8_gemms": None, "budget": None, "overlap": None}
    if on_target:
        print(f"\ndry run of {what} compiled for {n} x {gpu.name} (compile-only devices, no GPU):")
        found = on_target_in_subprocess(cfg, gpu_name, n, hlo_path)
        result = DryRun(**{f.name: found[f.name] for f in dataclasses.fields(DryRun) if f.name in found})
    else:
        from jaxtron.ops.attention import cpu_implementation
        attention = cpu_implementation(cfg.execution.attention, cfg.execution.dtype, cfg.model.qk_head_dim,
                                       sizes.get("sequence", 1))
        why = (f"jax's CUDA plugin is not installed; {target.INSTALL} compiles for the {gpu_name}"
               if gpu_name in target.TARGETS else f"no compile-only target for {gpu_name}")
        print(f"\ndry run of {what} on {n} fake CPU devices ({attention} attention; {why}):")
        result = dry_run(cfg)
    print(dry_run_text(result))
    if found["kernels"] is not None:
        print(f"kernels (a loop body's once): {describe(found['kernels'])}")
        if cfg.execution.fp8:
            print(f"GEMMs with float8 operands: {found['float8_gemms']}")
        from jaxtron.metrics.budget import text as budget_text
        from jaxtron.metrics.overlap import text as overlap_text
        from jaxtron.planning.step_time import exchanges_hidden
        print(budget_text(found["budget"]))
        if found.get("generation_budget"):  # GRPO: the sampler that makes each step's batch, its own program
            print("generation (the sampler's program, beside the step above):\n" +
                  budget_text(found["generation_budget"]))
        print(overlap_text(found["overlap"], exchanges_hidden(cfg.execution)))
    return result, found


def _compared(cfg, sizes, n: int, target_name: str, est, result, found, row_estimate, rank) -> dict:
    """Prints the estimate of the compiled program beside the compiler's numbers; returns both for --json."""
    from jaxtron.metrics.flops import hardware_flops_per_token

    state = est.memory["parameters"] + est.memory["optimizer"] + est.memory["batch"]
    unseen = est.unseen_on_target_bytes if target_name != "cpu" else 0.0
    unseen += est.memory.get("generation", 0.0)  # GRPO's sampler: its own program, compared below
    error = (est.memory_bytes - unseen) / result.peak_bytes - 1
    if row_estimate is not None:
        print(f"row {rank} as the table estimated it: {row_estimate.memory_bytes / GIB:.2f} GiB a device "
              f"({row_estimate.unseen_on_target_bytes / GIB:.2f} GiB of it cuDNN's workspace), "
              f"{row_estimate.step_s:.3g} s a step; compiled peak {result.peak_bytes / GIB:.2f} GiB")
    print(f"estimate of the same program: peak {(est.memory_bytes - unseen) / GIB:.2f} GiB ({100 * error:+.1f}% of "
          f"the compiled peak), of which arguments {state / GIB:.2f} GiB, temporaries "
          f"{(est.memory_bytes - state - unseen) / GIB:.2f} GiB"
          + (f"; besides, cuDNN's workspace, which a compile without the GPU cannot see: {unseen / GIB:.2f} GiB"
             if unseen else ""))
    if result.generation_bytes:
        off = est.sampler_bytes / result.generation_bytes - 1
        print(f"generation: the sampler's allocation estimated at {est.sampler_bytes / GIB:.2f} GiB against the "
              f"compiled {result.generation_bytes / GIB:.2f} GiB ({100 * off:+.1f}%); it adds "
              f"{est.memory.get('generation', 0.0) / GIB:.2f} GiB to the step's peak")
    print("estimated collective bytes per step and device: " +
          ", ".join(f"{k} {v / 2**20:.0f} MiB" for k, v in est.collectives.items() if v))
    tokens = cfg.train.global_batch_size * cfg.data.seq_len
    model_flops = hardware_flops_per_token(cfg.model, cfg.execution, cfg.data.seq_len) * tokens / n
    print(f"matmul FLOPs per device and step: compiled {result.flops / 1e12:.4g} T (dots, GEMMs and attention "
          f"kernels counted from their shapes), model {model_flops / 1e12:.4g} T (recompute included): "
          f"{result.flops / model_flops:.3f}x")
    return dict(mesh=sizes, row=rank, compiled_peak=result.peak_bytes, compiled_arguments=result.argument_bytes,
                compiled_temp=result.temp_bytes, estimated_peak=est.memory_bytes - unseen, estimated_unseen=unseen,
                compile_s=result.compile_s, collectives=result.collectives, estimated_collectives=est.collectives,
                target=target_name, kernels=found["kernels"], flops=result.flops, model_flops=model_flops,
                budget=found["budget"], generation_bytes=result.generation_bytes,
                estimated_generation_bytes=est.sampler_bytes,
                row_estimated_peak=row_estimate.memory_bytes if row_estimate is not None else None)


def main(argv: list[str]) -> int:
    """`jaxtron plan`: prints the ranked meshes (and the dry run) the command line ``argv`` asks for."""
    from jaxtron.config.loader import HelpRequested

    try:
        return run(argv)
    except HelpRequested as e:
        print(f"usage: jaxtron plan --config=configs/X.py --gpus=N [--gpu=NAME] "
              f"[--config.<section>.<field>=VALUE ...]\n\n{e}")
        return 0

