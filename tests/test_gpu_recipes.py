"""The FP8 recipes' GEMMs and the Blackwell targets (B200, GB200), compiled without the GPU: their kernels, MXFP8's
block-scaled GEMMs on the B200, blockwise FP8's on the H100, and the planner's memory against the compiled peak."""

import json

import pytest
from conftest import REPO
from helpers import target_marks

pytestmark = target_marks()

# 6 x 16384 tokens x 4 blocks' q, k, v, o, gate, up and down weights: the projections' FLOPs
PROJECTION_FLOPS = 6 * 4 * 4096 * 4 * (2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14336)


def _plan(tmp_path, gpus: int, mesh: str, *overrides: str, gpu: str = "b200") -> dict:
    """``jaxtron plan --compile`` of Llama-3 8B at 4 layers, sequence 4096, 4 rows a GPU: its dry run."""
    from jaxtron import cli

    out = tmp_path / f"{gpu}-{gpus}-{mesh}.json"
    assert cli.run("plan", [f"--config={REPO}/configs/llama3_8b.py", f"--gpus={gpus}", f"--gpu={gpu}",
                            f"--compile={mesh}", "--config.model.num_layers=4", "--config.data.seq_len=4096",
                            f"--config.train.global_batch_size={4 * gpus}", f"--json={out}", *overrides]) == 0
    return json.loads(out.read_text())["dry_run"]


def test_llama3_8b_compiles_for_one_b200_with_cudnn_attention_both_ways(tmp_path):
    compiled = _plan(tmp_path, 1, "fsdp=1")
    assert compiled["target"] == "b200"
    assert compiled["kernels"]["__cudnn$fmhaSoftmax"] >= 1 and compiled["kernels"]["__cudnn$fmhaSoftmaxBackward"] == 1
    assert "__cudnn$blockScaledDot" not in compiled["kernels"]
    assert 0.99 < compiled["flops"] / compiled["model_flops"] < 1.05, compiled


def test_mxfp8_makes_every_projection_gemm_a_block_scaled_fp8_one_on_the_b200(tmp_path):
    """7 projections a block (q, k, v, o, gate, up, down), each a forward and two gradient GEMMs, in the layers'
    one loop body: 21 calls of cuDNN's block-scaled GEMM, each on e4m3 operands; the head stays 16-bit."""
    compiled = _plan(tmp_path, 1, "fsdp=1", "--config.execution.fp8=True", "--config.execution.fp8_recipe=mxfp8")
    assert compiled["kernels"]["__cudnn$blockScaledDot"] == 21, compiled["kernels"]
    assert compiled["budget"]["flops"]["GEMM fp8"] == pytest.approx(PROJECTION_FLOPS, rel=1e-6)
    # the block-scaled GEMMs counted at their shapes: the program's matmuls are the model's
    assert 0.99 < compiled["flops"] / compiled["model_flops"] < 1.05, compiled


def test_blockwise_makes_every_projection_gemm_an_fp8_kernel_on_the_h100(tmp_path):
    """Blockwise FP8's Pallas GEMM on the H100: 21 calls on e4m3 operands, forward and both gradients, each
    projection's forward once (the checkpoint policy keeps the kernel's output as it keeps a dot's)."""
    compiled = _plan(tmp_path, 1, "fsdp=1", "--config.execution.fp8=True", "--config.execution.fp8_recipe=blockwise",
                     gpu="h100")
    assert compiled["kernels"]["__gpu$xla.gpu.triton"] == 21, compiled["kernels"]
    assert compiled["budget"]["flops"]["GEMM fp8"] == pytest.approx(PROJECTION_FLOPS, rel=1e-6)
    assert 0.99 < compiled["flops"] / compiled["model_flops"] < 1.05, compiled


@pytest.mark.parametrize("mesh", ["fsdp=8", "fsdp=4,tensor=2"])
def test_the_planners_memory_is_within_10_percent_of_eight_b200s_compiled(tmp_path, mesh):
    compiled = _plan(tmp_path, 8, mesh)
    assert abs(compiled["estimated_peak"] / compiled["compiled_peak"] - 1) < 0.10, compiled


def test_a_gb200_compiles_on_its_compute_trays(tmp_path):
    """A GB200's host holds 4 GPUs: 8 of them are 2 trays in the compile's topology, one NVLink domain."""
    compiled = _plan(tmp_path, 8, "fsdp=8", gpu="gb200")
    assert compiled["target"] == "gb200" and compiled["kernels"]["__cudnn$fmhaSoftmaxBackward"] == 1
    assert compiled["collectives"]["all-gather"]["count"] > 0


def test_capacity_modes_experts_take_the_block_scales_on_the_b200(tmp_path):
    """Mixtral 8x7B at 1 layer in capacity mode with mxfp8: the attention's 4 projections and the experts' 3
    matrices, each forward and two gradients, are block-scaled GEMMs; only the head (and the router) stay 16-bit."""
    from jaxtron import cli

    out = tmp_path / "mixtral.json"
    assert cli.run("plan", [f"--config={REPO}/configs/mixtral_8x7b.py", "--gpus=1", "--gpu=b200", "--compile=fsdp=1",
                            "--config.model.num_layers=1", "--config.data.seq_len=4096",
                            "--config.train.global_batch_size=2", "--config.execution.fp8=True",
                            "--config.execution.fp8_recipe=mxfp8", "--config.execution.moe_mode=capacity",
                            f"--json={out}"]) == 0
    compiled = json.loads(out.read_text())["dry_run"]
    assert compiled["kernels"]["__cudnn$blockScaledDot"] >= 7 * 3, compiled["kernels"]
    flops = compiled["budget"]["flops"]
    assert flops["GEMM fp8"] > 4 * flops["GEMM bf16"] > 0, flops


def test_blockwise_compiles_in_a_1f1b_pipeline_on_h100s(tmp_path):
    """The 1F1B schedule vmaps its stages: the blockwise kernel takes them as its batch of GEMMs (a vmap of the
    partitioned call has no rule). Every projection GEMM of the schedule stays an FP8 kernel."""
    compiled = _plan(tmp_path, 2, "pipeline=2", "--config.execution.fp8=True",
                     "--config.execution.fp8_recipe=blockwise", "--config.pipeline.schedule=1f1b",
                     "--config.pipeline.microbatches=2", gpu="h100")
    assert compiled["kernels"]["__gpu$xla.gpu.triton"] >= 21, compiled["kernels"]
    assert compiled["budget"]["flops"]["GEMM fp8"] > 2 * compiled["budget"]["flops"]["GEMM bf16"] > 0


def test_blockwise_dropless_experts_run_the_grouped_fp8_kernels_on_the_h100(tmp_path):
    """Mixtral 8x7B at 1 layer, dropless, blockwise: the experts' 3 matrices run jaxtron's grouped blockwise
    kernels (forward, input and weight gradients), the attention's projections the blockwise GEMM."""
    from jaxtron import cli

    out, hlo = tmp_path / "mixtral.json", tmp_path / "mixtral.hlo"
    assert cli.run("plan", [f"--config={REPO}/configs/mixtral_8x7b.py", "--gpus=1", "--gpu=h100", "--compile=fsdp=1",
                            "--config.model.num_layers=1", "--config.data.seq_len=4096",
                            "--config.train.global_batch_size=2", "--config.execution.fp8=True",
                            "--config.execution.fp8_recipe=blockwise", f"--json={out}", f"--hlo={hlo}"]) == 0
    calls = [line for line in hlo.read_text().splitlines() if 'custom_call_target="__gpu$xla.gpu.triton"' in line]
    grouped = [line for line in calls if "jaxtron_blockwise_fp8_RaggedDot" in line]
    assert len(grouped) >= 9 and all("f8e4m3fn[" in line for line in grouped), len(grouped)
    flops = json.loads(out.read_text())["dry_run"]["budget"]["flops"]
    assert flops["grouped GEMM"] > flops["GEMM bf16"] > 0 and flops["GEMM fp8"] > 0, flops
