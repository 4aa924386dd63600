"""DPO and GRPO on the compile-only H100 target: the planner's memory of their steps, whose per-token
log-probabilities keep more float32 logits than the language model's loss, and of GRPO's sampler (cast weights, KV
cache, the prefill's working space); and a prefill that computes no logits but each row's last.

The compiles need jax's CUDA plugin (`python -m pip install -e ".[gpu-target]"`); each runs in a subprocess.
"""

from __future__ import annotations

import pytest
from helpers import on_target, target_marks

pytestmark = target_marks()

SAMPLER = """
from jaxtron.planning.estimate import estimate
from jaxtron.planning.gpus import GPUS
est = estimate(cfg, result.mesh, GPUS['h100'])
vocab = cfg.model.vocab_size // result.mesh['tensor']
prompt = cfg.data.seq_len - cfg.rl.max_new_tokens
logits = len(re.findall(r'f32\\[\\d+,%d,%d\\]' % (prompt, vocab), result.generation_text))
print(json.dumps(dict(compiled=result.generation_bytes, estimated=est.sampler_bytes, prompt_logits=logits)))
"""

GRPO = ("train.objective=grpo", "train.init_from=x", "rl.reward=m:f", "rl.group_size=8", "data.source=store",
        "data.path=x")


@pytest.mark.parametrize("config,mesh,layers,rows,seq_len,new_tokens", [
    # the prefill's attention scores set the peak (two float32 copies of 3.2 GB)
    ("configs/llama3_1b.py", ("mesh.tensor=2", "mesh.fsdp=4"), 16, 64, 2048, 512),
    # the residual stream, whole on each device of the tensor group
    ("configs/llama3_8b.py", ("mesh.tensor=8", "mesh.fsdp=1"), 4, 64, 2048, 256),
])
def test_the_planner_prices_the_samplers_memory(config, mesh, layers, rows, seq_len, new_tokens):
    """The estimate is within -5% and +20% of the compiled sampler's temporaries and outputs (it errs high: the
    planner decides what fits), and no [rows, prompt, vocab] logits are computed."""
    got = on_target(SAMPLER, config, 8, *mesh, f"model.num_layers={layers}", f"train.global_batch_size={rows}",
                    f"data.seq_len={seq_len}", f"rl.max_new_tokens={new_tokens}", *GRPO)
    assert -0.05 <= got["estimated"] / got["compiled"] - 1 <= 0.20, got
    assert got["prompt_logits"] == 0, got


STEP = """
from jaxtron.planning.estimate import estimate
from jaxtron.planning.gpus import GPUS
est = estimate(cfg, result.mesh, GPUS['h100'])
# the step's program: without cuDNN's workspace (unseen) and GRPO's sampler (its own program)
print(json.dumps(dict(compiled=result.peak_bytes, estimated=est.memory_bytes - est.unseen_on_target_bytes
                      - est.memory.get('generation', 0.0))))
"""


@pytest.mark.parametrize("objective,rows,chunks", [("grpo", 64, 1), ("grpo", 64, 8), ("dpo", 32, 1)])
def test_the_planner_prices_the_post_training_steps_memory_within_10_percent(objective, rows, chunks):
    """Llama-3 8B at 4 layers, sequence 2048, tensor=8 on 8 H100s: whole, GRPO's logits are three float32 copies
    (23.5 GiB a device), DPO's two; in 8 slices, none is whole."""
    reward = ("rl.reward=m:f", "rl.max_new_tokens=256") if objective == "grpo" else ()
    got = on_target(STEP, "configs/llama3_8b.py", 8, "mesh.tensor=8", "mesh.fsdp=1", "model.num_layers=4",
                    f"train.objective={objective}", "train.init_from=x", f"train.global_batch_size={rows}",
                    f"train.logit_chunks={chunks}", "data.seq_len=2048", "data.source=store", "data.path=x", *reward)
    assert abs(got["estimated"] / got["compiled"] - 1) <= 0.10, got
