"""Reading compiled XLA programs from their optimized HLO text: the computations and how often each runs per
execution (loop bodies once per iteration), the element type and shape every instruction defines, and the matmul
FLOPs the program executes, library calls included.

XLA's own cost analysis counts fusions but gives nothing (-1) for custom calls, and a program compiled for a GPU
without one has no cost analysis at all; its matmuls are mostly custom calls (cuBLAS GEMMs, cuDNN attention), so
``matmul_flops`` counts them from their shapes.
"""

from __future__ import annotations

import json
import math
import re

DTYPE_BYTES = {"f32": 4, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8, "s16": 2, "u16": 2,
               "pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1}
SHAPE = re.compile(r"(\w+)\[([\d,]*)\]")


def type_bytes(type_text: str) -> int:
    """Bytes of the arrays an HLO type names, a tuple's parts summed (what holds no data, such as a token, none)."""
    return sum(DTYPE_BYTES.get(dtype, 0) * math.prod(int(d) for d in dims.split(",") if d)
               for dtype, dims in SHAPE.findall(type_text))


_COMPUTATION = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) \(")
_CALLS = re.compile(r"(?:body|condition|calls|to_apply|true_computation|false_computation)=%?([\w.\-]+)"
                    r"|branch_computations=\{([^}]*)\}")
TRIPS = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
# a conditional built under jax.named_scope(taken(k, n)) takes its branch with work in k of every n runs
_TAKEN = re.compile(r'op_name="[^"]*/taken_(\d+)_of_(\d+)/')


def taken(k: int, n: int) -> str:
    """The named scope that tells ``runs_per_execution`` a conditional inside it does its work (the branch that
    has any) in ``k`` of every ``n`` runs: the 1F1B loop runs its backward phase in all but its fill's
    iterations, say."""
    return f"taken_{k}_of_{n}"


def once_in(n: int) -> str:
    """``taken(1, n)``: a loop over a pipeline stage's periods shifts the activations in its last period only."""
    return taken(1, n)

# "%name = f8e4m3fn[64,32]{1,0} ..." -> (%name, f8e4m3fn, "64,32"): every instruction with an array result
_DEFINITION = re.compile(r"^\s*(?:ROOT\s+)?(%[\w.\-]+) = ([a-z][a-z0-9]*)\[([\d,]*)\]", re.MULTILINE)


def computations(hlo_text: str) -> tuple[dict[str, list[str]], str | None]:
    """{computation name: its instruction lines} and the entry computation's name."""
    comps: dict[str, list[str]] = {}
    entry, current = None, None
    for line in hlo_text.splitlines():
        match = _COMPUTATION.match(line)
        if match and line.rstrip().endswith("{"):
            current = match.group(1)
            comps[current] = []
            if line.startswith("ENTRY"):
                entry = current
        elif line.startswith("}"):
            current = None
        elif current is not None:
            comps[current].append(line)
    return comps, entry


def runs_per_execution(hlo_text: str) -> tuple[dict[str, list[str]], dict[str, int]]:
    """(the computations, how many times each runs per execution): a while body runs its known trip count times,
    everything it calls as often, each branch of a conditional as often as the conditional (an upper bound: a
    kernel that skips blocks by a condition, such as causal blockwise attention, is counted as if it skipped none)
    unless the conditional says how often it does its work (``taken``); a computation nothing reaches runs 0
    times."""
    comps, entry = computations(hlo_text)
    if entry is None:
        return comps, {}
    runs = {entry: 1}
    stack = [entry]
    while stack:
        name = stack.pop()
        for line in comps.get(name, []):
            trips = TRIPS.search(line)
            share = _TAKEN.search(line) if " conditional(" in line else None
            for one, several in _CALLS.findall(line):
                for callee in (c.strip().lstrip("%") for c in (one or several).split(",")):
                    if callee not in comps:
                        continue
                    times = runs[name] * (int(trips.group(1)) if trips and " while(" in line else 1)
                    if share:
                        times = -(-times * int(share.group(1)) // int(share.group(2)))
                    if runs.get(callee, 0) < times:
                        runs[callee] = times
                        stack.append(callee)
    return comps, runs


def definitions(hlo_text: str) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Instruction name -> (element type, dimensions) of every array-valued instruction (names are unique in a
    module; the text names operands without their types, so this is where an operand's type is read)."""
    return {name: (dtype, tuple(int(d) for d in dims.split(",") if d))
            for name, dtype, dims in _DEFINITION.findall(hlo_text)}


def result_shape(line: str) -> tuple[int, ...]:
    """Dimensions of an instruction's result, the first element of a tuple result."""
    match = SHAPE.search(line.split("=", 1)[1]) if "=" in line else None
    return tuple(int(d) for d in match.group(2).split(",") if d) if match else ()


_OPERANDS = re.compile(r"\b(?:dot|custom-call|fusion)\((.*?)\)")
_CONTRACTING = re.compile(r"lhs_contracting_dims=\{([\d,]*)\}")
_LAYOUT_CONSTRAINTS = re.compile(r"operand_layout_constraints=\{(.*?\})\}")  # shapes with their layouts
GEMM_TARGETS = ("__cublas$gemm", "__cublas$lt$matmul", "__cublas$lt$matmul$f8")
# cuDNN's block-scaled GEMM on Blackwell (MXFP8, NVFP4): [B, M, K] x [B, N, K] -> [B, M, N], scales beside
BLOCK_SCALED_GEMM = "__cudnn$blockScaledDot"
# jaxtron's blockwise FP8 GEMM (ops/blockwise_fp8.py's KERNEL_NAME, a Pallas call): [M, K] x [N, K] -> [M, N]
BLOCKWISE_FP8_KERNEL = "jaxtron_blockwise_fp8_gemm"
ATTENTION_FORWARD = ("__cudnn$fmhaSoftmax", "__cudnn$fmhaSoftmaxDropout")
ATTENTION_BACKWARD = ("__cudnn$fmhaSoftmaxBackward", "__cudnn$fmhaSoftmaxDropoutBackward")
_TARGET = re.compile(r'custom_call_target="([^"]+)"')


def _operands(line: str) -> list[str]:
    found = _OPERANDS.search(line)
    return re.findall(r"%[\w.\-]+", found.group(1)) if found else []


def gemm_flops(line: str, shapes: dict, config: dict | None) -> float:
    """2 x output elements x contracted size, of a dot or a cuBLAS call (its dimension numbers in the config)."""
    operands = _operands(line)
    lhs = shapes.get(operands[0], (None, ()))[1] if operands else ()
    if config is not None:
        dims = config.get("gemm_backend_config", {}).get("dot_dimension_numbers", {})
        contracting = [int(d) for d in dims.get("lhs_contracting_dimensions", [])]
    else:
        found = _CONTRACTING.search(line)
        contracting = [int(d) for d in found.group(1).split(",") if d] if found else []
    if not lhs or any(d >= len(lhs) for d in contracting):
        return 0.0
    return 2.0 * math.prod(result_shape(line)) * math.prod(lhs[d] for d in contracting)


def block_scaled_flops(line: str, shapes: dict) -> float:
    """2 x output elements x K of a block-scaled GEMM whose first operand holds K last (cuDNN's [B, M, K] x
    [B, N, K]; jaxtron's blockwise kernel's [M, K] x [N, K])."""
    operands = _call_operands(line, None, shapes)
    return 2.0 * math.prod(result_shape(line)) * operands[0][-1] if operands and operands[0] else 0.0


def _call_operands(line: str, dtypes: tuple[str, ...] | None = None,
                   shapes: dict | None = None) -> list[tuple[int, ...]]:
    """A custom call's operand shapes (of the element types ``dtypes``: all if None), from its layout constraints,
    else (a Triton kernel's call has none) from the operands' definitions in ``shapes``."""
    found = _LAYOUT_CONSTRAINTS.search(line)
    if found:
        typed = [(dtype, tuple(int(d) for d in dims.split(",") if d)) for dtype, dims in SHAPE.findall(found.group(1))]
    else:
        typed = [shapes[name] for name in _operands(line) if name in (shapes or {})]
    return [dims for dtype, dims in typed if dtypes is None or dtype in dtypes]


def attention_flops(line: str, backward: bool) -> float:
    """A cuDNN flash-attention call's matmuls, from its operands [batch, length, heads, head size] (query, key,
    value): forward QK^T and PV; backward the recomputed QK^T, dP, dV, dQ and dK. A causal mask halves the score
    pairs (a query block of T over S >= T keys sees T x (S - T/2) of them); a sliding window of W < T keys
    (``sliding_window_length``) leaves the band, T x W - W^2 / 2."""
    operands = _call_operands(line)
    if len(operands) < 3:
        return 0.0
    q, k, v = operands[:3]
    batch, length, heads, qk = q
    keys, dv = k[1], v[3]
    window = re.search(r'"sliding_window_length":\s*"?(\d+)', line)
    window = int(window.group(1)) if window else 0
    if "CAUSAL" in line and 0 < window < length:
        pairs = batch * heads * (length * window - window * window / 2)
    else:
        pairs = batch * heads * (length * (keys - length / 2) if "CAUSAL" in line else length * keys)
    return 2.0 * pairs * ((3 * qk + 2 * dv) if backward else (qk + dv))


_FLOAT = ("bf16", "f16", "f32", "f8e4m3fn", "f8e5m2")


def grouped_gemm_flops(line: str, shapes: dict) -> float:
    """A grouped (ragged) GEMM kernel's matmul FLOPs, 2 x M x K x N, from its float operands and its result: the
    forward [M, K] x [G, K, N] -> [M, N], the input gradient [M, N] x [G, N, K] -> [M, K], and the weight gradient
    from [M, K] and [M, N] (or [K, M]) -> [G, K, N]. A library kernel is a custom call XLA cannot see into; its op
    name says what it computes. Under ``jax.vmap`` (a pipeline's stages) every shape gains leading batch dimensions,
    as many as the rows operand has beyond two; the kernel computes once per batch element."""
    floats = [o for o in _call_operands(line, _FLOAT, shapes) if len(o) >= 2]  # not a kernel's scales
    batch_rank = len(floats[0]) - 2 if floats else -1  # the rows come first
    if batch_rank < 0:
        return 0.0
    result = result_shape(line)
    batch, result = math.prod(result[:batch_rank]), result[batch_rank:]
    flat = [o[batch_rank:] for o in floats if len(o) == batch_rank + 2]
    if not flat:
        return 0.0
    if len(result) == 3:  # the weight gradient [G, K, N]: M is what is left of a 2-D operand beside K or N
        _, k, n = result
        a = flat[0]
        rows = math.prod(a) // (k if k in a else n)
        return 2.0 * batch * rows * k * n
    if len(result) == 2:  # [M, N] from [M, K]
        rows, n = result
        a = flat[0]
        return 2.0 * batch * rows * n * (math.prod(a) // rows)
    return 0.0


def backend_config(line: str) -> dict:
    start = line.find("backend_config={")
    if start < 0:
        return {}
    try:
        return json.JSONDecoder().raw_decode(line, start + len("backend_config="))[0]
    except ValueError:
        return {}


def matmul_flops(hlo_text: str) -> dict[str, float]:
    """FLOPs of the matmuls one execution of a compiled program runs, per device, by kind: ``dot`` (XLA dots,
    inside fusions too: Triton GEMMs, XLA:CPU's), ``gemm`` (cuBLAS calls, cuDNN's block-scaled ones, jaxtron's
    blockwise FP8 kernel), ``attention`` (cuDNN flash attention, forward and backward) and ``grouped_gemm`` (a
    grouped expert GEMM kernel, such as tokamax's ``ragged_dot``, by its op name), each loop body once per
    iteration and each branch of a conditional as if it were taken. Elementwise work is not counted."""
    comps, runs = runs_per_execution(hlo_text)
    shapes = definitions(hlo_text)
    out = {"dot": 0.0, "gemm": 0.0, "attention": 0.0, "grouped_gemm": 0.0}
    for name, lines in comps.items():
        times = runs.get(name, 0)
        if not times:
            continue
        for line in lines:
            if " dot(" in line:
                out["dot"] += times * gemm_flops(line, shapes, None)
                continue
            target = _TARGET.search(line)
            if not target:
                continue
            if "RaggedDot" in line:  # tokamax's op name in the kernel call's metadata, or a jaxtron kernel's name
                out["grouped_gemm"] += times * grouped_gemm_flops(line, shapes)
            elif BLOCKWISE_FP8_KERNEL in line:
                out["gemm"] += times * block_scaled_flops(line, shapes)
            elif target.group(1) in GEMM_TARGETS:
                out["gemm"] += times * gemm_flops(line, shapes, backend_config(line))
            elif target.group(1) == BLOCK_SCALED_GEMM:
                out["gemm"] += times * block_scaled_flops(line, shapes)
            elif target.group(1) in ATTENTION_FORWARD + ATTENTION_BACKWARD:
                out["attention"] += times * attention_flops(line, target.group(1) in ATTENTION_BACKWARD)
    return out
