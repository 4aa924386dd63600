"""Every touch of Pallas' private Triton lowering (``jax._src.pallas.triton.lowering``): ``fp8_tensor_cores`` has
the lowering build FP8 dots that may accumulate ``BLOCK_K`` products on Hopper's FP8 tensor cores (why:
``ops/grouped_kernels.py``). It patches the lowering's Triton dialect, once per process, only where the dialect's
``dot`` takes ``max_num_imprecise_acc`` (the jax versions it was written for, 0.10 and 0.11); elsewhere it leaves the
lowering alone and the kernels compute the same numbers on the older instructions. ``tests/test_grouped.py`` checks
the signature against the installed jax."""

from __future__ import annotations

import functools
import inspect


def triton_dialect():
    """The Triton dialect module Pallas' lowering calls (``tt_dialect``), None where it is not importable."""
    try:
        from jax._src.pallas.triton import lowering
    except ImportError:
        return None
    return getattr(lowering, "tt_dialect", None)


@functools.cache  # once per process
def fp8_tensor_cores() -> bool:
    """Has Pallas' Triton lowering build FP8 dots that may accumulate ``BLOCK_K`` products on the tensor core
    (the module says why), once per process; -> whether its dots now do (False where this jax's lowering is not
    the one this was written for: the kernels then compute the same numbers on the older instructions)."""
    return _patch_triton_dots()


def _patch_triton_dots() -> bool:
    try:
        from jax._src.lib.mlir import ir
        from jax._src.pallas.triton import lowering
    except ImportError:
        return False
    dialect = triton_dialect()
    try:
        if dialect is None or "max_num_imprecise_acc" not in inspect.signature(dialect.dot).parameters:
            return False
    except (TypeError, ValueError):
        return False

    class _Dialect:
        """Triton's dialect as the lowering sees it, its ``dot`` saying how many FP8 products may accumulate on
        the tensor core."""

        def __getattr__(self, name):
            return getattr(dialect, name)

        @staticmethod
        def dot(a, b, c, *, max_num_imprecise_acc=None, **kwargs):
            operand = ir.RankedTensorType(a.type)
            if max_num_imprecise_acc is None and str(operand.element_type).startswith("f8"):
                max_num_imprecise_acc = operand.shape[-1]
            return dialect.dot(a, b, c, max_num_imprecise_acc=max_num_imprecise_acc, **kwargs)

    lowering.tt_dialect = _Dialect()
    return True
