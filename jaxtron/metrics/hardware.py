"""Dense datasheet peaks per device and MFU.

Only DENSE tensor-core peaks are MFU denominators (docs/layout.md, "Numbers are honest"): the 1979 / 3958 TFLOP/s
H100 figures are with 2:4 structured sparsity and never appear here. Nothing is guessed: a device or precision
without a datasheet number in this table gets ``None`` and MFU is reported as null.
"""

from __future__ import annotations

import math
import re

# Dense peak TFLOP/s per GPU (bf16 == fp16 on these parts). None: the part has no such mode or we have
# no checked datasheet number for it.
# "float32" has no entry: XLA runs fp32 matmuls on GPUs as TF32 on tensor cores by default and as true
# FP32 on CUDA cores at 'highest' precision, so no single datasheet number is an honest denominator.
DENSE_PEAK_TFLOPS: dict[str, dict[str, float | None]] = {
    "H100 SXM": {"bfloat16": 989.4, "float16": 989.4, "fp8": 1978.9, "float32": None},
    "H200 SXM": {"bfloat16": 989.4, "float16": 989.4, "fp8": 1978.9, "float32": None},
    "H100 PCIe": {"bfloat16": 756.0, "float16": 756.0, "fp8": 1513.0, "float32": None},
    "A100": {"bfloat16": 312.0, "float16": 312.0, "fp8": None, "float32": None},
    # Blackwell: HGX B200 (1000 W) and a GPU of GB200 NVL72 (1200 W); fp4 is NVFP4's dense rate, which MXFP8 does
    # not reach (it runs at the fp8 one)
    "B200": {"bfloat16": 2250.0, "float16": 2250.0, "fp8": 4500.0, "fp4": 9000.0, "float32": None},
    "GB200": {"bfloat16": 2500.0, "float16": 2500.0, "fp8": 5000.0, "fp4": 10000.0, "float32": None},
}

_DTYPE_ALIASES = {
    "float32": "float32", "fp32": "float32", "f32": "float32",
    "bfloat16": "bfloat16", "bf16": "bfloat16",
    "float16": "float16", "fp16": "float16", "f16": "float16", "half": "float16",
    "fp8": "fp8", "float8": "fp8", "float8_e4m3fn": "fp8", "float8_e5m2": "fp8",
    "fp4": "fp4", "float4": "fp4", "float4_e2m1fn": "fp4",
}


def _word(name: str, text: str) -> bool:
    return re.search(rf"(?<![a-z0-9]){name}(?![a-z0-9])", text) is not None


def device_model(device_kind: str) -> str | None:
    """Maps a jax ``device.device_kind`` (e.g. 'NVIDIA H100 80GB HBM3') to a key of the peak table.

    Variants with different clocks or power and no checked number here (H100/H200 NVL, GH200, H800, A800, ...)
    map to None rather than to their nearest relative.
    """
    kind = device_kind.strip().lower()
    if _word("nvl", kind):
        return None  # NVL cards run at lower power and clocks than SXM parts
    if _word("h100", kind):
        return "H100 PCIe" if "pcie" in kind else "H100 SXM"
    if _word("h200", kind):  # 'gh200' does not match: the word check needs a boundary before 'h'
        return "H200 SXM"
    if _word("a100", kind):  # SXM4 and PCIe A100 share the 312 TFLOP/s dense peak
        return "A100"
    if _word("b200", kind):  # 'gb200' does not match
        return "B200"
    if _word("gb200", kind):
        return "GB200"
    return None


def peak_flops(device_kind: str, dtype: str) -> tuple[float | None, str]:
    """Dense peak FLOP/s of one device at ``dtype`` ('float32', 'bfloat16', 'float16', 'fp8', 'fp4').

    Returns (peak or None, a one-line note saying where the number came from or why there is none).
    """
    precision = _DTYPE_ALIASES.get(dtype.strip().lower())
    model = device_model(device_kind)
    if precision is None or model is None:
        return None, f"no dense peak known for device {device_kind!r} at {dtype}; mfu is null"
    tflops = DENSE_PEAK_TFLOPS[model].get(precision)
    if tflops is None and precision == "float32":
        return None, (f"no single dense peak for float32 on {model} (TF32 or CUDA-core FP32 depending on the "
                      "matmul precision); mfu is null")
    if tflops is None:
        return None, f"no dense peak known for device {device_kind!r} ({model}) at {dtype}; mfu is null"
    note = f"{model} dense {precision} datasheet peak {tflops:g} TFLOP/s per device"
    return tflops * 1e12, note


def mfu(flops_per_sec_per_device: float, peak: float | None) -> float | None:
    """Model FLOPs utilisation as a fraction of ``peak`` (None when the peak is unknown)."""
    if peak is None or peak <= 0 or not math.isfinite(flops_per_sec_per_device):
        return None
    return flops_per_sec_per_device / peak


def weighted_peak(fp8_flops: float, total_flops: float, fp8_peak: float, rest_peak: float) -> float:
    """The FLOP/s of a step whose ``fp8_flops`` of ``total_flops`` run at ``fp8_peak`` and the rest at
    ``rest_peak``: total / (fp8 / fp8 peak + rest / rest peak)."""
    return total_flops / (fp8_flops / fp8_peak + (total_flops - fp8_flops) / rest_peak)


def flop_weighted_peak(device_kind: str, dtype: str, fp8_flops: float, total_flops: float,
                       low: str = "fp8") -> tuple[float | None, str]:
    """Dense peak FLOP/s of one device for a step whose ``fp8_flops`` of ``total_flops`` are low-precision
    matmuls (``low``: 'fp8', or 'fp4' for NVFP4's) and the rest run at ``dtype``: total / (low / low peak + rest /
    ``dtype`` peak), the rate of a step in which every FLOP runs at the dense peak of its own precision. Without
    such FLOPs this is ``peak_flops(device_kind, dtype)``.

    Returns (peak or None, a one-line note naming both peaks and the low-precision share).
    """
    if fp8_flops <= 0:
        return peak_flops(device_kind, dtype)
    share = fp8_flops / total_flops
    fp8_peak, fp8_note = peak_flops(device_kind, low)
    rest_peak, rest_note = peak_flops(device_kind, dtype)
    if fp8_peak is None or rest_peak is None:
        missing = rest_note if rest_peak is None else fp8_note
        return None, f"{missing} ({low.upper()} matmuls are {share:.1%} of the FLOPs)"
    peak = weighted_peak(fp8_flops, total_flops, fp8_peak, rest_peak)
    precision = _DTYPE_ALIASES[dtype.strip().lower()]
    note = (f"{device_model(device_kind)} FLOP-weighted dense peak {peak / 1e12:.5g} TFLOP/s per device: "
            f"{low.upper()} matmuls are {share:.1%} of the FLOPs, counted at the {low} peak {fp8_peak / 1e12:g}, the "
            f"rest at the {precision} peak {rest_peak / 1e12:g}")
    return peak, note
