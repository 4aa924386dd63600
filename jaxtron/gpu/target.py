"""Compile-only H100, H200, B200 and GB200 devices: XLA compiles jaxtron's programs for these GPUs without one
present ("deviceless" compilation), so the program a GPU would run (its kernels, memory and collectives) can be read
on any machine that has jax's CUDA plugin installed (``python -m pip install -e ".[gpu-target]"``). jax 0.10.2's
plugin compiles for Blackwell (sm_100a) too: its CUDA 12.9 compiler knows it.

The devices come from ``jax.experimental.topologies.get_topology_desc`` and a target spec that ships with jaxtron
(``specs/``: the device facts, each file saying where they come from). N GPUs are laid out on hosts of 8, as on an
HGX machine, or of 4, a GB200 compute tray. What such a compile cannot see: autotuning (GEMMs stay XLA's untuned
defaults), cuDNN's workspace (cuDNN's own compiler passes need a device), and any timing.

A process that compiles for the target starts jax on the CPU with the flags a deviceless compile needs
(``environment``), and one whose compile aborts XLA must not be the caller's: run it in a subprocess.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import importlib.util
import os
import re
from pathlib import Path
from typing import Any

from jaxtron.config.checks import ConfigError
from jaxtron.gpu import preset
from jaxtron.gpu.links import GPUS_PER_NODE

SPECS = Path(__file__).with_name("specs")
INSTALL = 'python -m pip install -e ".[gpu-target]"'
# --flag: why a deviceless compile needs it
DEVICELESS_FLAGS = {
    # a sort (MoE routing's top-k) otherwise asks CUB for a device to pick its kernel on, and the compile aborts
    "--xla_gpu_deviceless_cub_mode": "DEVICELESS_CUB_DISABLED",
}


@dataclasses.dataclass(frozen=True)
class Target:
    name: str  # as --gpu names it
    spec_file: str  # in specs/
    compute_capability: tuple[int, int]
    gpus_per_host: int = GPUS_PER_NODE  # an HGX node's 8; a GB200 compute tray's 4


TARGETS = {"h100": Target("h100", "h100_sxm.txtpb", (9, 0)), "h200": Target("h200", "h200_sxm.txtpb", (9, 0)),
           "b200": Target("b200", "b200.txtpb", (10, 0)), "gb200": Target("gb200", "gb200.txtpb", (10, 0), 4)}


def target(name: str) -> Target:
    """The target called ``name``; ConfigError for another name."""
    if name not in TARGETS:
        raise ConfigError(f"GPU target '{name}' is not known; use one of {', '.join(TARGETS)}.")
    return TARGETS[name]


def plugin_installed() -> bool:
    """Whether jax's CUDA plugin, which compiles for NVIDIA GPUs, is installed."""
    return importlib.util.find_spec("jax_cuda12_plugin") is not None


def require_plugin(name: str) -> None:
    if not plugin_installed():
        raise ConfigError(f"compiling for the {name} target needs jax's CUDA plugin, which is not installed; "
                          f"install it with {INSTALL}.")


def installed_cudnn() -> tuple[int, int, int] | None:
    """The version of the cuDNN library the plugin uses (from its package), or None."""
    try:
        version = importlib.metadata.version("nvidia-cudnn-cu12")
    except importlib.metadata.PackageNotFoundError:
        return None
    major, minor, patch = (int(part) for part in version.split(".")[:3])
    return major, minor, patch


def spec(name: str) -> str:
    """The target spec of ``name`` as XLA reads it, its cuDNN version the installed one (XLA picks the cuDNN kernels
    and their workarounds by it)."""
    text = (SPECS / target(name).spec_file).read_text()
    cudnn = installed_cudnn()
    if cudnn is not None:
        major, minor, patch = cudnn
        version = f"dnn_version_info {{\n  major: {major}\n  minor: {minor}\n  patch: {patch}\n}}"
        text = re.sub(r"dnn_version_info \{[^}]*\}", version, text)
    return text


# XLA:GPU bounds its scheduler and its rematerialization by (base - the program's inputs and outputs) x a slop
# factor (95%). On a GPU, jax passes its allocator's limit as the base: the preset's memory fraction of the device.
# A compile without a GPU has no allocator and takes 80% of the spec's memory, so it planned for less memory than
# the run has. Llama-3 8B on data=4 tensor=2 (8 H100 targets, its plan's first row) was rematerialized to 1.16x its
# matmul FLOPs, with 3% of its tensor collectives beside kernels; at the run's limit, 1.00x and 34-43%.
DEVICELESS_BASE = 0.80
XLA_SLOP_PERCENT = 95


def device_memory(name: str) -> int:
    """Bytes of memory of one GPU of target ``name``, as its spec says."""
    return int(re.search(r"device_memory_size: (\d+)", spec(name)).group(1))


def deviceless_limit(name: str, io_bytes: float) -> float:
    """XLA's own limit on the temporaries of a program whose inputs and outputs take ``io_bytes``, in a compile for
    target ``name`` without the GPU."""
    return (device_memory(name) * DEVICELESS_BASE - io_bytes) * XLA_SLOP_PERCENT / 100


def memory_limit_options(name: str, io_bytes: float) -> dict[str, int]:
    """The XLA option that gives a compile for target ``name`` the memory limit a GPU run under the preset has, for
    a program whose inputs and outputs (not counted twice where aliased) take ``io_bytes`` per device."""
    run = (device_memory(name) * float(preset.ENV["XLA_PYTHON_CLIENT_MEM_FRACTION"][0]) - io_bytes) * \
        XLA_SLOP_PERCENT / 100
    deviceless = deviceless_limit(name, io_bytes)
    if deviceless <= 0 or run <= 0:
        return {}  # no slop factor maps one limit to the other: XLA's own is kept
    return {"xla_gpu_memory_limit_slop_factor": int(XLA_SLOP_PERCENT * run / deviceless)}


def environment(base: dict[str, str] | None = None, preset_flags: str = "") -> dict[str, str]:
    """The environment of a process that compiles for a target: jax on the CPU (the plugin would look for a GPU),
    and the deviceless flags after ``preset_flags`` (the GPU preset's) and the caller's own XLA_FLAGS."""
    env = dict(os.environ if base is None else base)
    flags = [preset_flags, env.get("XLA_FLAGS", "")]
    flags += [f"{flag}={value}" for flag, value in DEVICELESS_FLAGS.items() if flag not in env.get("XLA_FLAGS", "")]
    env["XLA_FLAGS"] = " ".join(f for f in flags if f)
    env["JAX_PLATFORMS"] = "cpu"
    return env


def topology(count: int, per_host: int = GPUS_PER_NODE) -> str:
    """``count`` GPUs on hosts of ``per_host`` as jax writes a topology: '1x<hosts>x<GPUs per host>'."""
    if count < 1 or (count > per_host and count % per_host):
        raise ConfigError(f"{count} GPUs do not fill hosts of {per_host}; use 1 to {per_host} GPUs or a "
                          f"multiple of {per_host}.")
    per_node = min(count, per_host)
    return f"1x{count // per_node}x{per_node}"


def devices(name: str, count: int) -> list[Any]:
    """``count`` compile-only devices of the target ``name`` (on hosts of its ``gpus_per_host``). Needs the CUDA
    plugin."""
    per_host = target(name).gpus_per_host
    require_plugin(name)
    from jax.experimental import topologies

    layout = topology(count, per_host)
    return list(topologies.get_topology_desc(platform="cuda", topology=layout, target_config=spec(name)).devices)
