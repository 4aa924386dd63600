"""The shipped ``:tiny`` sizes of Gemma 3 and gpt-oss (windows shorter than their rows), of Qwen3.5 (rows of two
chunks of the delta rule) and of Llama 4 (four attention chunks a row): 3 float32 steps on meshes over fsdp, tensor,
sequence and expert equal one device's to 1e-5, with every mechanism in the step (local and global layers, sinks,
biases, post-norms, the clamped SwiGLU, the experts' biases; Gated DeltaNet, the output gate, partial RoPE and the
gated shared expert; chunked attention, NoPE layers and their temperature, experts scaling their input)."""

import os

import jax
import numpy as np
import pytest
from conftest import REPO
from helpers import losses

from jaxtron.config.loader import config_of
from jaxtron.training.loop import run

# synthetic rows of 128 tokens (the windows are 32): on a sequence split in two each device's half-columns are 32
# long, so the blockwise kernel gathers only the window's keys
OVERRIDES = ["--config.train.steps=3", "--config.train.log_every=1", "--config.train.eval_every=0",
             "--config.train.eval_batches=0", "--config.train.global_batch_size=8", "--config.data.source=synthetic",
             "--config.data.seq_len=128", "--config.optimizer.warmup_steps=1"]
MESHES = {"fsdp2_sequence2_tensor2": dict(fsdp=2, sequence=2, tensor=2), "fsdp8": dict(fsdp=8),
          "fsdp2_sequence2_expert2": dict(fsdp=2, sequence=2, expert=2),
          "fsdp4_tensor2": dict(fsdp=4, tensor=2),
          # Gemma 3's lead block outside the schedule, its periods of three staged; gpt-oss's two MoE blocks a period
          "pipeline2_fsdp4": dict(pipeline=2, fsdp=4), "pipeline2_fsdp2_expert2": dict(pipeline=2, fsdp=2, expert=2)}
# a pipeline's microbatches: the load-balancing loss is a mean over each microbatch's tokens, not the batch's, so the
# gpt-oss pipeline runs without it
PIPELINE = ["--config.train.global_batch_size=16", "--config.pipeline.microbatches=2",
            "--config.train.router_aux_loss=0"]


def _config(family, mesh):
    """``family``: a config file's name, with ``:size`` (default ``:tiny``)."""
    axes = ("pipeline", "data", "fsdp", "sequence", "expert", "tensor")
    sizes = [f"--config.mesh.{axis}={mesh.get(axis, 1)}" for axis in axes]
    file, _, size = family.partition(":")
    return config_of(os.path.join(REPO, "configs", f"{file}.py") + f":{size or 'tiny'}",
                     OVERRIDES + sizes + (PIPELINE if "pipeline" in mesh else []))


@pytest.fixture(scope="session")  # once per test process (tests/conftest.py)
def one_device(tmp_path_factory):
    """Each family's one-device run, made when a test first asks for it."""
    runs = {}

    def baseline(family):
        if family not in runs:
            runs[family] = run(_config(family, {}), str(tmp_path_factory.mktemp(family.replace(":", "_"))),
                               use_tqdm=False, devices=jax.devices()[:1])
        return runs[family]

    return baseline


@pytest.fixture(scope="session")
def one_device_pipeline_batch(tmp_path_factory):
    """One device on the pipeline cases' batch of 16 rows, without the load-balancing loss."""
    return {family: run(config_of(os.path.join(REPO, "configs", f"{family}.py") + ":tiny",
                                  [*OVERRIDES, "--config.mesh.fsdp=1", *PIPELINE, "--config.pipeline.microbatches=1"]),
                        str(tmp_path_factory.mktemp(family)), use_tqdm=False, devices=jax.devices()[:1])
            for family in ("gemma3", "gpt_oss")}


@pytest.mark.slow
@pytest.mark.extended
@pytest.mark.parametrize("family,mesh_name", [("gemma3", "pipeline2_fsdp4"), ("gpt_oss", "pipeline2_fsdp2_expert2")])
def test_tiny_families_in_a_pipeline_train_as_one_device(family, mesh_name, one_device_pipeline_batch, tmp_path):
    summary = run(_config(family, MESHES[mesh_name]), str(tmp_path), use_tqdm=False)
    expected = losses(one_device_pipeline_batch[family])
    assert len(expected) == 3 and np.all(np.diff(expected) != 0)
    np.testing.assert_allclose(losses(summary), expected, rtol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("family,mesh_name", [
    # all in the extended tier: the first tier's time is close to its limit
    *(pytest.param(family, mesh, marks=pytest.mark.extended) for family, mesh in (
        ("gpt_oss", "fsdp2_sequence2_expert2"), ("gemma3", "fsdp2_sequence2_tensor2"), ("gemma3", "fsdp8"),
        ("gpt_oss", "fsdp2_sequence2_tensor2"),
        ("gpt_oss", "fsdp4_tensor2"),
        ("qwen3_5", "fsdp2_sequence2_tensor2"), ("qwen3_5", "fsdp4_tensor2"),
        ("qwen3_5:tiny_moe", "fsdp2_sequence2_expert2"), ("qwen3_5:tiny_moe", "fsdp2_sequence2_tensor2"),
        ("llama4", "fsdp2_sequence2_expert2"), ("llama4", "fsdp2_sequence2_tensor2"), ("llama4", "fsdp4_tensor2")))])
def test_tiny_families_train_alike_on_every_mesh(family, mesh_name, one_device, tmp_path):
    summary = run(_config(family, MESHES[mesh_name]), str(tmp_path), use_tqdm=False)
    expected = losses(one_device(family))
    assert len(expected) == 3 and np.all(np.diff(expected) != 0)
    np.testing.assert_allclose(losses(summary), expected, rtol=1e-5)
    # a stack of each family's own kind holds its mechanism's parameters
    name, part = {"gemma3": ("lead_layers", "mlp_post_norm"), "gpt_oss": ("moe_layers", "attn.sinks"),
                  "qwen3_5": ("layers", "attn.wg"), "qwen3_5:tiny_moe": ("linear_moe_layers", "attn.a_log"),
                  "llama4": ("moe_layers", "mlp.shared")}[family]
    tree = summary.state.params[name]
    for key in part.split("."):
        tree = tree[key]
    assert tree is not None
