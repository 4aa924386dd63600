"""The step's time budget (``jaxtron/metrics/budget.py``) prices each kernel of a compiled GPU program at its binding
ceiling; here on a program written out by hand, where every number can be worked out on paper."""

from pathlib import Path

import pytest

from jaxtron.metrics.budget import Ceilings, budget, label, text

CEILINGS = Ceilings(bf16_flops=1e14, fp8_flops=2e14, attention_flops=5e13, copy_bytes=1e12, launch_s=1e-6)

# tests/fixtures/budget_program.hlo: a loop of 4 iterations, each slicing one row of a stacked float32 weight and
# casting it (a fusion that reads the row alone) and running a bf16 GEMM (a Triton fusion); after it an FP8 cuBLAS
# GEMM, a float32 GEMM and a copy.
PROGRAM = (Path(__file__).parent / "fixtures" / "budget_program.hlo").read_text()


def test_each_kernel_is_priced_at_its_binding_ceiling():
    b = budget(PROGRAM, CEILINGS)
    cats = b.by_category()
    # the row fusion reads its one row (4 KiB of float32) and the loop index, and writes the row in bf16, in each
    # of 4 iterations
    row = next(k for k in b.kernels if k.name == "%row")
    assert (row.runs, row.bytes) == (4, 1024 * 4 + 4 + 1024 * 2)
    # the bf16 GEMM: 2 x 256 x 512 x 1024 FLOPs, compute-bound at 1e14, 4 times
    gemm = 2 * 256 * 512 * 1024
    assert cats["GEMM bf16"] == pytest.approx(4 * gemm / 1e14)
    # the FP8 GEMM at the FP8 rate; the float32 one at half the bf16 rate (TF32), or its bytes if more
    assert cats["GEMM fp8"] == pytest.approx(2 * 1024 * 2048 * 1024 / 2e14)
    f32_bytes = 3 * 64 * 64 * 4
    assert cats["GEMM f32"] == pytest.approx(max(2 * 64 ** 3 / 5e13, f32_bytes / 1e12))
    # memory-bound: the rows, the loop condition's compare (4 runs: a predicate and an int read, one written),
    # the copy (read and written)
    compare = 4 + 4 + 1
    assert cats["memory-bound"] == pytest.approx((4 * 6148 + 4 * compare + 2 * 4096 * 4) / 1e12)
    # launches: 4 x (row, GEMM, compare), the FP8 GEMM, the float32 GEMM, the copy
    assert b.launches == 4 * 3 + 3 and cats["launches"] == pytest.approx(15e-6)
    assert b.seconds == pytest.approx(sum(cats.values()))
    assert b.flops("GEMM bf16") == 4 * gemm


# an in-place update of one row of a stacked buffer, as XLA 0.11 emits it: an asynchronous fusion (fusion-start and
# fusion-done) whose type is ((operands), result, context)
ASYNC_UPDATE = """HloModule m

%update (p0: bf16[8,1024], p1: s32[], p2: bf16[1,1024]) -> bf16[8,1024] {
  %p0 = bf16[8,1024]{1,0} parameter(0)
  %p1 = s32[] parameter(1)
  %p2 = bf16[1,1024]{1,0} parameter(2)
  %zero = s32[] constant(0)
  ROOT %dus = bf16[8,1024]{1,0} dynamic-update-slice(%p0, %p2, %p1, %zero)
}

ENTRY %main (a: bf16[8,1024], i: s32[], row: bf16[1,1024]) -> bf16[8,1024] {
  %a = bf16[8,1024]{1,0} parameter(0)
  %i = s32[] parameter(1)
  %row = bf16[1,1024]{1,0} parameter(2)
  %start = ((bf16[8,1024]{1,0}, s32[], bf16[1,1024]{1,0}), bf16[8,1024]{1,0}, u32[]) fusion-start(%a, %i, %row), \
kind=kLoop, calls=%update
  ROOT %done = bf16[8,1024]{1,0} fusion-done(%start)
}
"""


def test_an_asynchronous_in_place_fusion_is_priced_as_the_update_it_writes():
    """XLA 0.11's fusion-start of a row update moves the row (read and written) and the index, not the stacked
    buffer: priced as the whole tuple it had Llama-3 8B's layer loop at 124.6 ms of copies where 9.8 are."""
    kernel = next(k for k in budget(ASYNC_UPDATE, CEILINGS).kernels if k.name == "%start")
    assert kernel.category == "memory-bound" and kernel.bytes == 2 * 1024 * 2 + 4


def test_kernels_are_labelled_by_phase_and_named_scope():
    assert label('x, metadata={op_name="jit(f)/jvp()/while/body/norm/mul"}') == "forward norm"
    assert label('x, metadata={op_name="jit(f)/transpose(jvp())/while/body/checkpoint/rematted_computation/norm/'
                 'rsqrt"}') == "recompute norm"
    assert label('x, metadata={op_name="jit(f)/transpose(jvp())/loss/exp"}') == "backward loss"
    assert label('x, metadata={op_name="jit(f)/optimizer/jit(_where)/select_n"}') == "update optimizer"
    assert label('x, metadata={op_name="jit(f)/jvp()/mul"}') == "forward mul"
    assert label("%copy.1 = f32[8]{0} copy(%p)") == "other"


def test_the_budget_prints_each_category_and_the_largest_memory_bound_work():
    lines = text(budget(PROGRAM, CEILINGS).summary()).splitlines()
    assert lines[0].startswith("step time budget, a lower bound: ")
    assert [line.split()[0] for line in lines[1:6]] == ["GEMM", "GEMM", "GEMM", "memory-bound", "launches"]
    assert "forward norm" in lines[-1] and "update optimizer" in lines[-1]
