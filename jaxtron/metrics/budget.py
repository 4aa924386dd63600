"""The step's time budget: a lower bound on one execution of a compiled GPU program, kernel by kernel, read from its
optimized HLO text.

Each kernel the program launches is priced at the ceiling that binds it: a GEMM's FLOPs at the measured matmul
rate of its operands' precision (bf16, FP8; float32 operands at the TF32 rate, half the bf16 one), a cuDNN
attention call's FLOPs at the attention kernel's rate, a grouped expert GEMM's at the grouped kernel's, and every
other kernel's bytes read and written at the measured copy bandwidth (a GEMM too small to be compute-bound is
priced by its bytes). Every launch adds a fixed cost. Loop bodies count once per iteration. Collectives are listed
by bytes, not priced: on one GPU there are none, and on several the planner prices and overlaps them.

What it cannot see: autotuned kernel choices (a deviceless compile keeps XLA's defaults; their rates are the
ceilings'), overlap between kernels (none: one stream), and a kernel slower than its bound. The ratio of a
measured step to its bound says how much of that there is; ``benchmarks/step_budget.md`` keeps the table.
"""

from __future__ import annotations

import dataclasses
import re

from jaxtron.metrics.collectives import COLLECTIVES, collectives
from jaxtron.metrics.hlo import (
    ATTENTION_BACKWARD,
    ATTENTION_FORWARD,
    BLOCK_SCALED_GEMM,
    BLOCKWISE_FP8_KERNEL,
    GEMM_TARGETS,
    attention_flops,
    backend_config,
    block_scaled_flops,
    gemm_flops,
    grouped_gemm_flops,
    type_bytes,
)
from jaxtron.metrics.hlo_program import CALLS, LINE, TARGET, Program, operand_names, split_instruction, tuple_parts


@dataclasses.dataclass(frozen=True)
class Ceilings:
    """What one GPU sustains, as the GPU suite measures it (``benchmarks/gpu_suite.py``'s ceilings step)."""
    bf16_flops: float  # a large bf16 GEMM, FLOP/s
    fp8_flops: float  # a large FP8 GEMM (e4m3 operands, per-tensor scales), FLOP/s
    attention_flops: float  # cuDNN's causal flash attention, forward and backward, FLOP/s
    copy_bytes: float  # bytes read plus bytes written per second by a large elementwise kernel
    launch_s: float  # what each kernel launch adds, seconds
    grouped_flops: float | None = None  # a grouped expert GEMM (tokamax / jaxtron's kernel); None: bf16_flops
    source: str = ""
    fp4_flops: float | None = None  # a large block-scaled FP4 GEMM (NVFP4, Blackwell); None: no such GEMM

    def describe(self) -> str:
        fp4 = f", FP4 GEMM {self.fp4_flops / 1e12:.0f}" if self.fp4_flops else ""
        return (f"bf16 GEMM {self.bf16_flops / 1e12:.0f} TFLOP/s, FP8 GEMM {self.fp8_flops / 1e12:.0f}{fp4}, attention "
                f"{self.attention_flops / 1e12:.0f}, grouped GEMM {(self.grouped_flops or self.bf16_flops) / 1e12:.0f}"
                f", copy {self.copy_bytes / 1e12:.2f} TB/s, {self.launch_s * 1e6:.1f} us a launch")


# One H200 in benchmarks/gpu_h200_2026-11-26_run2.md: 8192^3 GEMMs (the best of 10), an elementwise kernel over
# 2 GiB (read + written), cuDNN's causal attention at 8k tokens, forward and backward; tokamax's grouped GEMM on
# Mixtral's expert shapes (gpu_h200_2026-11-26.md). The launch cost is assumed (a GPU run of the suite measures it).
# The H100 SXM has the same tensor cores and clocks; its copy rate is the H200's scaled by their datasheet
# bandwidths (3.35 / 4.8 TB/s) until a GPU run measures it.
H200 = Ceilings(729e12, 1165e12, 465e12, 2.95e12, 2e-6, grouped_flops=253e12,
                source="measured on one H200 (benchmarks/gpu_h200_2026-11-26_run2.md); launch cost assumed")
H100 = dataclasses.replace(H200, copy_bytes=2.95e12 * 3.35 / 4.8,
                           source="the H200's measured rates, copy scaled to the H100's bandwidth; launch assumed")


def from_datasheet(bf16: float, fp8: float, fp4: float, bandwidth: float, name: str) -> Ceilings:
    """Ceilings of a GPU no run has measured: the H200's measured share of each of its own datasheet figures
    (bf16 GEMM 729 of 989.4 TFLOP/s, FP8 1165 of 1978.9, attention 465 of 989.4, grouped 253 of 989.4, copy
    2.95 of 4.8 TB/s), applied to this GPU's (``bf16``, ``fp8``, ``fp4`` dense FLOP/s; ``bandwidth`` bytes/s).
    FP4 GEMMs get FP8's share. An estimate until a GPU run measures them."""
    dense, fp8_peak, hbm = 989.4e12, 1978.9e12, 4.8e12
    return Ceilings(bf16 * H200.bf16_flops / dense, fp8 * H200.fp8_flops / fp8_peak,
                    bf16 * H200.attention_flops / dense, bandwidth * H200.copy_bytes / hbm, H200.launch_s,
                    grouped_flops=bf16 * H200.grouped_flops / dense, fp4_flops=fp4 * H200.fp8_flops / fp8_peak,
                    source=f"{name}'s datasheet at the H200's measured share of its own; launch assumed")


# datasheet: HGX B200 2250 / 4500 / 9000 dense TFLOP/s (bf16 / FP8 / FP4), GB200 2500 / 5000 / 10000; 8 TB/s each
B200 = from_datasheet(2250e12, 4500e12, 9000e12, 8.0e12, "the B200")
GB200 = from_datasheet(2500e12, 5000e12, 10000e12, 8.0e12, "the GB200")
CEILINGS = {"h100": H100, "h200": H200, "b200": B200, "gb200": GB200}

COMPUTE_CATEGORIES = ("GEMM bf16", "GEMM fp8", "GEMM fp4", "GEMM f32", "grouped GEMM", "attention")
CATEGORIES = (*COMPUTE_CATEGORIES, "memory-bound", "launches")

# instructions that launch nothing: bookkeeping, control flow (its bodies are counted on their own), and the
# asynchronous halves that only wait
_FREE = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "while", "conditional", "call",
         "after-all", "partition-id", "replica-id", "opt-barrier", "add-dependency", "domain", "copy-done",
         "async-done", "async-update", "send-done", "recv-done", "get-dimension-size"}
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_FUSION_KIND = re.compile(r'"kind":"(__[a-z_$]+)"')
# library calls that launch no kernel: XLA's uninitialized buffer, where a loop overwrites every slot of a stack
_FREE_TARGETS = {"AllocateBuffer"}
# named scopes the code opens (jax.named_scope) that name what a kernel does, innermost first when several match
SCOPES = ("norm", "rope", "activation", "attention", "weight_cast", "loss", "optimizer", "router", "experts")


@dataclasses.dataclass
class Kernel:
    """One kernel of the program: what it is, how often it runs, and its bound."""
    name: str
    category: str
    label: str  # phase and what it computes, from the op name: 'backward loss', 'update optimizer', ...
    runs: int
    flops: float  # per run
    bytes: float  # per run, read plus written
    seconds: float  # per run: the binding ceiling's time


@dataclasses.dataclass
class Budget:
    kernels: list[Kernel]
    collectives: dict[str, float]  # kind -> bytes per step
    ceilings: Ceilings

    def by_category(self) -> dict[str, float]:
        """Category -> seconds per step, launches included, in ``CATEGORIES``' order."""
        out = dict.fromkeys(CATEGORIES, 0.0)
        for k in self.kernels:
            out[k.category] += k.runs * k.seconds
        out["launches"] = self.launches * self.ceilings.launch_s
        return out

    @property
    def launches(self) -> int:
        return sum(k.runs for k in self.kernels)

    @property
    def seconds(self) -> float:
        return sum(self.by_category().values())

    def by_label(self, category: str | None = None) -> dict[str, float]:
        """Label -> seconds per step (of one category, or all), largest first."""
        out: dict[str, float] = {}
        for k in self.kernels:
            if category is None or k.category == category:
                out[k.label] = out.get(k.label, 0.0) + k.runs * k.seconds
        return dict(sorted(out.items(), key=lambda kv: -kv[1]))

    def flops(self, category: str) -> float:
        return sum(k.runs * k.flops for k in self.kernels if k.category == category)

    def bytes(self, category: str = "memory-bound") -> float:
        return sum(k.runs * k.bytes for k in self.kernels if k.category == category)

    def summary(self, top: int = 12) -> dict:
        """The budget as plain numbers (JSON; ``text`` prints it): seconds in all and by category, FLOPs by GEMM
        category, bytes of the memory-bound kernels, launches, the ``top`` largest memory-bound items by label."""
        return {"seconds": self.seconds, "by_category": self.by_category(), "launches": self.launches,
                "flops": {c: self.flops(c) for c in COMPUTE_CATEGORIES}, "memory_bytes": self.bytes(),
                "memory_by_label": dict(list(self.by_label("memory-bound").items())[:top]),
                "collective_bytes": self.collectives, "ceilings": dataclasses.asdict(self.ceilings)}


def text(summary: dict, top: int = 8) -> str:
    """A budget's ``summary`` as lines: the total, each category, the largest memory-bound items, collectives."""
    ceilings = Ceilings(**summary["ceilings"])
    lines = [(f"step time budget, a lower bound: {1e3 * summary['seconds']:.1f} ms at {ceilings.describe()} "
              f"({ceilings.source})")]
    for c, seconds in summary["by_category"].items():
        if not seconds:
            continue
        if c == "launches":
            what = f"{summary['launches']} kernels"
        elif c == "memory-bound":
            what = f"{summary['memory_bytes'] / 1e9:.1f} GB read + written"
        else:
            what = f"{summary['flops'][c] / 1e12:.1f} TFLOP"
        lines.append(f"  {c:<13} {1e3 * seconds:8.1f} ms  ({what})")
    items = list(summary["memory_by_label"].items())[:top]
    if items:
        lines.append("  largest memory-bound work (ms): " + ", ".join(f"{k} {1e3 * s:.1f}" for k, s in items))
    moved = {k: v for k, v in summary["collective_bytes"].items() if v}
    if moved:
        lines.append("  collectives, not in the bound (the planner prices and overlaps them): "
                     + ", ".join(f"{k} {v / 2**30:.2f} GiB" for k, v in moved.items()))
    return "\n".join(lines)


def label(line: str) -> str:
    """'<phase> <what>' of an instruction from its op name: the phase is 'forward', 'recompute' (a remat policy's
    second forward), 'backward' or 'update' (outside the differentiated function); what it computes is the innermost
    named scope of ``SCOPES`` in its op name, else the primitive's name."""
    found = _OP_NAME.search(line)
    if not found:
        return "other"
    name = found.group(1)
    phase = ("recompute" if "rematted_computation" in name else "backward" if "transpose(" in name
             else "forward" if "jvp(" in name else "update")
    parts = [p for p in name.split("/") if p]
    what = next((p for p in reversed(parts) if p in SCOPES), None)
    if what is None:
        what = re.sub(r"^jit\((\w+)\)$", r"\1", parts[-1]) if parts else "other"
    return f"{phase} {what}"


def _without_workspace(type_text: str) -> str:
    return re.sub(r"[su]8\[[\d,]*\](\{[^}]*\})?", "", type_text)


def _gemm_category(operand_types: list[str]) -> str:
    if any(t.startswith("f4") for t in operand_types):
        return "GEMM fp4"
    if any(t.startswith("f8") for t in operand_types):
        return "GEMM fp8"
    if any(t == "f32" for t in operand_types):
        return "GEMM f32"
    return "GEMM bf16"


def kernels(hlo_text: str | Program, ceilings: Ceilings) -> list[Kernel]:
    """Every kernel one execution of the program (its text, or the text already indexed) launches, priced (see the
    module's docstring)."""
    program = hlo_text if isinstance(hlo_text, Program) else Program(hlo_text)
    rates = {"GEMM bf16": ceilings.bf16_flops, "GEMM fp8": ceilings.fp8_flops, "GEMM f32": ceilings.bf16_flops / 2,
             "GEMM fp4": ceilings.fp4_flops or ceilings.fp8_flops,
             "grouped GEMM": ceilings.grouped_flops or ceilings.bf16_flops, "attention": ceilings.attention_flops}
    out = []
    for _, runs, line, name, type_text, opcode, tail in program.instructions():
        if opcode in _FREE or opcode.endswith("-done") or any(opcode.startswith(c) for c in COLLECTIVES):
            continue
        if opcode == "custom-call" and (TARGET.search(line) or [None, ""])[1] in _FREE_TARGETS:
            continue
        operands = operand_names(tail)
        if opcode == "fusion-start":  # an asynchronous fusion (XLA 0.11): ((operands), result, context), priced alike
            opcode, type_text = "fusion", tuple_parts(type_text)[1]
        if opcode == "custom-call":  # a library call's byte results are its workspace, not data it writes
            type_text = _without_workspace(type_text)
        moved = float(sum(program.operand_bytes(o) for o in operands) + type_bytes(type_text))
        flops, category, named = 0.0, "memory-bound", line
        if opcode == "fusion":
            kind = _FUSION_KIND.search(line)
            kind = kind.group(1) if kind else ""
            fused = CALLS.search(line).group(1).lstrip("%")
            dot = program.called_dot(fused) if "gemm" in kind or "cudnn" in kind else None
            library = program.called_library_gemm(fused) if dot is None and "custom" in kind else None
            if dot is not None:
                flops = gemm_flops(dot, program.shapes, None)
                dot_ops = operand_names(split_instruction(LINE.match(dot).group(2))[2])
                category = _gemm_category([program.shapes.get(o, ("?", ()))[0] for o in dot_ops])
            elif library is not None:  # a GEMM that reads or writes a slice of a stack in place
                flops = gemm_flops(library, program.shapes, backend_config(library))
                gemm_ops = operand_names(split_instruction(LINE.match(library).group(2))[2])
                category = _gemm_category([program.shapes.get(o, ("?", ()))[0] for o in gemm_ops[:2]])
                named = library  # the wrapper has no op name of its own
                workspace = type_bytes(type_text) - type_bytes(_without_workspace(type_text))
                moved = program.fusion_bytes(fused, operands, type_text) - workspace
            else:
                moved = program.fusion_bytes(fused, operands, type_text)
        elif opcode == "custom-call":
            target = re.search(r'custom_call_target="([^"]+)"', line)
            target = target.group(1) if target else ""
            if "RaggedDot" in line:
                flops, category = grouped_gemm_flops(line, program.shapes), "grouped GEMM"
            elif target in GEMM_TARGETS:
                flops = gemm_flops(line, program.shapes, backend_config(line))
                category = _gemm_category([program.shapes.get(o, ("?", ()))[0] for o in operands[:2]])
            elif target == BLOCK_SCALED_GEMM or BLOCKWISE_FP8_KERNEL in line:
                flops = block_scaled_flops(line, program.shapes)
                category = _gemm_category([program.shapes.get(o, ("?", ()))[0] for o in operands[:2]])
            elif target in ATTENTION_FORWARD + ATTENTION_BACKWARD:
                flops, category = attention_flops(line, "Backward" in target), "attention"
        elif opcode == "dot":
            flops = gemm_flops(line, program.shapes, None)
            category = _gemm_category([program.shapes.get(o, ("?", ()))[0] for o in operands[:2]])
        elif opcode == "dynamic-update-slice":  # in place: the update read and written
            moved = 2.0 * program.operand_bytes(operands[1]) if len(operands) > 1 else moved
        seconds = moved / ceilings.copy_bytes
        if category != "memory-bound":
            seconds = max(flops / rates[category], seconds)
        out.append(Kernel(name, category, label(named), runs, flops, moved, seconds))
    return out


def budget(hlo_text: str, ceilings: Ceilings) -> Budget:
    """The time budget of one execution of a compiled GPU program (its optimized HLO text)."""
    moved = {kind: c["bytes"] for kind, c in collectives(hlo_text).items()}
    return Budget(kernels(hlo_text, ceilings), moved, ceilings)
