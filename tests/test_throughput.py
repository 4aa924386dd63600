"""Recompute per remat policy (HFU and the planner), the FLOP-weighted peak of FP8 runs, and what the FLOP
count does with packed documents."""

from __future__ import annotations

import dataclasses

import pytest

from jaxtron.config.schema import Config, DataConfig, ExecutionConfig, ModelConfig, TrainConfig, replace
from jaxtron.metrics import flops, hardware
from jaxtron.metrics.throughput import Throughput

H100 = "NVIDIA H100 80GB HBM3"
H, Q, K, F, S, V = 64, 64, 32, 128, 32, 256  # embed, query width (4 x 16), kv width (2 x 16), MLP, seq, vocab
POLICIES = ("none", "full", "save_dots", "save_attention", "save_dots_attention")


EXECUTION_FIELDS = {f.name for f in dataclasses.fields(ExecutionConfig)}


def small(**change) -> Config:
    """A run of the 4-layer model below in bfloat16, sequence S, global batch 8. ``change`` replaces fields of the
    model (the architecture) or of its execution (remat, attention, fp8, ...), whichever has the name."""
    model = ModelConfig(vocab_size=V, embed_dim=H, num_layers=4, attention=dict(num_heads=4, num_kv_heads=2),
                        mlp_dim=F, max_seq_len=S)
    execution = dict(dtype="bfloat16")
    for name, value in change.items():
        if name in EXECUTION_FIELDS:
            execution[name] = value
        else:
            model = replace(model, **{name: value})
    return Config(model=model, execution=ExecutionConfig(**execution), data=DataConfig(seq_len=S),
                  train=TrainConfig(global_batch_size=8))


def forward_per_layer() -> dict[str, float]:
    """Forward FLOPs per token of each matmul of one block of ``small()`` (causal scores), written out by hand."""
    return {"wq": 2 * H * Q, "wk": 2 * H * K, "wv": 2 * H * K, "wo": 2 * Q * H,
            "qk": Q * S, "av": Q * S,  # 2 * q * s each, half of the keys under the causal mask
            "gate": 2 * H * F, "up": 2 * H * F, "down": 2 * H * F,
            "experts_in": 2 * 2 * 2 * H * F,  # top-2 of the MoE config below: gate and up
            "experts_out": 2 * 2 * H * F,  # and their down projection
            "router": 2 * H * 4}  # 4 experts


# What each policy re-runs in the backward pass, read off the policies in jaxtron/models/transformer.py: the block's
# last matmuls (the MLP's and the experts' down projections) are never needed again; 'save_dots' keeps unbatched
# dots; the attention output saves the cuDNN kernel, but XLA attention still needs its probabilities (QK^T).
PROJ = ("wq", "wk", "wv", "wo")
EXPECTED = {
    ("none", "xla"): (), ("none", "cudnn"): (),
    ("full", "xla"): PROJ + ("qk", "av", "gate", "up", "experts_in", "router"),
    ("full", "cudnn"): PROJ + ("qk", "av", "gate", "up", "experts_in", "router"),
    ("save_dots", "xla"): ("qk", "av", "experts_in"), ("save_dots", "cudnn"): ("qk", "av", "experts_in"),
    ("save_attention", "xla"): PROJ + ("qk", "gate", "up", "experts_in", "router"),
    ("save_attention", "cudnn"): PROJ + ("gate", "up", "experts_in", "router"),
    ("save_dots_attention", "xla"): ("qk", "experts_in"), ("save_dots_attention", "cudnn"): ("experts_in",),
}


def expected_recompute(remat: str, attention: str, dense_layers: int, moe_layers: int) -> float:
    per = forward_per_layer()
    total = 0.0
    for name in EXPECTED[(remat, attention)]:
        if name in ("gate", "up"):
            total += dense_layers * per[name]
        elif name in ("experts_in", "router"):
            total += moe_layers * per[name]
        else:
            total += (dense_layers + moe_layers) * per[name]
    return total


@pytest.mark.parametrize("attention", ["xla", "cudnn"])
@pytest.mark.parametrize("remat", POLICIES)
@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_hfu_minus_mfu_is_the_policys_recompute(remat, attention, moe):
    cfg = small(remat=remat, **(dict(moe=dict(num_experts=4, experts_per_token=2, every=2)) if moe else {}))
    dense_layers, moe_layers = (2, 2) if moe else (4, 0)
    throughput = Throughput(cfg, 1, H100, attention)
    step = throughput(2.0, 4)  # 0.5 s per step
    tokens = 8 * S
    recompute = expected_recompute(remat, attention, dense_layers, moe_layers)
    assert step["hfu"] - step["mfu"] == pytest.approx(recompute * tokens / 0.5 / 989.4e12, rel=1e-9, abs=1e-18)
    assert throughput.hardware_flops - throughput.model_flops == pytest.approx(recompute * tokens, rel=1e-12)
    if remat == "full" and not moe:  # nearly a whole forward more: all but the MLP's down projection
        forward = throughput.model_flops / tokens / 3 - 2 * H * V  # without the logits
        assert recompute == pytest.approx(forward - 4 * forward_per_layer()["down"], rel=1e-12)


def test_unknown_attention_implementation_is_refused():
    cfg = small(remat="full")
    with pytest.raises(ValueError, match="'auto'"):
        flops.hardware_flops_per_token(cfg.model, cfg.execution, S, attention="auto")


@pytest.mark.parametrize("attention", ["xla", "cudnn"])
@pytest.mark.parametrize("remat", POLICIES)
def test_planner_step_time_uses_the_same_recompute(remat, attention):
    from jaxtron.planning.estimate import estimate
    from jaxtron.planning.gpus import GPUS

    gpu = GPUS["h100"]
    cfg = small(remat=remat, attention=attention, moe=dict(num_experts=4, experts_per_token=2, every=2))
    est = estimate(cfg, dict(data=1, fsdp=2, sequence=1, expert=1, tensor=1), gpu)
    assert est.attention == attention
    peak = gpu.peak_flops["bfloat16"]
    attention_rate = gpu.attention_efficiency if attention == "cudnn" else gpu.xla_attention_efficiency
    per_token = 2 / (8 * S)  # two devices share the step's tokens
    matmul = est.time["matmul"] * peak * gpu.matmul_efficiency * per_token
    scores = est.time["attention"] * peak * attention_rate * per_token
    # the routed experts (dropless) run at the grouped GEMM's rate: the matmul term carries them scaled to it
    experts = flops.hardware_flops_breakdown(cfg.model, cfg.execution, S, attention=attention)["experts"]
    assert experts > 0
    assert matmul + scores == pytest.approx(
        flops.hardware_flops_per_token(cfg.model, cfg.execution, S, attention=attention)
        + experts * (gpu.matmul_efficiency / gpu.grouped_gemm_efficiency - 1), rel=1e-9)
    model_scores = flops.flops_breakdown(cfg.model, S)["attention_scores"]
    again = 4 * sum(forward_per_layer()[p] for p in ("qk", "av") if p in EXPECTED[(remat, attention)])
    assert scores == pytest.approx(model_scores + again, rel=1e-9)


# --- FP8: which FLOPs run as FP8 matmuls, and the FLOP-weighted peak ---

def test_fp8_flops_are_the_projections_of_the_fp8_blocks():
    per_block_attention = 6 * (H * (Q + 2 * K) + Q * H)
    per_block_mlp = 6 * 3 * H * F
    dense = small(num_layers=6, fp8=True, fp8_skip_layers=1)  # blocks 1..4 use FP8
    assert flops.fp8_flops_per_token(dense.model, dense.execution, S) == 4 * (per_block_attention + per_block_mlp)
    assert flops.fp8_flops_per_token(dense.model, dataclasses.replace(dense.execution, fp8=False), S) == 0
    # MoE every 2nd block; blocks 2 and 3 use FP8, block 3 is MoE: its attention is FP8, and of its 2 routed
    # experts a token visits, the forward (dropless: grouped GEMMs, whose backward multiplies on bf16 tensor cores)
    # or all (capacity mode: batched FP8 GEMMs)
    moe = small(num_layers=6, fp8=True, fp8_skip_layers=2, moe=dict(num_experts=4, experts_per_token=2, every=2))
    routed = 6 * 2 * 3 * H * F
    assert flops.fp8_flops_per_token(moe.model, moe.execution, S) == \
        2 * per_block_attention + 1 * per_block_mlp + routed / 3
    capacity = dataclasses.replace(moe.execution, moe_mode="capacity")
    assert flops.fp8_flops_per_token(moe.model, capacity, S) == 2 * per_block_attention + 1 * per_block_mlp + routed
    # with remat, the re-run projections are FP8 too (save_attention re-runs all four and gate/up)
    redo = dataclasses.replace(dense.execution, remat="save_attention")
    extra = 4 * (per_block_attention / 3 + 2 * 2 * H * F)
    assert flops.fp8_flops_per_token(dense.model, redo, S, hardware=True) == pytest.approx(
        flops.fp8_flops_per_token(dense.model, dense.execution, S) + extra, rel=1e-12)


@pytest.mark.parametrize("layers, skip, moe_every, experts", [
    (6, 0, 1, 0), (6, 1, 1, 0), (8, 2, 2, 4), (8, 2, 1, 4), (12, 3, 3, 4), (9, 0, 3, 4)])
def test_fp8_block_count_matches_the_models_layer_spans(layers, skip, moe_every, experts):
    from jaxtron.models.stack import layer_spans

    cfg = small(num_layers=layers, fp8=True, fp8_skip_layers=skip, moe=dict(every=moe_every, num_experts=experts))
    blocks = [i for span in layer_spans(cfg.model, cfg.execution) if span.fp8 for i in range(span.first, span.end)]
    moe_blocks = [i for i in blocks if experts and (i + 1) % moe_every == 0]
    assert flops.fp8_blocks(cfg.model, cfg.execution) == (len(blocks), len(blocks) - len(moe_blocks))


@pytest.mark.parametrize("share, expected_tflops", [(0.0, 989.4), (1.0, 1978.9), (0.5, 1319.2)])
def test_flop_weighted_peak(share, expected_tflops):
    # half the FLOPs at each rate: the harmonic mean 2 / (1/1978.9 + 1/989.4) = 1319.2 TFLOP/s
    peak, note = hardware.flop_weighted_peak(H100, "bfloat16", share * 1e15, 1e15)
    assert peak == pytest.approx(expected_tflops * 1e12, rel=1e-4)
    if 0 < share:
        assert "FLOP-weighted" in note and f"{share:.1%}" in note and "1978.9" in note and "989.4" in note
    assert "3958" not in note and peak != 1979e12  # never a sparsity figure


def test_fp8_run_mfu_uses_the_flop_weighted_peak():
    cfg = small(fp8=True)
    throughput = Throughput(cfg, 4, H100, "cudnn")
    f8 = flops.fp8_flops_per_token(cfg.model, cfg.execution, S)
    total = flops.flops_per_token(cfg.model, S)
    share = f8 / total
    assert 0.5 < share < 1 and throughput.fp8_share == pytest.approx(share)
    seconds_at_peak = (f8 / 1978.9e12 + (total - f8) / 989.4e12) * 8 * S / 4  # per device
    step = throughput(seconds_at_peak * 3, 3)  # each step exactly at the ideal time
    assert step["mfu"] == pytest.approx(1.0, rel=1e-9)
    assert step["mfu"] > step["tflops_per_device"] / 1978.9  # not the fp8 peak alone
    assert step["mfu"] < step["tflops_per_device"] / 989.4  # nor the bf16 peak the fp8 run used to get
    assert "FLOP-weighted" in throughput.peak_note and f"{share:.1%}" in throughput.peak_note
    cpu = Throughput(cfg, 4, "cpu", "xla")
    assert cpu(1.0, 1)["mfu"] is None and "mfu is null" in cpu.peak_note and f"{share:.1%}" in cpu.peak_note


def test_packed_rows_count_the_full_causal_row():
    # A row of S tokens packing 4 documents of S/4 tokens: the segment mask hides 3/4 of each causal row,
    # but the count stays the full row: q * S per token for QK^T and AV together (the causal half of 2 * q * S).
    cfg = small()
    packed = dataclasses.replace(cfg, data=DataConfig(source="store", path="unused", seq_len=S))
    per_token = 4 * (6 * (H * (Q + 2 * K) + Q * S + Q * H) + 6 * 3 * H * F) + 6 * H * V
    assert Throughput(packed, 1, H100, "xla").model_flops == 8 * S * per_token
    assert flops.flops_breakdown(cfg.model, S)["attention_scores"] == 4 * 6 * Q * S


@pytest.mark.slow
def test_compiled_gradient_recomputes_what_the_table_says():
    # XLA's cost analysis of the compiled gradient of the blocks (no logits, XLA attention, which computes the
    # full [s, s] scores: the non-causal count). Each policy adds its recompute over 'none', plus a little
    # elementwise work (norms, rotary, softmax) that is re-run with it. Whether the count of a scanned loop body
    # is multiplied by its trip count depends on the XLA version, so the scale comes from 'none'.
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from jaxtron.models import build_model

    b, s = 2, 128
    base = ModelConfig(vocab_size=64, embed_dim=256, num_layers=2, attention=dict(num_heads=2, num_kv_heads=1),
                       mlp_dim=768, max_seq_len=s)
    tokens = jnp.zeros((b, s), jnp.int32)

    def compiled_flops(run: ExecutionConfig) -> float:
        graphdef, params = nnx.split(build_model(base, run, 0, "xla"), nnx.Param)

        def blocks(p):
            return jnp.sum(nnx.merge(graphdef, p)(tokens).hidden)

        cost = jax.jit(jax.grad(blocks)).lower(params).compile().cost_analysis()
        return (cost[0] if isinstance(cost, list) else cost)["flops"] / (b * s)

    blocks_flops = flops.flops_per_token(base, s, causal=False) - 6 * 256 * 64  # without the logits
    none = compiled_flops(ExecutionConfig())
    scale = none / blocks_flops  # 1 / num_layers when a loop body counts once
    assert 0.49 < scale < 0.52 or 0.98 < scale < 1.03
    measured, table = {}, {}
    for remat in POLICIES[1:]:
        run = ExecutionConfig(remat=remat)
        measured[remat] = (compiled_flops(run) - none) / scale
        table[remat] = (flops.hardware_flops_per_token(base, run, s, causal=False)
                        - flops.flops_per_token(base, s, causal=False))
        assert 0.97 < measured[remat] / table[remat] < 1.25, (remat, measured[remat], table[remat])
    # 'full' does not re-run the MLP's down projection: a whole forward would be 30% more than the table
    assert measured["full"] < 1.1 * table["full"]
    # the two policies differ by AV alone (both re-run QK^T with XLA attention, and the same elementwise work)
    av = 2 * (2 * s * 256)  # forward of AV per token, 2 layers, non-causal
    assert measured["save_dots"] - measured["save_dots_attention"] == pytest.approx(av, rel=0.05)
    assert measured["full"] - measured["save_attention"] == pytest.approx(av, rel=0.05)


@pytest.mark.slow
def test_the_compiled_moe_gradient_does_not_rerun_the_experts_down_projection():
    """The router weights scale the experts' hidden values ahead of their down projection (models/experts.py), so
    the backward pass needs no expert output and remat='full' re-runs only the experts' gate and up GEMMs: XLA's
    count of the compiled gradient (capacity mode with room for exactly the routed rows: batched GEMMs of the routed
    FLOPs) is the table's. Re-running the down projection too would add a third to the experts' recompute."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from jaxtron.models import build_model

    b, s = 2, 128
    base = ModelConfig(vocab_size=64, embed_dim=128, num_layers=2, attention=dict(num_heads=2, num_kv_heads=1),
                       mlp_dim=512, max_seq_len=s, moe=dict(num_experts=4, experts_per_token=2))
    tokens = jnp.zeros((b, s), jnp.int32)

    def compiled_flops(run: ExecutionConfig) -> float:
        graphdef, params = nnx.split(build_model(base, run, 0, "xla"), nnx.Param)
        cost = jax.jit(jax.grad(lambda p: jnp.sum(nnx.merge(graphdef, p)(tokens).hidden))).lower(params).compile()
        cost = cost.cost_analysis()
        return (cost[0] if isinstance(cost, list) else cost)["flops"] / (b * s)

    runs = {remat: ExecutionConfig(remat=remat, moe_mode="capacity", capacity_factor=1.0) for remat in ("none", "full")}
    blocks_flops = flops.flops_per_token(base, s, causal=False) - 6 * 128 * 64  # without the logits
    none = compiled_flops(runs["none"])
    scale = none / blocks_flops  # 1 / num_layers when a loop body counts once
    assert 0.49 < scale < 0.52 or 0.98 < scale < 1.03, scale
    measured = (compiled_flops(runs["full"]) - none) / scale
    table = flops.hardware_flops_per_token(base, runs["full"], s, causal=False) - flops.flops_per_token(base, s,
                                                                                                         causal=False)
    down = flops.matmul_breakdown(base, s, causal=False)["experts_out"] / 3  # its forward
    assert 0.97 < measured / table < 1.1, (measured, table)
    assert measured < table + down / 2, (measured, table, down)
