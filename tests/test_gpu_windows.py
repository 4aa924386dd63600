"""Gemma 3 and gpt-oss on the compile-only H100 target: every layer's attention is cuDNN's flash kernel forward and
backward, the local layers' with cuDNN's sliding window (no [length, length] array anywhere), gpt-oss's sinks
folded in without a second forward kernel, and the planner's memory within 10% of the compiled peak.

The compiles need jax's CUDA plugin (`python -m pip install -e ".[gpu-target]"`); each runs in a subprocess.
"""

from __future__ import annotations

import json

import pytest
from conftest import REPO
from helpers import on_target, target_marks

pytestmark = target_marks()

# each cuDNN attention call of the compiled step, times the runs of its computation: (backward?, its window)
CENSUS = """
from jaxtron.metrics.hlo import runs_per_execution
comps, runs = runs_per_execution(text)
calls = []
for name, lines in comps.items():
    for line in lines:
        if '__cudnn$fmhaSoftmax' in line:
            window = re.search(r'"sliding_window_length":\\s*"?(\\d+)', line)
            calls += [['Backward' in line, int(window.group(1)) if window else 0]] * runs.get(name, 0)
square = len(re.findall(r'\\[[\\d,]*8192,8192[\\d,]*\\]', text))
print(json.dumps(dict(calls=calls, square=square, peak=result.peak_bytes)))
"""


def _census(config: str, gpus: int, *overrides: str) -> dict:
    return on_target(CENSUS, config, gpus, *overrides)


@pytest.mark.parametrize("config,layers,window,local", [("configs/gemma3.py:12b", 6, 1024, 5),
                                                         ("configs/gpt_oss.py:20b", 4, 128, 2)])
def test_every_layer_runs_cudnn_attention_forward_and_backward_local_ones_windowed(config, layers, window, local):
    """Gemma 3 12B's one period of six layers (five local) and gpt-oss-20b's four (two local), at sequence 8192 on
    eight H100s. With the attention outputs kept (save_dots_attention), each layer runs one forward and one backward
    kernel: gpt-oss's sinks keep the kernel's log-sum-exp, so the fold needs no second forward."""
    got = _census(config, 8, f"model.num_layers={layers}", "data.seq_len=8192", "train.global_batch_size=8",
                  "mesh.fsdp=8", "execution.remat=save_dots_attention", "execution.attention=cudnn")
    for backward in (False, True):
        windows = sorted(w for b, w in got["calls"] if b == backward)
        assert windows == [0] * (layers - local) + [window] * local, (backward, windows)
    assert got["square"] == 0  # no mask or score matrix of the whole sequence


@pytest.mark.parametrize("config,gpus,mesh", [("configs/gemma3.py:4b", 8, "fsdp=4,tensor=2"),
                                              ("configs/gpt_oss.py:20b", 8, "fsdp=8")])
def test_the_planners_memory_is_within_10_percent_of_the_h100_compile(config, gpus, mesh, tmp_path):
    """Sizes the planner's period term was not fitted on (it was fitted on Gemma 3 12B over fsdp=8)."""
    from jaxtron import cli

    out = tmp_path / "plan.json"
    assert cli.run("plan", [f"--config={REPO}/{config}", f"--gpus={gpus}", "--gpu=h100", f"--compile={mesh}",
                            "--config.model.num_layers=6" if "gemma" in config else "--config.model.num_layers=4",
                            "--config.train.global_batch_size=8", f"--json={out}"]) == 0
    compiled = json.loads(out.read_text())["dry_run"]
    assert compiled["target"] == "h100"
    assert abs(compiled["estimated_peak"] / compiled["compiled_peak"] - 1) < 0.10, compiled
