"""Numerical faults: a non-finite loss or gradient skips its update and is counted; N in a row stop the run."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import tiny_config

from jaxtron.checkpoint.train_state import CHECKPOINT_DIR
from jaxtron.data.loader import SyntheticSource
from jaxtron.training import loop as loop_lib
from jaxtron.training import state as state_lib
from jaxtron.training import step as step_lib
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


@pytest.mark.slow
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
    for a, b in zip(_params(state), before, strict=True):  # the update was skipped: nothing changed
        np.testing.assert_array_equal(a, b)
    assert state.nonfinite.tolist() == [1, 1, -1] and int(state.step) == 2
    state, metrics = step(state, good)
    assert np.isfinite(float(metrics["loss"])) and int(metrics["nonfinite_steps"]) == 1
    assert state.nonfinite.tolist() == [1, 0, -1]
    assert any((a != b).any() for a, b in zip(_params(state), before, strict=True))
    for _ in range(3):
        state, _ = step(state, bad)
    assert state.nonfinite.tolist() == [4, 3, 6]  # the third in a row, at step 6, reached the limit
    stopped_at = _params(state)
    state, metrics = step(state, good)  # the run has stopped: not even a finite step changes the state
    assert int(metrics["nonfinite_stopped"]) == 6 and int(metrics["stop_requested"]) == 0
    for a, b in zip(_params(state), stopped_at, strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.slow
def test_too_many_nonfinite_steps_stop_the_run_and_no_bad_state_is_saved(tmp_path, monkeypatch):
    source = NaNAfter(first_bad=2 * 8)  # steps 1 and 2 are fine, every later one is NaN
    monkeypatch.setattr(loop_lib, "make_sources", lambda cfg: (source, None, {}))
    cfg = tiny_config(train=dict(steps=10, max_nonfinite_in_row=2, eval_batches=0), checkpoint=dict(every=1))
    with pytest.raises(loop_lib.NonFiniteError) as stop:
        loop_lib.run(cfg, str(tmp_path), use_tqdm=False, devices=jax.devices()[:1])
    assert str(stop.value).startswith("2 non-finite steps in a row, from step 3 to step 4 (step 3: non-finite loss "
                                      "and gradients);")
    saved = sorted(int(s) for s in os.listdir(tmp_path / CHECKPOINT_DIR) if s.isdigit())
    assert saved[-1] <= 3  # nothing at or after the step that stopped the run
    # what was saved is finite: the skipped updates never touched the state
    import orbax.checkpoint as ocp
    tree = ocp.PyTreeCheckpointer().restore(os.path.join(tmp_path, CHECKPOINT_DIR, str(saved[-1]), "state"))
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(tree) if np.asarray(x).dtype.kind == "f")


@pytest.mark.slow
def test_skipping_without_a_limit_trains_on(tmp_path, monkeypatch):
    source = NaNAfter(first_bad=8)  # every step after the first is NaN
    monkeypatch.setattr(loop_lib, "make_sources", lambda cfg: (source, None, {}))
    cfg = tiny_config(train=dict(steps=4, eval_batches=0, max_nonfinite_in_row=0), checkpoint=dict(every=0))
    summary = loop_lib.run(cfg, str(tmp_path), use_tqdm=False, devices=jax.devices()[:1])
    assert [h["nonfinite_steps"] for h in summary.history] == [0, 1, 2, 3]


class NaNSteps(SyntheticSource):
    """Synthetic rows whose loss mask is NaN in the given (1-based) steps of batch size 8."""

    def __init__(self, bad_steps):
        super().__init__(256, 32, 0)
        self.bad_steps = set(bad_steps)

    def rows(self, samples):
        out = super().rows(samples)
        mask = out["loss_mask"].astype(np.float32)
        mask[[int(g) // 8 + 1 in self.bad_steps for g in samples]] = np.nan
        return {**out, "loss_mask": mask}


@pytest.mark.slow
def test_skipped_steps_warn_stop_by_default_and_the_logged_learning_rate_is_the_applied_one(tmp_path, monkeypatch,
                                                                                          caplog):
    import json

    from jaxtron.config.schema import TrainConfig
    from jaxtron.training.optimizer import learning_rate_schedule
    limit = TrainConfig().max_nonfinite_in_row
    assert limit == 5  # stopping is the default, after a small number of skipped steps in a row
    monkeypatch.setattr(loop_lib, "make_sources", lambda cfg: (NaNSteps({2, 3, 6, 7, 8, 9, 10}), None, {}))
    cfg = tiny_config(train=dict(steps=20, eval_batches=0, max_nonfinite_in_row=limit), checkpoint=dict(every=0),
                      optimizer=dict(warmup_steps=4, learning_rate=1e-2))
    with caplog.at_level("WARNING", logger="jaxtron.training.loop"), pytest.raises(loop_lib.NonFiniteError) as stop:
        loop_lib.run(cfg, str(tmp_path), use_tqdm=False, devices=jax.devices()[:1])
    assert str(stop.value).startswith("5 non-finite steps in a row, from step 6 to step 10 (step 6: non-finite loss "
                                      "and gradients);")
    warnings = [r.getMessage() for r in caplog.records if "not finite" in r.getMessage()]
    assert [w.split(":")[0] for w in warnings] == ["step 2", "step 6"]  # once per run of skipped steps
    # optax's schedule count does not advance over skipped steps; the logged rate follows it
    with open(tmp_path / "metrics.jsonl") as f:
        logged = [json.loads(line) for line in f]
    schedule = learning_rate_schedule(cfg.optimizer, cfg.train.steps)
    applied = [0, 1, 1, 1, 2, 3, 3, 3, 3]
    assert [m["step"] for m in logged] == list(range(1, 10))
    np.testing.assert_allclose([m["learning_rate"] for m in logged], [float(schedule(c)) for c in applied], rtol=1e-6)
    assert [m["nonfinite_steps"] for m in logged] == [0, 1, 2, 2, 2, 3, 4, 5, 6]


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def _watchdog(clock, **kw):
    from jaxtron.training.watchdog import Watchdog
    return Watchdog(5.0, 3, min_steps=4, clock=clock, thread=False, **kw)


def test_the_watchdog_names_a_slow_step_and_the_process(caplog):
    clock = FakeClock()
    dog = _watchdog(clock)
    dog.start(0)
    for step in range(1, 9):  # steady 0.1 s steps; the 6th takes 0.45 s, below 5 times the median
        clock.now += 0.45 if step == 6 else 0.1
        dog.completed(step)
    assert dog.slow_steps == 0 and not caplog.records
    clock.now += 0.7  # a pause (evaluation, a save) is not counted
    dog.pause()
    clock.now += 30
    dog.resume()
    clock.now += 0.1
    dog.completed(9)
    assert dog.slow_steps == 0
    clock.now += 2.0
    with caplog.at_level("WARNING"):
        dog.completed(10)
    assert dog.slow_steps == 1
    assert caplog.messages == [("watchdog: step 10 took 2 s on process 3, 20.0 times the median of the last 9 "
                               "steps (0.1 s)")]


def test_the_watchdog_reports_a_hang_once_and_an_input_wait_by_its_step(caplog):
    clock = FakeClock()
    dog = _watchdog(clock)
    dog.start(0)
    assert not dog.check()  # too few steps to know what is normal
    for step in range(1, 6):
        clock.now += 0.2
        dog.completed(step)
    clock.now += 0.9
    assert not dog.check()
    with caplog.at_level("WARNING"):
        clock.now += 0.2
        assert dog.check()
        clock.now += 5
        assert not dog.check()  # once per step
    assert caplog.messages == [("watchdog: step 6 has run for 1.1 s on process 3 and has not finished, 5.5 times "
                               "the median of the last 5 steps (0.2 s); a peer process may be stuck or gone")]
    dog.completed(6)
    caplog.clear()
    with caplog.at_level("WARNING"):
        clock.now += 0.1
        with dog.input(8):  # 3 s waiting for the input of step 8: step 7 itself takes 0.2 s
            clock.now += 2.0
            assert dog.check()
            clock.now += 1.0
        clock.now += 0.1
        assert not dog.check()
        dog.completed(7)
    assert caplog.messages == [
        ("watchdog: the input batch of step 8 has not arrived after 2 s on process 3, 10.0 times the median step "
        "(0.2 s); the input pipeline may be stuck"),
        "watchdog: the input batch of step 8 took 3 s to arrive on process 3, 15.0 times the median step (0.2 s)"]
    assert list(dog.durations)[-1] == pytest.approx(0.2)


class SlowAt(SyntheticSource):
    """Synthetic rows that take ``seconds`` to produce for one sample: a stalled input pipeline."""

    def __init__(self, sample: int, seconds: float):
        super().__init__(256, 32, 0)
        self.sample, self.seconds = sample, seconds

    def rows(self, samples):
        if self.sample in np.asarray(samples):
            import time
            time.sleep(self.seconds)
        return super().rows(samples)


@pytest.mark.slow
def test_a_stalled_input_batch_is_reported_in_a_real_run(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(loop_lib, "make_sources", lambda cfg: (SlowAt(sample=14 * 8, seconds=3.0), None, {}))
    cfg = tiny_config(train=dict(steps=18, eval_batches=0, log_every=100), checkpoint=dict(every=0))
    with caplog.at_level("WARNING"):
        summary = loop_lib.run(cfg, str(tmp_path), use_tqdm=False, devices=jax.devices()[:1])
    watchdog = [m for m in caplog.messages if m.startswith("watchdog:")]
    inputs = [m for m in watchdog if m.startswith("watchdog: the input batch")]
    assert inputs and all(m.startswith("watchdog: the input batch of step 15 ") for m in inputs), watchdog
    assert "took" in inputs[-1] and "on process 0" in inputs[-1]
    # on a loaded machine a step of its own can run long too (its median is 0.02 s): reported as the step's, not
    # as an input's, and counted when it ends
    others = [m for m in watchdog if m not in inputs]
    assert all(m.startswith("watchdog: step ") for m in others), watchdog
    assert summary.slow_steps == 1 + sum(" took " in m for m in others), watchdog


@pytest.mark.slow
def test_a_state_that_is_not_finite_is_found_at_save_time_and_never_saved(tmp_path):
    from jaxtron.checkpoint.train_state import Checkpointer
    cfg = tiny_config()
    setup = state_lib.setup(cfg, "xla")
    step = jax.jit(lambda s, b: train_step(setup, s, b))
    good = {k: jnp.asarray(v) for k, v in NaNAfter(10**9).rows(np.arange(8)).items()}
    state = state_lib.init_state(cfg, "xla", None)
    state, metrics = step(state, good)
    assert step_lib.state_finite(state)
    mu = state.opt_state[1][0].mu  # an optimizer moment that went bad: the loss and gradients stay finite
    bad_mu = jax.tree.map(lambda x: x.at[(0,) * x.ndim].set(jnp.inf), mu)
    opt_state = (state.opt_state[0], (state.opt_state[1][0]._replace(mu=bad_mu), *state.opt_state[1][1:]),
                 *state.opt_state[2:])
    state, metrics = step(state.replace(opt_state=opt_state), good)
    assert np.isfinite(float(metrics["loss"])) and not step_lib.state_finite(state)
    ckpt = Checkpointer(str(tmp_path), keep=1, async_save=False)
    with pytest.raises(loop_lib.NonFiniteError, match="the state is not finite at step 2; it was not saved"):
        loop_lib.save_checkpoint(ckpt, 2, state, cfg)
    ckpt.close()
    assert ckpt.latest_step() is None
