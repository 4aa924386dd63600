"""FLOP, parameter and peak accounting against published numbers (docs/references.md); metric writers."""

from __future__ import annotations

import glob
import json
import logging
import math
import os
import struct

import pytest

from jaxtron.config.schema import ExecutionConfig, ModelConfig, replace
from jaxtron.metrics import flops, hardware
from jaxtron.metrics.writers import MetricsWriter, format_line

# Narayanan et al. 2021 Table 1: params (B), heads, h, layers, GPUs, batch, TFLOP/s/GPU, % of peak.
NARAYANAN = [
    (1.7, 24, 2304, 24, 32, 512, 137, 44),
    (3.6, 32, 3072, 30, 64, 512, 138, 44),
    (7.5, 32, 4096, 36, 128, 512, 142, 46),
    (18.4, 48, 6144, 40, 256, 1024, 135, 43),
    (39.1, 64, 8192, 48, 512, 1536, 138, 44),
    (76.1, 80, 10240, 60, 1024, 1792, 140, 45),
    (145.6, 96, 12288, 80, 1536, 2304, 148, 47),
    (310.1, 128, 16384, 96, 1920, 2160, 155, 50),
    (529.6, 128, 20480, 105, 2520, 2520, 163, 52),
    (1008.0, 160, 25600, 128, 3072, 3072, 163, 52),
]
SEQ, VOCAB, A100_PEAK = 2048, 51200, 312e12


def gpt(heads: int, hidden: int, layers: int, vocab: int = VOCAB) -> ModelConfig:
    return ModelConfig(vocab_size=vocab, embed_dim=hidden, num_layers=layers,
                       attention=dict(num_heads=heads, num_kv_heads=heads), mlp_dim=4 * hidden, activation="gelu",
                       norm="layernorm", position_embedding="learned", max_seq_len=2048, tie_embeddings=True)


def llama3(hidden: int, layers: int, heads: int, mlp: int) -> ModelConfig:
    return ModelConfig(vocab_size=128256, embed_dim=hidden, num_layers=layers,
                       attention=dict(num_heads=heads, num_kv_heads=8), mlp_dim=mlp, activation="swiglu",
                       norm="rmsnorm", position_embedding="rope", tie_embeddings=False)


@pytest.mark.parametrize("row", NARAYANAN, ids=[f"{r[0]}B" for r in NARAYANAN])
def test_narayanan_table1_flops(row):
    # Per token per layer, non-causal MHA with f = 4h: attention 6(3h^2 + 2hs + h^2) + MLP 6*8h^2
    # = 72h^2 + 12hs; logits 6hV. Megatron's full recompute re-runs the layers' whole forward
    # (x4/3 -> 96h^2 + 16hs), not the logits. Times B*s this is exactly 72/96*B*s*l*h^2*(1 + s/6h + V/(12|16)lh).
    _, heads, h, layers, gpus, batch, tflops, pct = row
    cfg = gpt(heads, h, layers)
    tokens = batch * SEQ
    model = flops.flops_per_token(cfg, SEQ, causal=False) * tokens
    nar72 = flops.narayanan_flops_per_batch(batch, SEQ, layers, h, VOCAB, recompute=False)
    assert model == pytest.approx(nar72, rel=1e-9)
    nar96 = flops.narayanan_flops_per_batch(batch, SEQ, layers, h, VOCAB, recompute=True)
    logits = 6 * h * VOCAB * tokens
    assert nar96 == pytest.approx(model + (model - logits) / 3, rel=1e-12)
    # jax.checkpoint re-runs only what the backward pass needs: not the MLP's down projection (2 * 4h * h
    # forward FLOPs per token and layer), whose output only feeds the residual sum.
    hw = flops.hardware_flops_per_token(cfg, ExecutionConfig(remat="full"), SEQ, causal=False) * tokens
    assert hw == pytest.approx(nar96 - 8 * h * h * layers * tokens, rel=1e-12)
    # Published throughput (their FLOP count) -> iteration time -> back to TFLOP/s and % of the 312 dense peak.
    seconds = nar96 / (gpus * tflops * 1e12)
    achieved = nar96 / (seconds * gpus)
    assert round(achieved / A100_PEAK * 100) == pct
    assert hardware.mfu(achieved, A100_PEAK) == pytest.approx(tflops / 312, rel=1e-12)


def test_narayanan_145b_iteration_time():
    total = flops.narayanan_flops_per_batch(2304, SEQ, 80, 12288, VOCAB, recompute=True)
    seconds = total / (1536 * 148e12)
    assert seconds == pytest.approx(24.8, rel=0.01)
    assert round(148 / 312 * 100) == 47


@pytest.mark.parametrize("row", NARAYANAN, ids=[f"{r[0]}B" for r in NARAYANAN])
def test_narayanan_table1_params(row):
    published, heads, h, layers = row[:4]
    ours = flops.param_count(gpt(heads, h, layers))
    closed = flops.narayanan_param_count(layers, h, VOCAB, SEQ)
    # Their form has per layer 13h of biases and norms where we have 4h (LayerNorm scale+bias, no
    # biases) and no final norm: a relative gap of about 1e-4 at these sizes.
    assert ours == pytest.approx(closed, rel=1e-2)
    assert abs(ours - closed) < 10 * h * layers
    assert round(closed / 1e9, 1) == published  # the table column is their formula, rounded
    # Published values carry one decimal, i.e. up to 0.05B of rounding (2.9% of the 1.7B row).
    assert abs(ours - published * 1e9) <= max(0.015 * published * 1e9, 0.05e9)


@pytest.mark.parametrize("hidden,layers,heads,mlp,published", [
    (4096, 32, 32, 14336, 8.03e9), (8192, 80, 64, 28672, 70.55e9), (16384, 126, 128, 53248, 405.85e9)])
def test_llama3_param_count(hidden, layers, heads, mlp, published):
    assert flops.param_count(llama3(hidden, layers, heads, mlp)) == pytest.approx(published, rel=5e-3)


def test_llama3_8b_param_count_exact():
    # Per layer: wq 4096^2 + wk,wv 2*4096*1024 + wo 4096^2 + MLP 3*4096*14336 + 2 norms 2*4096.
    per_layer = 16_777_216 + 8_388_608 + 16_777_216 + 176_160_768 + 8_192
    expected = 32 * per_layer + 2 * 128_256 * 4096 + 4096  # + embed, head, final norm
    assert flops.param_count(llama3(4096, 32, 32, 14336)) == expected == 8_030_261_248


def test_gpt3_175b_param_count():
    cfg = gpt(96, 12288, 96, vocab=50304)
    assert flops.param_count(cfg) == pytest.approx(175e9, rel=1e-2)


def test_causal_scores_are_half_of_non_causal():
    cfg = llama3(4096, 32, 32, 14336)
    causal = flops.flops_breakdown(cfg, 4096, causal=True)
    full = flops.flops_breakdown(cfg, 4096, causal=False)
    assert causal["attention_scores"] * 2 == full["attention_scores"]
    assert {k: v for k, v in causal.items() if k != "attention_scores"} == \
           {k: v for k, v in full.items() if k != "attention_scores"}
    delta = flops.flops_per_token(cfg, 4096, causal=False) - flops.flops_per_token(cfg, 4096)
    assert delta == 6 * 32 * 4096 * 4096  # 6 * L * q * s


def test_llama3_8b_flops_per_token_by_hand():
    # 6 * (matmul params without the input embedding) + causal attention 6 * L * q * s.
    matmul_per_layer = 4096 * (4096 + 2 * 1024) + 4096 * 4096 + 3 * 4096 * 14336  # 218,103,808
    head = 128_256 * 4096  # 525,336,576
    expected = 6 * (32 * matmul_per_layer + head) + 6 * 32 * 4096 * 4096
    assert expected == 48_249_176_064
    assert flops.flops_per_token(llama3(4096, 32, 32, 14336), 4096) == expected


def test_h200_published_llama3_8b_mfu():
    # docs/references.md: 10,471 tok/s on one H200 is 57.8% by 6P + 12*L*h*s, about 51% by our accounting.
    cfg = llama3(4096, 32, 32, 14336)
    peak, _ = hardware.peak_flops("NVIDIA H200", "bfloat16")
    ours = hardware.mfu(10_471 * flops.flops_per_token(cfg, 4096), peak)
    theirs = hardware.mfu(10_471 * (6 * flops.param_count(cfg) + 12 * 32 * 4096 * 4096), peak)
    assert round(ours * 100) == 51
    assert round(theirs * 100, 1) == 57.8


@pytest.mark.parametrize("kind,dtype,expected", [
    ("NVIDIA H100 80GB HBM3", "bfloat16", 989.4e12),
    ("NVIDIA H100 80GB HBM3", "float16", 989.4e12),
    ("NVIDIA H100 80GB HBM3", "fp8", 1978.9e12),
    ("NVIDIA H100 PCIe", "bfloat16", 756e12),
    ("NVIDIA H100 PCIe", "fp8", 1513e12),
    ("NVIDIA H200", "bfloat16", 989.4e12),
    ("NVIDIA H200", "fp8", 1978.9e12),
    ("NVIDIA A100-SXM4-80GB", "bfloat16", 312e12),
    ("NVIDIA A100-PCIE-40GB", "float16", 312e12),
    ("NVIDIA B200", "bfloat16", 2250e12),
    ("NVIDIA B200", "fp8", 4500e12),
    ("NVIDIA B200", "fp4", 9000e12),
    ("NVIDIA GB200", "bfloat16", 2500e12),
    ("NVIDIA GB200", "float4_e2m1fn", 10000e12),
])
def test_peak_flops_known(kind, dtype, expected):
    peak, note = hardware.peak_flops(kind, dtype)
    assert peak == pytest.approx(expected, rel=1e-12)
    assert "dense" in note


@pytest.mark.parametrize("kind,dtype", [
    ("cpu", "bfloat16"), ("TFRT_CPU_0", "float32"), ("NVIDIA GeForce RTX 4090", "bfloat16"),
    ("NVIDIA H200 NVL", "bfloat16"), ("NVIDIA H100 NVL", "bfloat16"), ("NVIDIA GH200 480GB", "bfloat16"),
    ("NVIDIA GB300", "bfloat16"), ("NVIDIA A100-SXM4-80GB", "fp8"), ("NVIDIA H100 80GB HBM3", "fp4"),
    ("NVIDIA H100 80GB HBM3", "int8"),
])
def test_peak_flops_unknown(kind, dtype):
    peak, note = hardware.peak_flops(kind, dtype)
    assert peak is None
    assert repr(kind) in note and "mfu is null" in note
    assert hardware.mfu(1e12, peak) is None


@pytest.mark.parametrize("kind", ["NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-40GB", "NVIDIA H200"])
def test_float32_has_no_peak_because_tf32_or_fp32_depends_on_precision(kind):
    peak, note = hardware.peak_flops(kind, "float32")
    assert peak is None and "TF32" in note and "mfu is null" in note


def test_never_sparse_peaks():
    peak, _ = hardware.peak_flops("NVIDIA H100 80GB HBM3", "bf16")
    assert peak == 989.4e12 and peak != 1979e12
    for model in hardware.DENSE_PEAK_TFLOPS.values():
        assert not {1979.0, 3958.0} & set(model.values())
    assert hardware.mfu(494.7e12, 989.4e12) == pytest.approx(0.5)


def _read_scalars(path: str) -> dict[str, list[tuple[int, float]]]:
    """Parses a TFRecord events file: u64 length, u32 crc, data, u32 crc per record."""
    from tensorboardX.proto import event_pb2
    scalars: dict[str, list[tuple[int, float]]] = {}
    with open(path, "rb") as f:
        data = f.read()
    pos = 0
    while pos < len(data):
        (length,) = struct.unpack("<Q", data[pos:pos + 8])
        event = event_pb2.Event.FromString(data[pos + 12:pos + 12 + length])
        pos += 12 + length + 4
        for value in event.summary.value:
            scalars.setdefault(value.tag, []).append((event.step, value.simple_value))
    return scalars


def test_metrics_writer(tmp_path, caplog):
    workdir = str(tmp_path / "run")
    records = [
        (1, {"loss": 3.5, "grad_norm": 1.5, "learning_rate": 1e-4, "tokens_per_sec": 1000.0, "mfu": None}),
        (2, {"loss": float("nan"), "grad_norm": float("inf"), "learning_rate": 2e-4, "tokens_per_sec": 1100.0,
             "mfu": 0.25}),
        (3, {"eval/loss": 2.75}),
    ]
    with caplog.at_level(logging.INFO, logger="jaxtron.metrics.writers"):
        writer = MetricsWriter(workdir, total_steps=3, use_tqdm=False)
        for step, metrics in records:
            writer.write(step, metrics)
        writer.close()
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        lines = [json.loads(line) for line in f]
    assert [line["step"] for line in lines] == [1, 2, 3]
    assert lines[0] == {"step": 1, "loss": 3.5, "grad_norm": 1.5, "learning_rate": 1e-4, "tokens_per_sec": 1000.0,
                        "mfu": None}
    assert lines[1]["loss"] is None and lines[1]["grad_norm"] is None and lines[1]["mfu"] == 0.25
    assert lines[2] == {"step": 3, "eval/loss": 2.75}
    assert "step 2/3 | loss nan | grad_norm inf | lr 2.0e-04 | 1.10e+03 tok/s | mfu 25.0%" in caplog.text
    assert "mfu n/a" in caplog.text
    events = glob.glob(os.path.join(workdir, "events.out.tfevents*"))
    assert len(events) == 1
    scalars = _read_scalars(events[0])
    assert scalars["train/loss"][0] == (1, 3.5) and math.isnan(scalars["train/loss"][1][1])
    assert scalars["eval/loss"] == [(3, 2.75)]
    assert "train/mfu" in scalars and [s for s, _ in scalars["train/mfu"]] == [2]


def test_format_line():
    line = format_line(10, 200, {"loss": 3.21012, "grad_norm": 1.0234, "learning_rate": 3e-4, "tokens_per_sec": 12345.0,
                                 "tflops_per_device": 12.34, "mfu": None, "step_time_s": 0.5121})
    assert line == ("step 10/200 | loss 3.2101 | grad_norm 1.02 | lr 3.0e-04 | 1.23e+04 tok/s | "
                    "12.3 TFLOP/s/dev | mfu n/a | 0.512 s/step")


def test_deepseek_v3_flops_by_hand():
    """DeepSeek-V3 (configs/deepseek_v3.py) at 4096 tokens, every product written out: latent attention's
    projections (query 7168x1536 and 1536 x 128 heads x 192, latent 7168 x (512 + 64) and 512 x 128 x (128 + 128),
    output 128 x 128 x 7168), 3 dense SwiGLUs of 18432, 58 MoE blocks of 8 routed + 1 shared expert of 2048 and a
    router over 256, the logits over 129280; scores over 192 (QK) and 128 (AV) per head, causal half."""
    import os

    from jaxtron.config.loader import load_config
    cfg = load_config(os.path.join(os.path.dirname(os.path.dirname(__file__)), "configs", "deepseek_v3.py")).model
    attention = 7168 * 1536 + 1536 * 128 * 192 + 7168 * 576 + 512 * 128 * 256 + 128 * 128 * 7168
    dense, moe = 3 * 7168 * 18432, (8 + 1) * 3 * 7168 * 2048 + 7168 * 256
    matrices = 61 * attention + 3 * dense + 58 * moe + 7168 * 129280
    assert matrices == 36_624_596_992  # a token's matrix parameters: the published 37B active, less norms/tables
    scores = 61 * 128 * (192 + 128) * 4096 / 2
    assert flops.flops_per_token(cfg, 4096) == 6 * (matrices + scores) == 250_449_887_232
    # the same matrices from the parameter count: active parameters less the embedding table, norms and biases
    norms = 61 * (2 * 7168 + 1536 + 512) + 7168 + 58 * 256
    assert flops.param_count(cfg, active=True) - 129280 * 7168 - norms == matrices
    assert flops.param_count(cfg) == 671_026_419_200
    parts = flops.flops_breakdown(cfg, 4096)
    assert parts["experts"] == 6 * 58 * 8 * 3 * 7168 * 2048 and parts["router"] == 6 * 58 * 7168 * 256
    assert parts["mlp"] == 6 * (3 * dense + 58 * 3 * 7168 * 2048)  # dense blocks and the shared experts


def test_deepseek_v3_multi_token_prediction_module_by_hand():
    """One MTP depth adds its norms (embedding, hidden, output), the 2h x h projection and an MoE block, and in
    FLOPs that block, the projection and its own logits."""
    import os

    from jaxtron.config.loader import load_config
    cfg = load_config(os.path.join(os.path.dirname(os.path.dirname(__file__)), "configs", "deepseek_v3.py")).model
    with_mtp = replace(cfg, mtp=dict(depth=1))
    attention = 7168 * 1536 + 1536 + 1536 * 128 * 192 + 7168 * 576 + 512 + 512 * 128 * 256 + 128 * 128 * 7168
    moe_block = 2 * 7168 + attention + 257 * 3 * 7168 * 2048 + 7168 * 256 + 256
    module = 3 * 7168 + 2 * 7168 * 7168 + moe_block
    assert flops.param_count(with_mtp) - flops.param_count(cfg) == module
    block_flops = 6 * (attention - 1536 - 512 + 9 * 3 * 7168 * 2048 + 7168 * 256 + 128 * 320 * 4096 / 2)
    assert flops.flops_breakdown(with_mtp, 4096)["mtp"] == block_flops + 6 * (7168 * 129280 + 2 * 7168 * 7168)


def test_local_layers_count_their_windows_band_by_hand():
    """Gemma 3 12B's pattern at 8192 tokens: 40 local layers of 1024 keys and 8 global ones. A local query sees at
    most 1024 keys, the first 1024 queries fewer: 1024 - 1024^2 / (2 * 8192) = 960 on average; a global one 4096."""
    from jaxtron.config.loader import load_config
    from jaxtron.metrics.hlo import attention_flops

    cfg = load_config(os.path.join(os.path.dirname(__file__), "..", "configs", "gemma3.py") + ":12b").model
    assert sum(cfg.is_local_block(i) for i in range(48)) == 40
    assert flops.attended_keys(cfg, 8192) == 40 * 960 + 8 * 4096
    q = 16 * 256  # heads x head size
    assert flops.flops_breakdown(cfg, 8192)["attention_scores"] == 6 * 2 * q * (40 * 960 + 8 * 4096)
    unwindowed = replace(cfg, attention=dict(window=0, global_every=0), rope=dict(local_theta=0.0))
    assert flops.attended_keys(unwindowed, 8192) == 48 * 4096
    assert flops.attended_keys(cfg, 1024) == 48 * 512  # a window no shorter than the row is the whole causal row
    # the step budget's pricing of a cuDNN call with cuDNN's window, [1, 8192, 16, 256] queries
    call = ('%c = (bf16[1,16,8192,256]{3,1,2,0}, f32[1,16,8192]{2,1,0}, u8[0]{0}) custom-call(%q, %k, %v), '
            'custom_call_target="__cudnn$fmhaSoftmax", operand_layout_constraints={bf16[1,8192,16,256]{3,2,1,0}, '
            'bf16[1,8192,8,256]{3,2,1,0}, bf16[1,8192,8,256]{3,2,1,0}}, '
            'backend_config={"cudnn_fmha_backend_config":{"mask_type":"CAUSAL", "sliding_window_length": 1024}}')
    assert attention_flops(call, False) == 2 * 16 * (8192 * 1024 - 1024 * 1024 / 2) * (256 + 256)
    assert attention_flops(call.replace('"sliding_window_length": 1024', '"sliding_window_length": 0'), False) \
        == 2 * 16 * 8192 * (8192 - 4096) * (256 + 256)
