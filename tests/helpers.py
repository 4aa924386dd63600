"""Small configs shared by the tests."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from collections.abc import Callable

import numpy as np

from jaxtron.config.schema import (
    Config,
    DataConfig,
    ExecutionConfig,
    MeshConfig,
    ModelConfig,
    OptimizerConfig,
    TrainConfig,
    replace,
)

MESHES = {
    "data8": dict(data=8, fsdp=1),
    "fsdp8": dict(data=1, fsdp=8),
    "data2_fsdp2_tensor2": dict(data=2, fsdp=2, tensor=2),
    "fsdp2_sequence2_tensor2": dict(data=1, fsdp=2, sequence=2, tensor=2),
    "fsdp4_expert2": dict(data=1, fsdp=4, expert=2),
}


def tiny_config(mesh: dict | None = None, **sections) -> Config:
    """A 2-layer GQA model on synthetic tokens, computing in float32; every dimension divides 8. ``sections``:
    fields to replace, per section (``model=dict(num_layers=3, moe=dict(num_experts=4))``, ``execution=dict(remat=
    "full")``); a model subsection given as a dict changes only the fields it names."""
    model = ModelConfig(name="test", vocab_size=256, embed_dim=64, num_layers=2,
                        attention=dict(num_heads=4, num_kv_heads=2), rope=dict(theta=10_000.0), mlp_dim=128,
                        max_seq_len=64)
    execution = ExecutionConfig(dtype="float32")
    train = TrainConfig(steps=3, seed=0, global_batch_size=8, log_every=1, eval_batches=0)
    optimizer = OptimizerConfig(learning_rate=1e-2, warmup_steps=1)
    data = DataConfig(source="synthetic", seq_len=32)
    cfg = Config(model=model, execution=execution, mesh=MeshConfig(**(mesh or dict(fsdp=1))), train=train,
                 optimizer=optimizer, data=data)
    return dataclasses.replace(cfg, **{k: replace(getattr(cfg, k), **v) for k, v in sections.items()})


def largest_float_array(hlo: str) -> int:
    """Elements of the largest floating-point array anywhere in an HLO module's text, fusion bodies included
    (byte buffers such as GEMM workspaces are not counted)."""
    import math
    import re

    shapes = re.findall(r"\b(?:bf16|f16|f32|f64|f8e\w+)\[([0-9,]*)\]", hlo)
    return max((math.prod(int(d) for d in s.split(",") if d) for s in shapes), default=0)


def learning_run(config: str, workdir, devices: int, *args: str):
    """``train.py --config=configs/<config>`` as the README runs it, on ``devices`` CPU devices with XLA's
    optimised code (the other tests compile unoptimised programs, which is slower for a run that executes more
    than it compiles). Returns the CompletedProcess; the run's unigram entropy is in its log."""
    import os
    import subprocess
    import sys

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_")}
    env.update(XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}", JAX_PLATFORMS="cpu")
    return subprocess.run([sys.executable, "train.py", f"--config={os.path.join(repo, 'configs', config)}", *args,
                           f"--workdir={workdir}"], cwd=repo, env=env, capture_output=True, text=True, timeout=600,
                          check=False)


def refused(capsys, argv: list[str]) -> str:
    """The one error line of a `jaxtron` command refused with exit code 2."""
    from jaxtron import cli
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "Traceback" not in err[0], err
    return err[0]


def logged_entropy(log: str) -> float:
    """The unigram entropy of the training text that a run logs."""
    import re
    return float(re.search(r"unigram entropy of the training text ([0-9.]+)", log)[1])


def metrics_lines(workdir) -> list[dict]:
    """The lines a run wrote to ``workdir/metrics.jsonl``, parsed."""
    import json
    from pathlib import Path

    return [json.loads(line) for line in Path(workdir, "metrics.jsonl").read_text().splitlines() if line.strip()]


def losses(summary) -> np.ndarray:
    """The losses a run logged (``RunSummary.history``), in step order."""
    return np.array([h["loss"] for h in summary.history])


def published_layout(fixture: str, directory: str, config: Callable[[dict], dict], rename: Callable[[str], str],
                     extra: dict[str, tuple[int, ...]]) -> str:
    """A parity fixture copied to ``directory`` as its family publishes it: config.json as ``config`` rewrites it,
    each tensor under the name ``rename`` gives it, and random float32 ``extra`` tensors (name -> shape) beside
    them (a vision encoder the import leaves out)."""
    shutil.copytree(fixture, directory)
    path = os.path.join(directory, "config.json")
    with open(path) as f:
        published = config(json.load(f))
    with open(path, "w") as f:
        json.dump(published, f)
    rng = np.random.default_rng(0)
    rewrite_tensors(directory, rename, {n: rng.standard_normal(shape, np.float32) for n, shape in extra.items()})
    return directory


def rewrite_tensors(directory: str, rename: Callable[[str], str] = lambda n: n,
                    extra: dict[str, np.ndarray] | None = None) -> None:
    """The checkpoint in ``directory`` written again as one safetensors file: tensors renamed, ``extra`` added."""
    from jaxtron.interop.hf import safetensors as st

    files = st.ModelFiles(directory)
    tensors = {rename(n): files.read(n) for n in files.names()} | (extra or {})
    os.remove(os.path.join(directory, st.SINGLE))
    st.write(os.path.join(directory, st.SINGLE), [(n, v.shape, v.dtype) for n, v in tensors.items()],
             tensors.__getitem__)


def target_marks() -> list:
    """The marks of a module of H100-target compiles: integration, slow, skipped without jax's CUDA plugin."""
    import pytest

    from jaxtron.gpu import target

    return [pytest.mark.integration, pytest.mark.slow,
            pytest.mark.skipif(not target.plugin_installed(),
                               reason=f"jax's CUDA plugin is not installed ({target.INSTALL})")]


# What a script run by ``on_target`` starts with: ``cfg`` (the config with its overrides) compiled for the target
# ``sys.argv[3]`` on ``sys.argv[2]`` GPUs, ``result`` (the dry run) and ``text`` (the optimized HLO) in scope.
TARGET_PRELUDE = """
import json, re, sys
from jaxtron.config.loader import load_config
from jaxtron.planning.dry_run import dry_run_on_target
cfg = load_config(sys.argv[1], [tuple(a.split('=', 1)) for a in sys.argv[4:]])
result, text = dry_run_on_target(cfg, sys.argv[3], int(sys.argv[2]))
"""


def on_target(code: str, config: str, gpus: int, *overrides: str, timeout: float = 900, gpu: str = "h100") -> dict:
    """``TARGET_PRELUDE`` then ``code`` in a subprocess started as the compile-only target needs (an XLA abort ends
    that process, not the tests'), for ``config`` (a path from the repository's root) on ``gpus`` of the target
    ``gpu``: the JSON its last line prints."""
    import subprocess
    import sys

    from jaxtron.gpu import target

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, "-c", TARGET_PRELUDE + code, os.path.join(root, config), str(gpus), gpu,
                          *overrides], cwd=root, env=target.environment(), capture_output=True, text=True,
                         timeout=timeout, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])
