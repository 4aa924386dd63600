"""The distributed optimizer's float32 masters and the step's working copy (``training/working_copy.py``)."""

import jax
import numpy as np
import pytest
from flax import nnx
from helpers import losses, tiny_config

from jaxtron.training import state as state_lib
from jaxtron.training.loop import run
from jaxtron.training.working_copy import as_masters, working_copy


def _dtypes(tree) -> dict[str, str]:
    return {jax.tree_util.keystr(path): str(a.dtype)
            for path, a in jax.tree_util.tree_leaves_with_path(nnx.to_pure_dict(tree))}


def test_the_working_copy_casts_the_projections_and_leaves_the_masters_as_they_were():
    """bfloat16 compute: every block projection's weight comes in bfloat16, the norms, the embedding and the head
    stay float32, and the masters keep float32 (a copy that cast them in place once made the step's updated
    parameters bfloat16, GPT-3's published layout on the H100 target included)."""
    setup = state_lib.setup(tiny_config(execution=dict(dtype="bfloat16")), "xla")
    masters = jax.tree.map(lambda s: np.ones(s.shape, s.dtype), setup.abstract_state.params)
    work = _dtypes(working_copy(setup.graphdef, masters))
    assert set(_dtypes(masters).values()) == {"float32"}
    cast = {k for k, v in work.items() if v == "bfloat16"}
    assert cast and all(k.endswith("['weight']") for k in cast), cast
    assert {"['layers']['attn']['wq']['weight']", "['layers']['mlp']['wo']['weight']"} <= cast
    assert work["['embedding']"] == work["['final_norm']['scale']"] == "float32"
    grads = as_masters(working_copy(setup.graphdef, masters), masters)
    assert set(_dtypes(grads).values()) == {"float32"}


@pytest.mark.slow
@pytest.mark.extended  # meshes: the extended tier's (the first tier's time); the first keeps the unit check
@pytest.mark.parametrize("mesh,schedule", [(dict(data=2, fsdp=2, tensor=2), None),
                                           (dict(pipeline=2, data=2, tensor=2), "1f1b")])
def test_a_bfloat16_run_with_the_distributed_optimizer_keeps_float32_masters(mesh, schedule, tmp_path):
    """Under the distributed optimizer, in bfloat16: the parameters stay float32 and split over data as the
    moments are, and the run follows the same mesh's run without it (losses to 2e-3: the working copy holds the
    casts each step made before, so only reduction orders differ)."""
    sections = dict(execution=dict(dtype="bfloat16"), train=dict(microbatches=1 if schedule else 2))
    if schedule:
        sections["pipeline"] = dict(schedule=schedule, microbatches=4)
    plain = run(tiny_config(mesh, **sections), str(tmp_path / "plain"), use_tqdm=False)
    summary = run(tiny_config(mesh, optimizer=dict(distributed=True), **sections), str(tmp_path / "dopt"),
                  use_tqdm=False)
    np.testing.assert_allclose(losses(summary), losses(plain), rtol=2e-3)
    assert set(_dtypes(summary.state.params).values()) == {"float32"}
    wo = summary.state.params["layers"]["mlp"]["wo"]["weight"].get_value()
    whole = plain.state.params["layers"]["mlp"]["wo"]["weight"].get_value()
    # [layers, mlp / tensor, embed]: the masters' embed also over data, where the plain run's is whole over it
    assert wo.sharding.shard_shape(wo.shape)[-1] * 2 == whole.sharding.shard_shape(whole.shape)[-1]


@pytest.mark.slow
@pytest.mark.extended  # a mesh: the extended tier's
def test_a_lora_run_with_the_distributed_optimizer_equals_one_without(tmp_path):
    """LoRA on data=2 fsdp=2 with 2 microbatches: the gradients of the adapters alone come back in their masters'
    dtypes (``as_masters`` takes the trainable part), and the losses equal the run without it to 1e-5."""
    base = str(tmp_path / "base")
    run(tiny_config(train=dict(steps=2), checkpoint=dict(every=0)), base, use_tqdm=False, devices=jax.devices()[:1])

    def lora_run(name: str, distributed: bool):
        cfg = tiny_config(dict(data=2, fsdp=2), train=dict(steps=3, init_from=base, microbatches=2),
                          checkpoint=dict(every=0), lora=dict(rank=4, alpha=8.0, targets="q,v,o,down"),
                          optimizer=dict(distributed=distributed))
        return run(cfg, str(tmp_path / name), use_tqdm=False, devices=jax.devices()[:4])

    plain, split = lora_run("plain", False), lora_run("split", True)
    np.testing.assert_allclose(losses(split), losses(plain), rtol=1e-5)
    assert losses(split)[-1] != losses(split)[0]
