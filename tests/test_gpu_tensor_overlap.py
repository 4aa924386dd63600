"""Tensor parallelism's collectives beside GEMMs on the H100 target (execution.tensor_chunks, models/tensor_chunks.py).

Each compile runs in a subprocess started as the target says, and the overlap counter (``jaxtron.metrics.overlap``)
reads the kernels XLA scheduled between each collective's start and done.
"""

from __future__ import annotations

import pytest
from helpers import on_target, target_marks

from jaxtron.config.loader import load_config
from jaxtron.parallel import timetable
from jaxtron.parallel.checks import check_devices
from jaxtron.planning.estimate import estimate
from jaxtron.planning.gpus import gpu

pytestmark = target_marks()

CODE = """
from jaxtron.metrics import budget, overlap
from jaxtron.planning.gpus import GPUS
found = overlap.windows(text, budget.H100)
inside = [w for w in found if w.runs > 1]  # the layer loop's: the blocks' collectives
group = tuple(range(cfg.mesh.tensor))  # device 0's tensor group: the mesh's last axis
tensor = [w for w in found if w.devices == group]
scope = {m.group(1): m.group(2) for m in re.finditer(r'-done\\((%[\\w.-]+)\\).*?op_name="([^"]*)"', text)}
bare = [(w.kind, w.bytes, scope.get(w.name, ''), w.runs) for w in tensor if w.compute_s == 0]
nvlink = GPUS['h100'].nvlink_bandwidth
stage = int(sys.argv[2]) // cfg.mesh.pipeline  # devices a stage (the pipeline: the mesh's first axis)
over_stages = [(w.kind, w.bytes, w.runs, scope.get(w.name, '')) for w in found if w.runs > 1 and (
    w.kind == 'collective-permute' or len({d // stage for d in w.devices}) > 1)]  # the loop's (permutes: hops)
# the embedding's backward gathers the input gradient's tokens onto each vocabulary shard (no GEMM there)
embedding = sum(w.runs for w in tensor if w.kind == 'all-gather' and 'scatter-add' in scope.get(w.name, ''))
print(json.dumps(dict(all=overlap.summary(found, nvlink), blocks=overlap.summary(inside, nvlink),
                      tensor=overlap.summary(tensor, nvlink), bare=bare, peak=result.peak_bytes,
                      over_stages=over_stages, embedding=embedding, seconds=budget.budget(text, budget.H100).seconds)))
"""

# Llama-3 70B cut to 2 layers on one node's tensor group of 8, as the tensor=8 layouts run it
CUT = ["model.num_layers=2", "mesh.tensor=8", "mesh.fsdp=1", "data.seq_len=4096", "train.global_batch_size=2",
       "execution.dtype=bfloat16", "execution.attention=cudnn"]


# GPT-3 175B as Megatron published it (TP4 PP8 DP4 on 128 H100s), as the planner runs that layout (2 virtual stages,
# the distributed optimizer), cut to a layer a virtual stage and 8 microbatches
GPT3_LAYOUT = ["mesh.pipeline=8", "mesh.data=4", "mesh.tensor=4", "mesh.fsdp=1", "model.num_layers=16",
               "pipeline.schedule=interleaved", "pipeline.virtual_stages=2", "pipeline.microbatches=8",
               "train.global_batch_size=32", "optimizer.distributed=true", "execution.attention=cudnn"]


def _overlap(chunks: int, config: str = "llama3_70b", gpus: int = 8, overrides: list[str] = CUT) -> dict:
    return on_target(CODE, f"configs/{config}.py", gpus, *overrides, f"execution.tensor_chunks={chunks}", timeout=600)


def test_chunked_projections_run_the_tensor_groups_collectives_beside_gemms_on_the_h100():
    """With the projections in 2 chunks, the blocks' gathers and reduce-scatters over the tensor group get GEMMs
    between their start and done. At the planner's NVLink rate the kernels there can hide 84% of the blocks'
    gathered and of their reduce-scattered bytes (51% and 13% whole: each collective feeds, or is fed by, the GEMM
    beside it); with the loss's and the embedding's, 79% and 67% (51% and 16%). Every gather in the blocks has a
    kernel beside it. The same bytes move; the budget grows by less than 2% (the chunks' copies)."""
    whole, chunked = _overlap(1), _overlap(2)
    for kind, floor in (("all-gather", 0.75), ("reduce-scatter", 0.6)):
        assert chunked["all"][kind]["hidden_share"] >= floor, (kind, chunked["all"][kind])
        assert chunked["all"][kind]["bytes"] == whole["all"][kind]["bytes"]
        blocks, before = chunked["blocks"][kind], whole["blocks"][kind]
        assert blocks["hidden_share"] >= 0.8 and blocks["hidden_share"] >= before["hidden_share"] + 0.3, (before,
                                                                                                          blocks)
        assert blocks["beside_gemms"] > before["beside_gemms"], (before, blocks)
    gathers = chunked["blocks"]["all-gather"]
    assert gathers["beside_compute"] == gathers["count"] > 0, gathers
    assert chunked["seconds"] < 1.02 * whole["seconds"], (whole["seconds"], chunked["seconds"])


def test_the_published_gpt3_layout_runs_each_tensor_gather_and_reduce_scatter_beside_compute_on_the_h100():
    """GPT-3 175B's published layout with the projections in 2 chunks: every all-gather and reduce-scatter over the
    tensor group has kernels between its start and done (a GEMM beside most of the blocks'), but the loss's. The
    tensor collectives left bare are the loss's gather of the stage's piece of the head's tokens (12 MiB an
    iteration, 3% of the group's gathered bytes) and the embedding lookup's sum over the vocabulary's shards. The
    embedding's gradient is summed on each vocabulary shard: no float32 table crosses the group (2.3 GiB a
    microbatch before, 9.8 times the bytes of all other reduce-scatters over the group). Nor does one cross the
    stages in the loop (the embedding's backward once summed a 618 MB float32 vocabulary shard over them each
    iteration), and each iteration moves at most 5 hand-overs' bytes between stages, where it moved 64."""
    got = _overlap(2, "gpt3_175b", 128, GPT3_LAYOUT)
    sums = [size for kind, size, _, _ in got["over_stages"] if kind == "all-reduce"]
    assert max(sums, default=0) <= 64 * 2**20, got["over_stages"]
    # what crosses the stages, in units of a stage's hand-over (a microbatch's residual stream split over the
    # tensor group): each iteration the shifts forward and back (2); each of the 23 of 38 that run the forward
    # phase the head's pieces out and back (2) and the embedding lookup's ids and sums, which XLA moves to another
    # device order for its sum over the tensor group (1). Before: 64 an iteration here, 23 at the layout's full
    # depth and microbatches (96 layers, 6 rows).
    boundary = 32 // 4 // 8 * 2048 * 12288 // 4 * 2
    iterations = max(runs for _, _, runs, _ in got["over_stages"])
    assert iterations == timetable.iterations(8, 8, 2), got["over_stages"]
    crossing = sum(size * runs for _, size, runs, _ in got["over_stages"]) / boundary
    expected = 2 * iterations + 3 * timetable.forward_iterations(8, 8, 2)
    assert crossing == pytest.approx(expected, rel=0.1), (crossing, expected, got["over_stages"])
    # the planner prices the permutes and the head's all-to-alls as compiled (planning/collectives.py)
    cfg = load_config("configs/gpt3_175b.py", [tuple(o.split("=", 1)) for o in GPT3_LAYOUT]
                      + [("execution.tensor_chunks", "2")])
    planned = estimate(cfg, check_devices(cfg, 128), gpu("h100")).collectives
    compiled = sum(size * runs for kind, size, runs, _ in got["over_stages"] if kind != "all-reduce")
    assert planned["collective-permute"] + planned["all-to-all"] == pytest.approx(compiled, rel=0.1)
    # the loss's, and the embedding lookup's sum over the vocabulary's shards, which the first block waits for
    bare_kinds = {(kind, "loss" in scope or "_take" in scope) for kind, _, scope, _ in got["bare"]}
    assert bare_kinds <= {("all-reduce", True), ("all-gather", True)}, got["bare"]
    loss_gathers = [(size, runs) for kind, size, _, runs in got["bare"] if kind == "all-gather"]
    for kind in ("all-gather", "reduce-scatter"):
        tensor = got["tensor"][kind]
        bare = sum(runs for _, runs in loss_gathers) if kind == "all-gather" else 0
        assert tensor["count"] > 0 and tensor["beside_compute"] == tensor["count"] - bare, (kind, tensor)
        embedding = got["embedding"] if kind == "all-gather" else 0
        assert tensor["beside_gemms"] >= (tensor["count"] - embedding) / 2, (kind, tensor, embedding)
    gathered = sum(size * runs for size, runs in loss_gathers)
    assert gathered <= 0.05 * got["tensor"]["all-gather"]["bytes"], (loss_gathers, got["tensor"])
    gathered = got["tensor"]["all-gather"]["bytes"]
    assert got["tensor"]["reduce-scatter"]["bytes"] <= 1.01 * gathered, got["tensor"]


def test_1f1b_prices_its_tensor_chunks_extra_pass_as_compiled_on_the_h100():
    """GPT-3 175B's published layout cut as above, run as 1F1B (one chunk a stage): the second tensor chunk's extra
    pass over the projections' weights, the budget's difference of the two programs (49.1 ms of 530.0, phases
    counted where they run), against what the planner adds for it (``IN_PLACE_CHUNK_PASS_BYTES``), within 15%."""
    from helpers import on_target

    layout = [o for o in GPT3_LAYOUT if not o.startswith(("pipeline.schedule", "pipeline.virtual_stages"))]
    layout += ["pipeline.schedule=1f1b", "pipeline.virtual_stages=1"]
    code = ("from jaxtron.metrics import budget\n"
            "print(json.dumps(dict(seconds=budget.budget(text, budget.H100).seconds)))\n")
    compiled, planned = [], []
    for chunks in (1, 2):
        overrides = [*layout, f"execution.tensor_chunks={chunks}"]
        compiled.append(on_target(code, "configs/gpt3_175b.py", 128, *overrides, timeout=900)["seconds"])
        cfg = load_config("configs/gpt3_175b.py", [tuple(o.split("=", 1)) for o in overrides])
        est = estimate(cfg, check_devices(cfg, 128), gpu("h100"))
        planned.append(est.time["weights"] + est.time["pipeline_bubble"])
    assert compiled[1] > compiled[0], compiled
    assert planned[1] - planned[0] == pytest.approx(compiled[1] - compiled[0], rel=0.15), (planned, compiled)
