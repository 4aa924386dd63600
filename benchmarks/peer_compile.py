"""Peer compile: MaxText's own train step beside jaxtron's, both compiled by the same jax and XLA for the same
compile-only GPUs (``jaxtron/gpu/target.py``), both priced by the step budget (``jaxtron/metrics/budget.py``).

    python benchmarks/peer_compile.py [--cases 8b,70b,mixtral] [--hlo-dir DIR] [--out benchmarks/peer_compile]

MaxText 0.2.5 needs Python 3.12 and jax 0.11.1 or later. On first use the script makes a virtual environment of
``--python`` (default: pyenv's 3.12, else python3.12 on the PATH) in ``--venv`` (default
~/.cache/jaxtron/peer312) and installs MaxText (without its declared dependencies, which pull in the whole of
Google Cloud), jax 0.11.2 with its CUDA 12 plugin and what MaxText's and jaxtron's train paths import. Both stacks
then compile in that environment: jaxtron from this checkout (``jaxtron plan --compile``), MaxText by its own
functions (``maxtext.trainers.pre_train.train_compile``: the shaped train state, ``train_step`` with its
shardings, jit and compile), on a mesh of the target's devices instead of MaxText's mock GPUs.

MaxText runs with its GPU recipe for each model (``maxtext/configs/gpu/models/*.yml``: its remat policy), its
attention changed from ``cudnn_flash_te`` (Transformer Engine, not installable here) to ``cudnn_flash_jax`` (the
same cuDNN kernel through JAX) with ``packing=False shardy=False`` as MaxText's own test of that kernel sets them,
and its XLA flags for one A3 VM (8 x H100; ``peer_maxtext.MAXTEXT_XLA_FLAGS``). jaxtron runs as its shipped config
does. Modules MaxText imports but never calls on this path get stand-ins (``peer_maxtext.STUBS``).

Output: a markdown table (budget ms by category, peak GiB, compiled FLOPs over model FLOPs, MFU bound) in
``--out``.md and .json; with ``--hlo-dir``, each optimized program as ``DIR/<case>.jaxtron.hlo`` and
``DIR/<case>.maxtext.hlo``. Exit 0 when every case compiled, 1 otherwise (the table says which did not), 2 for bad
arguments.
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import peer_maxtext
from step_budget import model_flops_and_peak

from jaxtron.gpu import target
from jaxtron.metrics import budget

VENV = os.path.expanduser("~/.cache/jaxtron/peer312")
# what MaxText's train_compile path and jaxtron's plan import, pinned where MaxText 0.2.5 needs a version
# every package pinned: a venv resolved anew on 2026-12-07 moved MaxText's 8B budget from 489.7 ms (2026-12-06's
# resolution, versions not recorded) to 538.1 with jax and MaxText the same
PACKAGES = ("jax[cuda12]==0.11.2", "flax==0.12.12", "optax==0.2.8", "orbax-checkpoint==0.12.8", "chex==0.1.92",
            "tensorstore==0.1.86", "pyyaml==6.0.4", "protobuf==7.36.2", "absl-py==2.5.1", "etils==1.15.0",
            "tensorboard==2.21.0", "pillow==13.0.0", "psutil==7.2.2", "tokamax==0.0.17", "qwix==0.1.8",
            "einshape==1.0", "immutabledict==4.3.1", "pydantic==2.14.4", "grain==0.2.18", "ml-collections==1.1.0",
            "aqtp==0.9.0", "omegaconf==2.4.0", "jinja2==3.1.6", "drjax==0.2.1", "pathwaysutils==0.1.13",
            "fastapi==0.165.0", "uvicorn==0.55.0", "requests==2.34.2", "xxhash==4.1.0", "safetensors==0.8.0",
            "tokenizers==0.23.3", "zstandard==0.25.0", "pyarrow==26.0.1")
MAXTEXT = "maxtext==0.2.5"
MAXTEXT_COMMON = {"hardware": "gpu", "skip_jax_distributed_system": True, "override_model_config": True,
                  "dataset_type": "synthetic", "enable_checkpointing": False, "enable_goodput_recording": False,
                  "enable_tensorboard": False, "attention": "cudnn_flash_jax", "packing": False, "shardy": False,
                  "compile_topology_num_slices": 1, "run_name": "peer_compile"}


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    gpu: str
    gpus: int
    maxtext_config: str  # under maxtext/configs/
    maxtext: dict  # MaxText's overrides: the shape and its mesh
    config: str  # jaxtron's shipped config
    overrides: tuple[str, ...]  # the same shape
    mesh: str  # jaxtron's --compile: a mesh, or a rank of its plan (its best mesh)


CASES = {
    "8b": Case("llama3_8b 8/32 layers, 1 H200", "h200", 1, "gpu/models/llama3_8b.yml",
               {"base_num_decoder_layers": 8, "max_target_length": 4096},
               "configs/llama3_8b.py", ("model.num_layers=8", "data.seq_len=4096", "train.global_batch_size=4"),
               "fsdp=1"),
    "70b": Case("llama3_70b 8/80 layers, 8 H100", "h100", 8, "gpu/models/llama3_70b.yml",
                {"base_num_decoder_layers": 8, "max_target_length": 4096, "ici_fsdp_parallelism": 8},
                "configs/llama3_70b.py", ("model.num_layers=8", "data.seq_len=4096", "train.global_batch_size=16"),
                "1"),
    "mixtral": Case("mixtral_8x7b 4/32 layers, 8 H100, experts over 8", "h100", 8, "gpu/models/mixtral_8x7b.yml",
                    {"base_num_decoder_layers": 4, "max_target_length": 4096, "ici_expert_parallelism": 8,
                     "ici_fsdp_parallelism": 1},
                    "configs/mixtral_8x7b.py", ("model.num_layers=4", "data.seq_len=4096",
                                                "train.global_batch_size=16"),
                    "expert=8"),
    # the same with jaxtron in capacity mode at MaxText's recipe's factor (1.0): like for like
    "mixtral_capacity": Case("mixtral_8x7b 4/32 layers, 8 H100, experts over 8, capacity 1.0", "h100", 8,
                             "gpu/models/mixtral_8x7b.yml",
                             {"base_num_decoder_layers": 4, "max_target_length": 4096, "ici_expert_parallelism": 8,
                              "ici_fsdp_parallelism": 1},
                             "configs/mixtral_8x7b.py", ("model.num_layers=4", "data.seq_len=4096",
                                                         "train.global_batch_size=16", "execution.moe_mode=capacity",
                                                         "execution.capacity_factor=1.0"),
                             "expert=8"),
}


ERROR = re.compile(r"\b\w*(Error|Exception|RESOURCE_EXHAUSTED)\b")


def default_python() -> str | None:
    found = sorted(glob.glob(os.path.expanduser("~/.pyenv/versions/3.12*/bin/python")))
    return found[-1] if found else shutil.which("python3.12")


def prepare(venv: str, python: str | None) -> str:
    """The environment's interpreter, made and filled on first use (a marker file says it is complete)."""
    done = os.path.join(venv, ".jaxtron-peer-ready")
    interpreter = os.path.join(venv, "bin", "python")
    if os.path.exists(done):
        return interpreter
    if python is None:
        raise SystemExit("error: no Python 3.12 found for MaxText; pass --python PATH.")
    subprocess.run([python, "-m", "venv", venv], check=True)
    pip = [interpreter, "-m", "pip", "install", "-q"]
    subprocess.run([*pip, "--upgrade", "pip"], check=True)
    subprocess.run([*pip, "--no-deps", MAXTEXT], check=True)
    subprocess.run([*pip, *PACKAGES], check=True)
    peer_maxtext.write_stubs(os.path.join(venv, "stubs"), list(peer_maxtext.STUBS))
    open(done, "w").close()
    return interpreter


def _environment(venv: str, xla_flags: str = "") -> dict[str, str]:
    env = target.environment({**os.environ, "XLA_FLAGS": xla_flags})
    return {**env, "DECOUPLE_GCLOUD": "TRUE", "PYTHONPATH": os.pathsep.join([REPO, os.path.join(venv, "stubs")])}


def compile_maxtext(case: Case, interpreter: str, venv: str, folder: str) -> dict:
    """MaxText's step compiled in the environment: its optimized HLO's path and its memory."""
    spec = os.path.join(folder, "target.txtpb")
    with open(spec, "w") as f:
        f.write(target.spec(case.gpu))
    hlo = os.path.join(folder, "maxtext.hlo")
    # MaxText sizes its batch by the devices of its process, one CPU device here: its per-device batch is the
    # global one, which the mesh then splits over the target's devices
    batch = next(int(o.split("=")[1]) for o in case.overrides if o.startswith("train.global_batch_size="))
    settings = {**MAXTEXT_COMMON, "base_output_directory": os.path.join(folder, "maxtext"),
                "per_device_batch_size": batch, **case.maxtext}
    argv = [interpreter, os.path.abspath(__file__), "--maxtext-child", spec, str(case.gpus), hlo,
            f"src/maxtext/configs/{case.maxtext_config}", *(f"{k}={v}" for k, v in settings.items())]
    memory = _maxtext_compile(argv, venv, peer_maxtext.MAXTEXT_XLA_FLAGS, hlo)
    # the memory limit a GPU run gives XLA, as jaxtron's compile gets it (``target.memory_limit_options``): its
    # inputs and outputs are known once compiled, so it compiles again with it
    limit = target.memory_limit_options(case.gpu, memory["arguments"] + memory["outputs"] - memory["aliased"])
    if limit:
        flags = " ".join([peer_maxtext.MAXTEXT_XLA_FLAGS, *(f"--{k}={v}" for k, v in limit.items())])
        memory = _maxtext_compile(argv, venv, flags, hlo)
    return {"hlo": hlo, "peak": memory["arguments"] + memory["temporaries"] + memory["outputs"] - memory["aliased"]}


def _maxtext_compile(argv: list[str], venv: str, flags: str, hlo: str) -> dict:
    out = subprocess.run(argv, env=_environment(venv, flags), capture_output=True, text=True, timeout=3600,
                         check=False)
    if out.returncode or not os.path.exists(hlo):
        raise RuntimeError(f"MaxText's compile failed: {out.stderr.strip()[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])



def compile_jaxtron(case: Case, interpreter: str, venv: str, folder: str) -> dict:
    """jaxtron's step compiled in the same environment (``jaxtron plan --compile``)."""
    hlo, report = os.path.join(folder, "jaxtron.hlo"), os.path.join(folder, "plan.json")
    argv = [interpreter, "-m", "jaxtron", "plan", f"--config={case.config}", f"--gpus={case.gpus}",
            f"--gpu={case.gpu}", f"--compile={case.mesh}", f"--hlo={hlo}", f"--json={report}",
            *(f"--config.{o}" for o in case.overrides)]
    out = subprocess.run(argv, cwd=REPO, env=_environment(venv), capture_output=True, text=True, timeout=3600,
                         check=False)
    if out.returncode or not os.path.exists(hlo):
        raise RuntimeError(f"jaxtron's compile failed: {out.stderr.strip()[-3000:]}")
    with open(report) as f:
        dry = json.load(f)["dry_run"]
    return {"hlo": hlo, "peak": dry["compiled_peak"], "mesh": dry["mesh"]}


def priced(case: Case, hlo: str, peak: float) -> dict:
    """The budget of one program, its peak, its matmul FLOPs over the model's and the MFU bound (per device)."""
    with open(hlo) as f:
        summary = budget.budget(f.read(), budget.CEILINGS[case.gpu]).summary()
    flops, dense_peak = model_flops_and_peak(case.config, [tuple(o.split("=", 1)) for o in case.overrides],
                                             case.gpu)
    model = flops / case.gpus
    return {"ms": {k: v * 1e3 for k, v in summary["by_category"].items()}, "budget_ms": summary["seconds"] * 1e3,
            "peak_gib": peak / 2 ** 30, "flops_ratio": sum(summary["flops"].values()) / model,
            "mfu_bound": model / summary["seconds"] / dense_peak}


def maxtext_child(spec: str, gpus: int, hlo: str, argv: list[str]) -> None:
    """In the environment: MaxText's train step on a mesh of the target's devices, compiled by MaxText's own
    functions; writes the optimized HLO and prints its memory as JSON."""
    from flax.linen import partitioning
    from jax.experimental import topologies
    from jax.sharding import AxisType, Mesh
    from maxtext.configs import pyconfig
    from maxtext.trainers.pre_train import train, train_compile
    from maxtext.utils import maxtext_utils, sharding

    config = pyconfig.initialize(["", *argv])
    with open(spec) as f:
        devices = topologies.get_topology_desc(platform="cuda", topology=target.topology(gpus),
                                               target_config=f.read()).devices
    mesh = Mesh(maxtext_utils.create_device_mesh(config, devices), config.mesh_axes,
                axis_types=(AxisType.Auto,) * len(config.mesh_axes))
    args, kwargs, state_shardings, _, model = train_compile.get_shaped_inputs(mesh, config)
    params_shardings, state_shardings = sharding.maybe_update_params_sharding_with_opt(config, state_shardings)
    inputs = sharding.build_zero1_input_state_mesh_shardings(config, state_shardings, params_shardings)
    func, in_shard, out_shard, static, donate = maxtext_utils.get_functional_train_with_signature(
        train.train_step, sharding.get_input_data_sharding(config, mesh), inputs, model, config, params_shardings)
    compiled = train_compile.jit_and_compile(func, args, kwargs, mesh, in_shard, out_shard, static, donate, config,
                                             partitioning.axis_rules(config.logical_axis_rules))
    with open(hlo, "w") as f:
        f.write(compiled.as_text())
    m = compiled.memory_analysis()
    print(json.dumps({"arguments": m.argument_size_in_bytes, "temporaries": m.temp_size_in_bytes,
                      "outputs": m.output_size_in_bytes, "aliased": m.alias_size_in_bytes}))


def markdown(rows: dict) -> str:
    head = ["case", "stack", "mesh", "peak GiB", *budget.CATEGORIES, "budget ms", "compiled / model FLOPs",
            "MFU bound"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, row in rows.items():
        if "error" in row:
            lines.append(f"| {name} | | | {row['error']} |")
            continue
        for stack in ("jaxtron", "maxtext"):
            r = row[stack]
            cells = [name, stack, row.get(f"{stack}_mesh", ""), f"{r['peak_gib']:.1f}",
                     *(f"{r['ms'][c]:.1f}" if r["ms"][c] else "" for c in budget.CATEGORIES),
                     f"**{r['budget_ms']:.1f}**", f"{r['flops_ratio']:.3f}", f"{r['mfu_bound']:.1%}"]
            lines.append("| " + " | ".join(cells) + " |")
        lines.append(f"| {name} | jaxtron / MaxText | | | " + " | " * len(budget.CATEGORIES)
                     + f"**{row['jaxtron']['budget_ms'] / row['maxtext']['budget_ms']:.3f}x** | | |")
    return "\n".join(lines) + "\n"


def run_case(case: Case, interpreter: str, venv: str, hlo_dir: str | None, key: str) -> dict:
    with tempfile.TemporaryDirectory() as folder:
        jx = compile_jaxtron(case, interpreter, venv, folder)
        mt = compile_maxtext(case, interpreter, venv, folder)
        row = {"jaxtron": priced(case, jx["hlo"], jx["peak"]), "maxtext": priced(case, mt["hlo"], mt["peak"]),
               "jaxtron_mesh": " ".join(f"{k}={v}" for k, v in jx["mesh"].items() if v > 1) or "one device",
               "maxtext_mesh": " ".join(f"{k}={v}" for k, v in case.maxtext.items() if k.startswith("ici_"))
               or ("one device" if case.gpus == 1 else "fsdp over all")}
        if hlo_dir:
            os.makedirs(hlo_dir, exist_ok=True)
            for stack, got in (("jaxtron", jx), ("maxtext", mt)):
                shutil.copy(got["hlo"], os.path.join(hlo_dir, f"{key}.{stack}.hlo"))
    return row


def main(argv: list[str]) -> int:
    if argv[:1] == ["--maxtext-child"]:
        maxtext_child(argv[1], int(argv[2]), argv[3], argv[4:])
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", default=",".join(CASES), help=f"of {', '.join(CASES)}")
    parser.add_argument("--hlo-dir", help="write each optimized program here")
    parser.add_argument("--out", default=os.path.join(REPO, "benchmarks", "peer_compile"))
    parser.add_argument("--venv", default=VENV)
    parser.add_argument("--python", default=default_python())
    args = parser.parse_args(argv)
    keys = args.cases.split(",")
    if any(k not in CASES for k in keys):
        parser.error(f"--cases takes {', '.join(CASES)}")
    interpreter = prepare(args.venv, args.python)
    rows = {}
    for key in keys:
        case = CASES[key]
        try:
            rows[case.name] = run_case(case, interpreter, args.venv, args.hlo_dir, key)
        except (RuntimeError, subprocess.TimeoutExpired) as e:
            errors = [line for line in str(e).splitlines() if ERROR.search(line)]
            rows[case.name] = {"error": (errors or str(e).splitlines())[-1].strip()[:300]}
        print(f"{case.name}: {json.dumps(rows[case.name])[:300]}", flush=True)
    with open(args.out + ".json", "w") as f:
        json.dump(rows, f, indent=1)
    with open(args.out + ".md", "w") as f:
        f.write(markdown(rows))
    return 0 if all("error" not in r for r in rows.values()) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
