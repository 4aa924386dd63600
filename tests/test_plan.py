"""The planner's dry run: the real train step compiled for a mesh from abstract inputs, its memory analysis
and the collectives it executes per step."""

import jax
import numpy as np

from helpers import tiny_config
from jaxtron.mesh import make_mesh
from jaxtron.planning.dry_run import collectives, dry_run
from jaxtron.training import state as state_lib

HLO = """HloModule m

%body (p: (s32[], f32[8])) -> (s32[], f32[8]) {
  %ag = f32[8]{0} all-gather(f32[2]{0} %x), dimensions={0}
  %ar = f32[8]{0} all-reduce(f32[8]{0} %ag), to_apply=%sum
}

%cond (p: (s32[], f32[8])) -> pred[] {
  %c = pred[] constant(true)
}

%sum (a: f32[], b: f32[]) -> f32[] {
  %s = f32[] add(f32[] %a, f32[] %b)
}

ENTRY %main (x: f32[2]) -> f32[8] {
  %w = (s32[], f32[8]) while((s32[], f32[8]) %t), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"3"}}
  %rs = bf16[4]{0} reduce-scatter(bf16[16]{0} %y), dimensions={0}, to_apply=%sum
  %a2a-start = (f32[4], f32[4]) all-to-all-start(f32[4]{0} %z)
  %a2a-done = f32[4]{0} all-to-all-done((f32[4], f32[4]) %a2a-start)
}
"""


def test_collectives_count_loop_iterations_and_result_bytes():
    got = collectives(HLO)
    assert got["all-gather"] == {"count": 3, "bytes": 3 * 8 * 4}  # in a loop body run 3 times
    assert got["all-reduce"] == {"count": 3, "bytes": 3 * 8 * 4}
    assert got["reduce-scatter"] == {"count": 1, "bytes": 4 * 2}
    assert got["all-to-all"]["count"] == 1  # an async pair is one collective
    assert got["collective-permute"]["count"] == 0


def test_dry_run_memory_and_collectives_follow_the_mesh():
    fsdp = dry_run(tiny_config(dict(fsdp=8)))
    cfg = tiny_config(dict(fsdp=8))
    sizes = cfg.check_devices(8)
    setup = state_lib.setup(cfg, "xla")
    state_bytes = state_lib.state_bytes_per_device(
        setup.abstract_state, state_lib.state_shardings(make_mesh(sizes), setup.abstract_state))
    batch_bytes = 5 * (8 // 8) * 32 * 4  # five int32 [batch/8, 32] arrays
    votes = 4
    assert fsdp.argument_bytes == state_bytes + batch_bytes + votes
    assert fsdp.temp_bytes > 0 and fsdp.peak_bytes >= fsdp.argument_bytes
    # FSDP gathers every layer's weights in the forward and again in the backward pass: 2 layers, 7 matrices
    assert fsdp.collectives["all-gather"]["count"] >= 2 * 2 * 7
    data = dry_run(tiny_config(dict(data=8, fsdp=1)))
    assert data.collectives["all-gather"]["count"] == 0 and data.collectives["all-reduce"]["count"] > 0
    assert data.argument_bytes > 4 * fsdp.argument_bytes  # replicated state
    moe = dry_run(tiny_config(dict(fsdp=2, expert=4), model=dict(num_experts=4)))
    # per MoE block: rows out, counts, outputs back, and two transposed row exchanges
    assert moe.collectives["all-to-all"]["count"] >= 2 * 5
    assert np.isfinite(moe.compile_s) and jax.device_count() == 8
