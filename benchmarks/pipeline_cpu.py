"""The same model on 8 fake CPU devices with 1, 2 and 4 pipeline stages: compiled memory per device, step time and
the bubble each layout reports. A comparison of layouts on one host, not a measure of scaling (the 8 devices share
the host's cores).

    python benchmarks/pipeline_cpu.py [--steps 12] [--output benchmarks/pipeline_cpu.json]

Each layout: XLA's memory analysis of the compiled train step (``jaxtron.planning.dry_run``), then a run of
``--steps`` steps on synthetic tokens whose step times (every step logged, the first two dropped as warm-up) give
the median and the spread.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import subprocess
import sys
import tempfile

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import numpy as np

from jaxtron.config.schema import (
    Config,
    DataConfig,
    ExecutionConfig,
    MeshConfig,
    ModelConfig,
    OptimizerConfig,
    PipelineConfig,
    TrainConfig,
)
from jaxtron.planning.dry_run import dry_run
from jaxtron.training.loop import run

# (name, mesh, pipeline): the same 8 devices, the rest of them fsdp
LAYOUTS = [("fsdp=8", dict(pipeline=1, fsdp=8), PipelineConfig()),
           ("pipeline=2 fsdp=4, 4 microbatches", dict(pipeline=2, fsdp=4), PipelineConfig(microbatches=4)),
           ("pipeline=2 fsdp=4, 8 microbatches", dict(pipeline=2, fsdp=4), PipelineConfig(microbatches=8)),
           ("pipeline=2 fsdp=4, 4 microbatches x 2 virtual", dict(pipeline=2, fsdp=4),
            PipelineConfig(microbatches=4, virtual_stages=2)),
           ("pipeline=4 fsdp=2, 4 microbatches", dict(pipeline=4, fsdp=2), PipelineConfig(microbatches=4)),
           ("pipeline=4 fsdp=2, 8 microbatches", dict(pipeline=4, fsdp=2), PipelineConfig(microbatches=8))]


def config(mesh: dict, pipeline: PipelineConfig, steps: int) -> Config:
    """An 8-layer Llama-style model of 2.2M parameters, float32, sequence 128, 32 rows per step."""
    model = ModelConfig(name="bench", vocab_size=1024, embed_dim=128, num_layers=8,
                        attention=dict(num_heads=4, num_kv_heads=2), mlp_dim=512, max_seq_len=128)
    return Config(model=model, execution=ExecutionConfig(dtype="float32"), mesh=MeshConfig(**mesh),
                  pipeline=pipeline, train=TrainConfig(steps=steps, global_batch_size=32, log_every=1, eval_batches=0),
                  optimizer=OptimizerConfig(warmup_steps=1), data=DataConfig(source="synthetic", seq_len=128))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--output", default="")
    args = parser.parse_args()
    rows = []
    for name, mesh, pipeline in LAYOUTS:
        cfg = config(mesh, pipeline, args.steps)
        compiled = dry_run(cfg)
        with tempfile.TemporaryDirectory() as workdir:
            cfg = dataclasses.replace(cfg, checkpoint=dataclasses.replace(cfg.checkpoint, every=0))
            summary = run(cfg, workdir, use_tqdm=False)
        times = [h["step_time_s"] for h in summary.history][2:]
        bubble = summary.history[-1].get("pipeline_bubble", 0.0)
        rows.append(dict(layout=name, mesh=mesh, pipeline=dataclasses.asdict(pipeline), bubble=bubble,
                         step_time_median_s=float(np.median(times)), step_time_min_s=min(times),
                         step_time_max_s=max(times), argument_mib=compiled.argument_bytes / 2**20,
                         temp_mib=compiled.temp_bytes / 2**20, peak_mib=compiled.peak_bytes / 2**20))
        print(f"{name:<48} bubble {bubble:.3f}  step {rows[-1]['step_time_median_s']:.3f} s "
              f"({min(times):.3f}-{max(times):.3f})  state+batch {rows[-1]['argument_mib']:.1f} MiB  "
              f"temporaries {rows[-1]['temp_mib']:.1f} MiB  peak {rows[-1]['peak_mib']:.1f} MiB", flush=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=os.path.dirname(os.path.abspath(__file__)), check=False).stdout.strip()
    report = dict(date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"), commit=commit,
                  jax=jax.__version__, cpus=os.cpu_count(), devices=jax.device_count(), steps=args.steps, rows=rows)
    if args.output:
        with open(args.output, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
