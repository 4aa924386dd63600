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


# XLA's dynamic-slice fusion: a cuBLAS GEMM writing its [64, 128] result into row i of a stack in place; and an
# uninitialized stack (AllocateBuffer), where a loop overwrites every row and a zero fill would be wasted
SLICED_GEMM = """HloModule m

%into_row (p0: bf16[64,32], p1: bf16[32,128], p2: bf16[4,64,128], p3: s32[]) -> (bf16[4,64,128], s8[1024]) {
  %p0 = bf16[64,32]{1,0} parameter(0)
  %p1 = bf16[32,128]{1,0} parameter(1)
  %p2 = bf16[4,64,128]{2,1,0} parameter(2)
  %p3 = s32[] parameter(3)
  %gemm = (bf16[64,128]{1,0}, s8[1024]{0}) custom-call(%p0, %p1), custom_call_target="__cublas$lt$matmul", \
metadata={op_name="jit(f)/jvp()/dot_general"}, backend_config={"gemm_backend_config":{"dot_dimension_numbers":\
{"lhs_contracting_dimensions":["1"],"rhs_contracting_dimensions":["0"],"lhs_batch_dimensions":[],\
"rhs_batch_dimensions":[]}}}
  %result = bf16[64,128]{1,0} get-tuple-element(%gemm), index=0
  %row = bf16[1,64,128]{2,1,0} bitcast(%result)
  %zero = s32[] constant(0)
  %dus = bf16[4,64,128]{2,1,0} dynamic-update-slice(%p2, %row, %p3, %zero, %zero)
  %workspace = s8[1024]{0} get-tuple-element(%gemm), index=1
  ROOT %out = (bf16[4,64,128]{2,1,0}, s8[1024]{0}) tuple(%dus, %workspace)
}

ENTRY %main (x: bf16[64,32], w: bf16[32,128], i: s32[]) -> (bf16[4,64,128], s8[1024]) {
  %x = bf16[64,32]{1,0} parameter(0)
  %w = bf16[32,128]{1,0} parameter(1)
  %i = s32[] parameter(2)
  %stack = bf16[4,64,128]{2,1,0} custom-call(), custom_call_target="AllocateBuffer"
  ROOT %f = (bf16[4,64,128]{2,1,0}, s8[1024]{0}) fusion(%x, %w, %stack, %i), kind=kCustom, calls=%into_row, \
backend_config={"fusion_backend_config":{"kind":"__custom_fusion","custom_fusion_config":{"name":"dynamic_slice_fusion"}}}
}
"""


def test_a_gemm_writing_into_a_stack_is_a_gemm_and_an_uninitialized_buffer_is_free():
    """Unpriced, the wrapped GEMM hid 44 TFLOP of Llama-3 8B's step among the copies; an AllocateBuffer launches
    nothing, so pricing its bytes would hide what the zero fills it replaces saved."""
    b = budget(SLICED_GEMM, CEILINGS)
    assert [k.name for k in b.kernels] == ["%f"]
    gemm = b.kernels[0]
    assert gemm.category == "GEMM bf16" and gemm.flops == 2 * 64 * 32 * 128
    # it reads both operands and writes its row in place: not the stack, not the workspace
    assert gemm.bytes == (64 * 32 + 32 * 128 + 64 * 128) * 2 + 4
    assert gemm.label == "forward dot_general"


# an embedding's gradient: 16 rows of 64 float32 added into a [1000, 64] table in place (scatter at the root)
SCATTER_ADD = """HloModule m

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%rows (p0: f32[1000,64], p1: s32[16,1], p2: f32[16,1,64]) -> f32[1000,64] {
  %p0 = f32[1000,64]{1,0} parameter(0)
  %p1 = s32[16,1]{1,0} parameter(1)
  %p2 = f32[16,1,64]{2,1,0} parameter(2)
  ROOT %scatter = f32[1000,64]{1,0} scatter(%p0, %p1, %p2), update_window_dims={1,2}, inserted_window_dims={}, \
scatter_dims_to_operand_dims={0}, index_vector_dim=1, to_apply=%add
}

ENTRY %main (table: f32[1000,64], ids: s32[16,1], grads: f32[16,1,64]) -> f32[1000,64] {
  %table = f32[1000,64]{1,0} parameter(0)
  %ids = s32[16,1]{1,0} parameter(1)
  %grads = f32[16,1,64]{2,1,0} parameter(2)
  ROOT %f = f32[1000,64]{1,0} fusion(%table, %ids, %grads), kind=kInput, calls=%rows
}
"""


def test_a_scatter_add_moves_the_rows_it_updates_not_the_table():
    """Llama-3 8B's embedding gradient was priced at 4.3 GB (its 2.1 GB table read and written) where it touches
    16384 rows: 0.67 GB."""
    kernel = budget(SCATTER_ADD, CEILINGS).kernels[0]
    rows = 16 * 64 * 4
    assert kernel.bytes == 16 * 4 + rows + 2 * rows  # the indices and updates read; the rows read and written
