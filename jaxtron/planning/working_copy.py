"""The planner's view of the distributed optimizer's working copy (``training/working_copy.py``).

Under ``optimizer.distributed`` the float32 masters split over the batch's axes as the moments do, and a step
gathers a working copy once: each block projection's weight used as stored in the compute dtype, the other
parameters float32 where their masters are split. Every microbatch then reads that copy, so a pass over the
weights costs fewer bytes than a cast from the masters (``WORKING_COPY_PASS_BYTES``).
"""

from __future__ import annotations

from collections.abc import Mapping

from jaxtron.planning.params import Param

# Read from H100-target compiles priced by the step budget: Llama-3 8B at 8 layers (vocabulary 32000) on pipeline=2
# tensor=4, 8 rows of 2048 tokens in 4 and then 8 pipeline microbatches under 1F1B. Each further pass over a
# stage's block weights moved 27.7 bytes an element from float32 masters (GPU.weight_pass_bytes: 22 priced) and
# 15.8 from the working copy: its bfloat16 slices, forward and recompute, the transposed layouts and the float32
# gradient sum, without the casts. That was with the stack indexed per stage, as the interleaved schedule still is;
# 1F1B's single chunk now slices in place (planning/step_time.py IN_PLACE_PASS_BYTES).
WORKING_COPY_PASS_BYTES = 16.0


def reads_working_copy(param: Param, sizes: Mapping[str, int], value_bytes: int) -> bool:
    """Whether a step reads ``param`` from its working copy in the compute dtype: a block projection's weight used
    as stored (not gathered over the batch's axes for use), with a compute dtype narrower than float32."""
    stored = param.gathered_elements(sizes) == param.shard_elements(sizes)
    return param.projection and stored and value_bytes < 4


def working_copy_bytes(params: tuple[Param, ...], sizes: Mapping[str, int], value_bytes: int) -> float:
    """Bytes a device holds of the working copy beside the masters: the compute-dtype projection weights, and
    float32 copies of the other parameters whose masters are split over the batch's axes."""
    total = 0.0
    for p in params:
        if reads_working_copy(p, sizes, value_bytes):
            total += value_bytes * p.shard_elements(sizes)
        elif p.optimizer_elements(sizes) < p.shard_elements(sizes):
            total += 4.0 * p.shard_elements(sizes)
    return total
