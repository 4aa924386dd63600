"""The GPU preset (jaxtron/gpu/preset.py): its flags are accepted by the installed jaxlib, env.sh exports it."""

import os
import subprocess

import pytest
from conftest import REPO

from jaxtron.gpu import preset as gpu_preset


def test_the_installed_jaxlib_takes_the_preset_and_names_a_flag_it_does_not_know():
    # the preset's flags, those waiting for a GPU timing and those that change nothing are known to the installed
    # jaxlib (GPU flags are parsed on any platform); the last is not
    listed = " ".join([*gpu_preset.WAITING, *gpu_preset.NO_CHANGE])
    flags = f"{gpu_preset.xla_flags()} {listed} --xla_gpu_no_such_flag=1"
    assert gpu_preset.unknown_flags(flags) == ["--xla_gpu_no_such_flag=1"]


def test_the_program_options_named_as_evidence_are_the_ones_the_code_sets():
    from jaxtron.gpu import target
    from jaxtron.models import moe, stack, tensor_chunks
    from jaxtron.ops import fp8

    stack_options, _ = next(v for k, v in gpu_preset.PROGRAM_OPTIONS.items()
                            if k.startswith("jaxtron/models/stack.py"))
    assert stack_options == ", ".join(f"{k}={v}" for k, v in stack.COMPILER_OPTIONS.items())

    fp8_options, _ = next(v for k, v in gpu_preset.PROGRAM_OPTIONS.items() if k.startswith("jaxtron/ops/fp8.py"))
    assert fp8_options == ", ".join(f"{k}={v}" for k, v in fp8.COMPILER_OPTIONS.items())
    moe_options, _ = next(v for k, v in gpu_preset.PROGRAM_OPTIONS.items()
                          if k.startswith("jaxtron/models/moe.py COMPILER_OPTIONS"))
    assert moe_options == ", ".join(f"{k}={v}" for k, v in moe.COMPILER_OPTIONS.items())
    chunked, _ = next(v for k, v in gpu_preset.PROGRAM_OPTIONS.items()
                      if k.startswith("jaxtron/models/moe.py CHUNKED_OPTIONS"))
    assert chunked == ", ".join(f"{k}={v}" for k, v in moe.CHUNKED_OPTIONS.items())
    tensor, _ = next(v for k, v in gpu_preset.PROGRAM_OPTIONS.items() if k.startswith("jaxtron/models/tensor_chunks"))
    assert tensor == ", ".join(f"{k}={v}" for k, v in tensor_chunks.COMPILER_OPTIONS.items())
    assert tensor_chunks.compiler_options(2, 8) == tensor_chunks.COMPILER_OPTIONS
    assert tensor_chunks.compiler_options(1, 8) == tensor_chunks.compiler_options(2, 1) == {}
    cub, _ = next(v for k, v in gpu_preset.PROGRAM_OPTIONS.items() if k.startswith("jaxtron/gpu/target.py"))
    assert cub == " ".join(f"{k}={v}" for k, v in target.DEVICELESS_FLAGS.items())


def test_moe_programs_take_two_collectives_in_flight_only_with_token_chunks():
    """The options of an MoE program: none where the experts are not split; the latency-hiding scheduler where they
    are; and two collectives in flight only where each device's tokens run in chunks (models/moe.py)."""
    from jaxtron.config.loader import load_config
    from jaxtron.models import moe

    model = load_config(f"{REPO}/configs/mixtral_8x7b.py").model
    assert moe.compiler_options(model, 1, 4) == {}
    assert moe.compiler_options(model, 8, 1) == moe.COMPILER_OPTIONS
    assert moe.compiler_options(model, 8, 4) == {**moe.COMPILER_OPTIONS, **moe.CHUNKED_OPTIONS}
    assert moe.compiler_options(load_config(f"{REPO}/configs/llama3_8b.py").model, 8, 4) == {}


def test_check_refuses_an_unknown_flag_in_one_sentence(monkeypatch, capsys):
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_no_such_flag=1")
    assert gpu_preset.main(["--check"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: the installed jaxlib does not know --xla_gpu_no_such_flag=1")


@pytest.mark.integration
def test_env_sh_exports_the_preset_and_keeps_what_was_set_before():
    script = 'source scripts/slurm/env.sh && echo "$XLA_PYTHON_CLIENT_MEM_FRACTION|$NCCL_DEBUG|$XLA_FLAGS"'
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "NCCL_DEBUG")}
    env["XLA_PYTHON_CLIENT_MEM_FRACTION"] = "0.5"
    env["XLA_FLAGS"] = "--xla_dump_to=/tmp/somewhere"
    out = subprocess.run(["bash", "-c", script], cwd=REPO, env=env, capture_output=True, text=True, timeout=120,
                         check=False)
    assert out.returncode == 0, out.stderr
    mem, nccl, flags = out.stdout.strip().split("|")
    assert (mem, nccl) == ("0.5", gpu_preset.ENV["NCCL_DEBUG"][0])
    assert flags.endswith("--xla_dump_to=/tmp/somewhere") and flags.startswith(gpu_preset.xla_flags())


@pytest.mark.parametrize("gpu", ["h100", "h200"])
def test_a_target_compile_gets_the_memory_limit_of_a_run_under_the_preset(gpu):
    """XLA's scheduler and rematerialization limit is (base - inputs and outputs) x slop: a deviceless compile's base
    is 80% of the spec's memory, a GPU run's the allocator's (the preset's fraction of it)."""
    from jaxtron.gpu import target

    memory = target.device_memory(gpu)
    fraction = float(gpu_preset.ENV["XLA_PYTHON_CLIENT_MEM_FRACTION"][0])
    for io in (0, 11.22 * 2 ** 30, 40 * 2 ** 30):
        slop = target.memory_limit_options(gpu, io)["xla_gpu_memory_limit_slop_factor"]
        assert slop > target.XLA_SLOP_PERCENT
        compiled = target.deviceless_limit(gpu, io) * slop / target.XLA_SLOP_PERCENT
        run = (fraction * memory - io) * target.XLA_SLOP_PERCENT / 100
        assert run * 0.99 <= compiled <= run, (io, slop)
    assert target.memory_limit_options(gpu, 0.85 * memory) == {}  # no factor maps a negative limit
