"""The expert GEMM: rows sorted by expert [m, k] times each expert's matrix [groups, k, n], in one place.

- 'xla': ``jax.lax.ragged_dot``, the reference on every backend. XLA:GPU (jax 0.10.2 to 0.11.2) computes it as
  one dense GEMM of every row with every group (measured on an H200: 6.6x one dense GEMM's time at 8 groups;
  ``benchmarks/gpu_h200_2026-11-26.md``), and XLA:CPU likewise.
- 'tokamax': tokamax's ``ragged_dot``, whose Mosaic GPU kernel on Hopper computes each group's rows against
  its own matrix only (compiled for the H100 target: the useful FLOPs exactly, ``benchmarks/grouped_gemm_target.md``).
  Forward and input gradient are tokamax's kernel; the weight gradient is jaxtron's Pallas kernel
  (``grouped_kernels.contract``, float32 sums), since tokamax's ragged-contracting kernel was 4-5% off a float32
  reference on an H200 even when asked for a float32 result, 25 times the bf16 rounding of its other two
  products (``benchmarks/grouped_errors_h200.md``). The input gradient takes each matrix transposed by a kernel of
  jaxtron's (``grouped_kernels.transposed``), not by the transposition tokamax writes ahead of its kernel: XLA
  carried that one back to the float32 parameters and transposed the whole stack of a pipeline stage's experts
  once a step (Mixtral 8x22B's published layout on 256 H100s: 4.7 GiB a device). Rows past the
  groups' total are zeros, as with ``jax.lax.ragged_dot``. Off a GPU, tokamax runs its XLA implementation, so
  the same code path is tested on a CPU.
- 'auto': 'tokamax' on a Hopper GPU (or when compiling for one, ``on_target``) where tokamax is installed, else
  'xla'.

In FP8 (``execution.fp8``) the expert GEMM is ``ops/grouped_fp8.py``'s, whose own kernels run on Hopper for any
choice but 'xla' (``resolve(choice, fp8=True)``).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
from collections.abc import Iterator

import jax
import jax.numpy as jnp

from jaxtron.common.trace_state import EXPERT_GEMM_TARGET
from jaxtron.config.schema import ConfigError
from jaxtron.ops import grouped_kernels

INSTALL = 'python -m pip install -e ".[gpu]"'

# rows [m, k] x weights [groups, k, n], written with lists as tokamax compares them
_FORWARD = jax.lax.RaggedDotDimensionNumbers(dot_dimension_numbers=(([1], [1]), ([], [])),
                                             lhs_ragged_dimensions=[0], rhs_group_dimensions=[0])




def tokamax_installed() -> bool:
    """Whether tokamax imports here (installed, with what it imports)."""
    return _tokamax_problem() is None


@functools.cache
def _tokamax_problem() -> str | None:
    if importlib.util.find_spec("tokamax") is None:
        return "it is not installed"
    try:
        import tokamax  # noqa: F401
    except ImportError as e:
        return f"importing it failed ({type(e).__name__}: {e})"
    return None


def target_gpu() -> jax.Device | None:
    """The GPU the program is for: the target being compiled for, else the default device when it is a GPU."""
    if EXPERT_GEMM_TARGET.get() is not None:
        return EXPERT_GEMM_TARGET.get()
    device = jax.devices()[0]
    return device if device.platform == "gpu" else None


def _hopper_or_newer(device: jax.Device | None) -> bool:
    capability = getattr(device, "compute_capability", None) if device is not None else None
    return capability is not None and float(capability) >= 9.0


def resolve(choice: str, fp8: bool = False) -> str:
    """'auto' -> 'tokamax' on Hopper or newer with tokamax installed, else 'xla'; an explicit 'tokamax' without
    tokamax installed is a ConfigError (the config has checked the value itself). ``fp8`` (an FP8 expert GEMM,
    ``ops/grouped_fp8.py``): 'pallas', jaxtron's own kernels, on Hopper or newer for any choice but 'xla'
    (tokamax's Hopper kernel takes 16-bit rows only); elsewhere the 16-bit GEMM for the dequantized operands."""
    if fp8 and choice != "xla" and _hopper_or_newer(target_gpu()):
        return "pallas"
    if choice == "auto":
        return "tokamax" if _hopper_or_newer(target_gpu()) and tokamax_installed() else "xla"
    if choice == "tokamax" and not tokamax_installed():
        raise ConfigError(f"config field 'execution.expert_gemm' is 'tokamax' but {_tokamax_problem() or 'it fails'}; "
                          f"install it with {INSTALL} or use 'auto' or 'xla'.")
    return choice


@contextlib.contextmanager
def on_target(device: jax.Device) -> Iterator[None]:
    """Within this context the expert GEMM is chosen for ``device``, a compile-only GPU (``jaxtron.gpu.target``):
    'auto' resolves for it, and tokamax, which picks its kernel for jax's default device (the CPU when compiling
    without a GPU), is pointed at it."""
    from jax.extend import backend

    saved = backend.get_default_device
    backend.get_default_device = lambda: device
    try:
        with EXPERT_GEMM_TARGET.bound(device):
            yield
    finally:
        backend.get_default_device = saved


def matmul(rows: jax.Array, weights: jax.Array, group_sizes: jax.Array, implementation: str = "xla") -> jax.Array:
    """rows [m, k] sorted by group, weights [groups, k, n], group_sizes [groups] -> [m, n] in the rows' dtype:
    each group's rows times its matrix; rows past sum(group_sizes) give zeros."""
    if resolve(implementation) == "xla":
        return jax.lax.ragged_dot(rows, weights, group_sizes)
    return _tokamax_matmul(rows, weights, group_sizes)


def _kernel():
    """tokamax's ragged_dot_general with the kernel for the device compiled for: Mosaic GPU on Hopper, its XLA
    implementation elsewhere (a CPU test)."""
    import tokamax

    return functools.partial(tokamax.ragged_dot_general,
                             implementation="mosaic" if _hopper_or_newer(target_gpu()) else "xla")


def zero_past_groups(out: jax.Array, group_sizes: jax.Array) -> jax.Array:
    valid = jnp.arange(out.shape[0]) < jnp.sum(group_sizes)
    return jnp.where(valid[:, None], out, jnp.zeros((), out.dtype))


@jax.custom_vjp
def _tokamax_matmul(rows, weights, group_sizes):
    out = _kernel()(rows, weights, group_sizes, _FORWARD, preferred_element_type=rows.dtype)
    return zero_past_groups(out, group_sizes)


def _tokamax_fwd(rows, weights, group_sizes):
    return _tokamax_matmul(rows, weights, group_sizes), (rows, weights, group_sizes)


def _tokamax_bwd(res, d_out):
    rows, weights, group_sizes = res
    d_out = zero_past_groups(d_out, group_sizes)  # rows past the groups took no part in the product
    transposed = grouped_kernels.transposed(weights, interpret=not _hopper_or_newer(target_gpu()))
    d_rows = _kernel()(d_out, transposed, group_sizes, _FORWARD, preferred_element_type=rows.dtype)
    d_weights = _weight_gradient(rows, d_out, group_sizes)
    return zero_past_groups(d_rows, group_sizes), d_weights.astype(weights.dtype), None


_tokamax_matmul.defvjp(_tokamax_fwd, _tokamax_bwd)


def _weight_gradient(rows: jax.Array, d_out: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """Each group's rows transposed times its output gradient, [groups, k, n] in float32, by jaxtron's Pallas
    kernel (``grouped_kernels.contract``: float32 sums of 16-bit products), which tokamax's ragged-contracting kernel
    computed 4-5% off float32 on an H200 whatever the group sizes (``benchmarks/grouped_errors_h200.md``). Off a
    Hopper GPU the kernel runs in Pallas' interpreter, so a CPU test runs the same code."""
    return grouped_kernels.contract(rows.T, d_out.T, group_sizes, jnp.ones((), jnp.float32), jnp.float32,
                                interpret=not _hopper_or_newer(target_gpu()))
