"""Numerical faults: a non-finite loss or gradient skips its update and is counted; N in a row stop the run."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from helpers import tiny_config
from jaxtron.checkpoint import CHECKPOINT_DIR
from jaxtron.data.loader import SyntheticSource
from jaxtron.training import loop as loop_lib
from jaxtron.training import state as state_lib
from jaxtron.training.step import train_step


class NaNAfter(SyntheticSource):
    """Synthetic rows whose loss mask (float) turns NaN from sample ``first_bad`` on: an injected fault."""

    def __init__(self, first_bad: int):
        super().__init__(256, 32, 0)
        self.first_bad = first_bad

    def rows(self, samples):
        out = super().rows(samples)
        mask = out["loss_mask"].astype(np.float32)
        mask[np.asarray(samples) >= self.first_bad] = np.nan
        return {**out, "loss_mask": mask}


def _params(state):
    return [np.asarray(x) for x in jax.tree.leaves(nnx.to_pure_dict(state.params))]


def test_a_nan_step_is_skipped_and_counted():
    cfg = tiny_config(train=dict(max_nonfinite_in_row=3))
    setup = state_lib.setup(cfg, "xla")
    step = jax.jit(lambda s, b: train_step(setup, s, b))
    good = {k: jnp.asarray(v) for k, v in NaNAfter(10**9).rows(np.arange(8)).items()}
    bad = {k: jnp.asarray(v) for k, v in NaNAfter(0).rows(np.arange(8)).items()}
    state = state_lib.init_state(cfg, "xla", None)
    state, _ = step(state, good)
    before = _params(state)
    state, metrics = step(state, bad)
    assert not np.isfinite(float(metrics["loss"]))
    for a, b in zip(_params(state), before):  # the update was skipped: nothing changed
        np.testing.assert_array_equal(a, b)
    assert state.nonfinite.tolist() == [1, 1, -1] and int(state.step) == 2
    state, metrics = step(state, good)
    assert np.isfinite(float(metrics["loss"])) and int(metrics["nonfinite_steps"]) == 1
    assert state.nonfinite.tolist() == [1, 0, -1]
    assert any((a != b).any() for a, b in zip(_params(state), before))
    for _ in range(3):
        state, _ = step(state, bad)
    assert state.nonfinite.tolist() == [4, 3, 6]  # the third in a row, at step 6, reached the limit


def test_too_many_nonfinite_steps_stop_the_run_and_no_bad_state_is_saved(tmp_path, monkeypatch):
    source = NaNAfter(first_bad=2 * 8)  # steps 1 and 2 are fine, every later one is NaN
    monkeypatch.setattr(loop_lib, "make_sources", lambda cfg: (source, None, {}))
    cfg = tiny_config(train=dict(steps=10, max_nonfinite_in_row=2, eval_batches=0), checkpoint=dict(every=1))
    with pytest.raises(loop_lib.NonFiniteError, match="2 non-finite steps in a row, the last at step 4"):
        loop_lib.run(cfg, str(tmp_path), use_tqdm=False, devices=jax.devices()[:1])
    saved = sorted(int(s) for s in os.listdir(tmp_path / CHECKPOINT_DIR) if s.isdigit())
    assert saved[-1] <= 3  # nothing at or after the step that stopped the run
    # what was saved is finite: the skipped updates never touched the state
    import orbax.checkpoint as ocp
    tree = ocp.PyTreeCheckpointer().restore(os.path.join(tmp_path, CHECKPOINT_DIR, str(saved[-1]), "state"))
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(tree) if np.asarray(x).dtype.kind == "f")


def test_skipping_without_a_limit_trains_on(tmp_path, monkeypatch):
    source = NaNAfter(first_bad=8)  # every step after the first is NaN
    monkeypatch.setattr(loop_lib, "make_sources", lambda cfg: (source, None, {}))
    cfg = tiny_config(train=dict(steps=4, eval_batches=0), checkpoint=dict(every=0))
    summary = loop_lib.run(cfg, str(tmp_path), use_tqdm=False, devices=jax.devices()[:1])
    assert [h["nonfinite_steps"] for h in summary["history"]] == [0, 1, 2, 3]
