"""The kernels a compiled GPU program calls, read from its optimized HLO text: library calls by their custom-call
target (cuDNN attention forward and backward, cuBLAS GEMMs by operand precision) and fusions by the emitter that
generates them (a Triton GEMM, a cuDNN fusion)."""

from __future__ import annotations

import collections
import re

from jaxtron.metrics.hlo import BLOCK_SCALED_GEMM, BLOCKWISE_FP8_KERNEL, definitions

_CUSTOM_CALL = re.compile(r'custom-call\(.*?custom_call_target="([^"]+)"')
_FUSION_KIND = re.compile(r'\bfusion\(.*?"kind":"(__[a-z_]+)"')


def kernels(hlo_text: str) -> dict[str, int]:
    """Kernel name -> how many calls the program text holds (a loop body's once): custom-call targets such as
    ``__cudnn$fmhaSoftmax`` or ``__cublas$lt$matmul$f8``, and fusion kinds such as ``__triton_gemm``."""
    counts: collections.Counter[str] = collections.Counter()
    for line in hlo_text.splitlines():
        match = _CUSTOM_CALL.search(line) or _FUSION_KIND.search(line)
        if match:
            counts[match.group(1)] += 1
    return dict(sorted(counts.items()))


def float8_operands(hlo_text: str) -> int:
    """How many GEMM calls (cuBLAS, cuDNN's block-scaled and jaxtron's blockwise kernel's custom calls, GEMM
    fusions) take a float8 operand. The text names operands without their types, so each operand's type is read
    where it is defined (instruction names are unique in a module)."""
    element_type = {name: dtype for name, (dtype, _) in definitions(hlo_text).items()}
    calls = 0
    for line in hlo_text.splitlines():
        gemm = "__cublas$" in line or BLOCK_SCALED_GEMM in line or BLOCKWISE_FP8_KERNEL in line
        if not gemm and not re.search(r'"kind":"__\w*gemm', line):
            continue
        operands = re.search(r"\b(?:custom-call|fusion)\((.*?)\)", line)
        names = re.findall(r"%[\w.\-]+", operands.group(1)) if operands else []
        if any(element_type.get(name, "").startswith("f8") for name in names):
            calls += 1
    return calls


# kernel name -> how people call it
_NAMES = {"__cudnn$fmhaSoftmax": "cuDNN attention forward", "__cudnn$fmhaSoftmaxBackward": "cuDNN attention backward",
          "__cublas$lt$matmul$f8": "cuBLASLt FP8 GEMM", "__cublas$lt$matmul": "cuBLASLt GEMM",
          "__cublas$gemm": "cuBLAS GEMM", "__cudnn$blockScaledDot": "cuDNN block-scaled GEMM",
          "__triton_nested_gemm_fusion": "Triton GEMM", "__triton_gemm": "Triton GEMM",
          # Pallas kernels (tokamax's grouped expert GEMM, for one): Mosaic GPU and Triton
          "mosaic_gpu_v2": "Mosaic GPU kernel", "__gpu$xla.gpu.triton": "Pallas Triton kernel",
          "__triton": "Triton fusion", "__custom_fusion": "custom fusion"}


def describe(counts: dict[str, int]) -> str:
    """``kernels``' counts in words, attention first, then GEMMs by library and operand precision, then the rest:
    'cuDNN attention forward 2, ..., Triton GEMM 30, custom fusion 5'."""
    summed: dict[str, int] = {}
    for name, count in counts.items():
        summed[_NAMES.get(name, name)] = summed.get(_NAMES.get(name, name), 0) + count
    order = list(dict.fromkeys(_NAMES.values()))
    ranked = sorted(summed, key=lambda n: (order.index(n) if n in order else len(order), n))
    return ", ".join(f"{name} {summed[name]}" for name in ranked)
