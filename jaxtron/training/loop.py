"""The training loop: the only place with side effects (data, logging, metrics files)."""

from __future__ import annotations

import collections
import functools
import json
import logging
import os
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxtron.parallel import launch
from jaxtron.checkpoint.train_state import Checkpointer
from jaxtron.config.schema import Config, ConfigError
from jaxtron.data import position as data_position
from jaxtron.data.loader import BatchIterator, BatchLimits, global_batch, make_sources
from jaxtron.parallel.mesh import make_mesh, process_aware_mesh
from jaxtron.metrics import flops as flops_lib
from jaxtron.metrics.collectives import collectives
from jaxtron.metrics.throughput import Throughput
from jaxtron.metrics.writers import MetricsWriter
from jaxtron.ops.attention import resolve_implementation
from jaxtron.checkpoint.params import restore_params
from jaxtron.parallel.sharding import batch_sharding, describe, shard_count
from jaxtron.training import state as state_lib
from jaxtron.training.preemption import PREEMPTED_EXIT_CODE, PreemptionWatcher, StopVotes
from jaxtron.training.profiling import ProfileWindow, device_memory
from jaxtron.training.step import compile_train_step, eval_step
from jaxtron.training.watchdog import Watchdog

log = logging.getLogger(__name__)

NONFINITE_EXIT_CODE = 3
STEP_FLAGS = ("stop_requested", "nonfinite_stopped", "state_finite", "nonfinite_kind")  # for the loop, not metrics
NONFINITE_KINDS = {1: "loss", 2: "gradients", 3: "loss and gradients"}


class NonFiniteError(RuntimeError):
    """Training stopped: too many non-finite steps in a row, or a non-finite state about to be saved."""


class NonFiniteStreak:
    """Follows the run of skipped (non-finite) steps from the flags the loop reads: warns at the first step of
    each run and names it, with what was not finite, when ``train.max_nonfinite_in_row`` stops training."""

    def __init__(self, limit: int, start: int, in_row_at_start: int):
        self.limit = limit
        # a resumed state may already be inside a run of skipped steps (those just before ``start``)
        self.first = start - in_row_at_start + 1 if in_row_at_start else None
        self.seen: tuple[int, int] | None = None  # (step, kind) of the run's first step seen here

    def record(self, step: int, kind: int) -> None:
        if not kind:
            self.first = self.seen = None
            return
        if self.seen is None:  # the first non-finite step of a run that this process saw
            self.first = step if self.first is None else self.first
            self.seen = (step, kind)
            limit = f"training stops after {self.limit} in a row" if self.limit else "train.max_nonfinite_in_row is 0"
            log.warning("step %d: the %s %s not finite; its update was skipped (%s)", step, NONFINITE_KINDS[kind],
                        "were" if kind > 1 else "was", limit)

    def stop_message(self, stopped: int) -> str:
        first = self.first if self.first is not None else stopped - self.limit + 1
        what = f" (step {self.seen[0]}: non-finite {NONFINITE_KINDS[self.seen[1]]})" if self.seen else ""
        return (f"{self.limit} non-finite steps in a row, from step {first} to step {stopped}{what}; their updates "
                "were skipped and training stopped.")


def save_checkpoint(checkpointer: Checkpointer, step: int, state, cfg: Config, state_finite: bool,
                    data_state: dict | None = None) -> None:
    """What the loop does to save: refuse a non-finite state (``state_finite`` comes from the train step that
    produced it), then save (asynchronously if so configured) with the data position (default: step alone)."""
    if not state_finite:  # never write a non-finite state
        raise NonFiniteError(f"the state is not finite at step {step}; it was not saved.")
    checkpointer.save(step, state, data_state or {"step": step}, cfg.to_dict())


def _check_workdir(workdir: str) -> None:
    try:
        os.makedirs(workdir, exist_ok=True)
        probe = os.path.join(workdir, f".write_test.{jax.process_index()}")
        with open(probe, "w") as f:
            f.write("ok")
        os.remove(probe)
    except OSError as e:
        raise ConfigError(f"workdir '{workdir}' is not writable ({e.strerror}); pass a writable --workdir.") from None


def scalar_metrics(metrics: dict[str, Any]) -> dict[str, float]:
    """Step metrics as floats; a vector such as ``expert_load`` becomes one key per entry (expert_load/0, ...)."""
    values = {}
    for key, value in metrics.items():
        if key in STEP_FLAGS:
            continue
        value = np.asarray(value)
        if value.ndim:
            values.update({f"{key}/{i}": float(v) for i, v in enumerate(value.reshape(-1))})
        else:
            values[key] = float(value)
    return values


def batch_limits(cfg: Config, implementation: str) -> BatchLimits:
    """What the model accepts of a batch: positions inside its table, and as many documents a row as cuDNN's
    packed attention is built for."""
    return BatchLimits(max_positions=cfg.model.max_seq_len,
                       max_segments=cfg.model.attention_max_segments if implementation == "cudnn" else None)


def evaluate(cfg: Config, eval_fn, params, source, mesh, implementation: str = "xla") -> float | None:
    """Mean cross-entropy over the same ``train.eval_batches`` validation batches every time."""
    if source is None or cfg.train.eval_batches == 0:
        return None
    total, count = 0.0, 0.0
    for i in range(cfg.train.eval_batches):
        batch = global_batch(source, i, mesh, cfg.train.global_batch_size, batch_limits(cfg, implementation))
        out = jax.device_get(eval_fn(params, batch))
        total, count = total + float(out["ce_sum"]), count + float(out["count"])
    return total / count


def run(cfg: Config, workdir: str, *, print_sharding: bool = False, use_tqdm: bool | None = None,
        devices: list[jax.Device] | None = None) -> dict[str, Any]:
    """Trains ``cfg`` on ``devices`` (default: all) and writes metrics into ``workdir``.

    Returns a summary of the run: final and held-out loss, throughput, the logged history and the state.
    """
    devices = list(devices) if devices is not None else jax.devices()
    sizes = cfg.check_devices(len(devices))
    mesh = process_aware_mesh(sizes, devices) if jax.process_count() > 1 else make_mesh(sizes, devices)
    implementation = resolve_implementation(cfg.model.attention, jnp.dtype(cfg.model.dtype),
                                            cfg.model.resolved_head_dim,
                                            shard_count(sizes, "activation_length"))
    with jax.set_mesh(mesh):
        setup = state_lib.setup(cfg, implementation)
        shardings = state_lib.state_shardings(mesh, setup.abstract_state)
        if print_sharding:
            print(describe(mesh, setup.abstract_state.params))
            return {}
        state_lib.check_fits(setup.abstract_state, shardings, devices)
        _check_workdir(workdir)
        return _train(cfg, workdir, mesh, setup, shardings, implementation, use_tqdm)


def _train(cfg, workdir, mesh, setup, shardings, implementation, use_tqdm) -> dict[str, Any]:
    t = cfg.train
    is_main = jax.process_index() == 0
    train_source, validation, facts = make_sources(cfg)
    data_setup = data_position.fingerprint(cfg)
    n_params = flops_lib.param_count(cfg.model)
    active = f" ({flops_lib.param_count(cfg.model, active=True) / 1e6:.4g}M active per token)" \
        if cfg.model.num_experts else ""
    log.info("model %s: %.4gM parameters%s; mesh %s; attention %s; compute %s", cfg.model.name, n_params / 1e6,
             active, dict(mesh.shape), implementation, cfg.model.dtype)
    if "unigram_entropy" in facts:
        log.info("data: %d tokens; unigram entropy of the training text %.4f nats/token (the loss of the best "
                 "context-free model)", facts["train_tokens"], facts["unigram_entropy"])
    if is_main:
        with open(os.path.join(workdir, "config.json"), "w") as f:
            json.dump(cfg.to_dict(), f, indent=2)

    c = cfg.checkpoint
    checkpointer = Checkpointer(workdir, c.keep, c.keep_every, c.async_save)
    resumed: dict[str, data_position.DataPosition] = {}

    def check_data(saved: dict) -> None:  # before any array is read: a changed data setup is refused at once
        resumed["position"] = data_position.resume(cfg, data_setup, saved)

    try:
        restored = checkpointer.restore_latest(setup.abstract_state, shardings, cfg, check_data)  # newest intact
    except ConfigError:
        checkpointer.close()
        raise
    if restored is None:
        state, start = state_lib.init_state(cfg, implementation, shardings), 0
        position = data_position.DataPosition.start(cfg, data_setup)
        if t.init_from:  # fine-tuning start: these parameters, a fresh optimizer and step 0
            params = restore_params(t.init_from, setup.abstract_state.params, shardings.params)
            state = state.replace(params=params)
            log.info("parameters from %s; optimizer state fresh", t.init_from)
    else:
        state, position = restored[0], resumed["position"]
        start = position.step
        log.info("resumed from the checkpoint of step %d in %s", start, checkpointer.directory)
        if is_main:
            _drop_metrics_after(workdir, start)
    if start >= t.steps:  # a finished run: nothing left to train
        checkpointer.close()
        log.info("the run already reached train.steps = %d; raise it to train further", t.steps)
        return {"preempted": None, "history": [], "state": state, "final_loss": None, "validation_loss": None}
    batches = BatchIterator(train_source, mesh, t.global_batch_size, step=start, workers=cfg.data.workers,
                            limits=batch_limits(cfg, implementation), sample_offset=position.offset)
    batch = next(batches)
    votes = StopVotes(mesh)
    compiled, compile_s = compile_train_step(setup, shardings, batch_sharding(mesh), state, batch, votes(False))
    throughput = Throughput(cfg, mesh.size, mesh.devices.flat[0].device_kind, implementation)
    log.info("compiled the train step in %.1f s; %.4g model TFLOP per step; %s", compile_s,
             throughput.model_flops / 1e12, throughput.peak_note)
    if is_main:
        _write_collectives(workdir, compiled)

    eval_fn = jax.jit(functools.partial(eval_step, setup), in_shardings=(shardings.params, batch_sharding(mesh)))
    writer = MetricsWriter(workdir, t.steps, use_tqdm=use_tqdm) if is_main else None
    history: list[dict[str, Any]] = []
    interval_start, interval_losses, data_wait = time.perf_counter(), [], 0.0
    profile = ProfileWindow(cfg.profile, workdir, start)
    preemption = PreemptionWatcher()
    watchdog = Watchdog(t.watchdog_factor, jax.process_index())
    # (step, *STEP_FLAGS) of dispatched steps whose flags were not read yet. A flag is read one step late, so
    # reading it never stalls the device; every process reads the same flags after the same steps, so all of
    # them take the same decisions.
    unread: collections.deque = collections.deque()
    single_process = jax.process_count() == 1
    finite = [1]  # state_finite of the last step read

    def save(step_done: int, force: bool) -> None:
        if not (force or (c.every and step_done % c.every == 0)):
            return
        read_flags(step_done)  # a state is saved only once its step's flags were read
        watchdog.pause()
        save_checkpoint(checkpointer, step_done, state, cfg, finite[0], position.at(step_done).to_dict())
        watchdog.resume()

    streak = NonFiniteStreak(t.max_nonfinite_in_row, start, int(jax.device_get(state.nonfinite)[1]))

    def read_flags(upto: int) -> bool:
        """Reads the flags of steps up to ``upto``; raises if the run must stop; True if a stop was asked."""
        requested = False
        while unread and unread[0][0] <= upto:
            step_done, *flags = unread.popleft()
            stop_requested, stopped, finite[0], kind = (int(x) for x in jax.device_get(flags))  # waits for it
            watchdog.completed(step_done)
            launch.report_step(step_done)
            streak.record(step_done, kind)
            if stopped >= 0:
                raise NonFiniteError(streak.stop_message(stopped))
            requested |= bool(stop_requested)
        return requested

    summary: dict[str, Any] = {"preempted": None}
    done = start
    watchdog.start(start)
    try:
        for step in range(start, t.steps):
            done = step + 1
            profile.before_step(step, lambda: jax.block_until_ready(state))
            with profile.annotate(done):
                state, metrics = compiled(state, batch, votes(preemption.requested is not None))
            unread.append((done, *(metrics[k] for k in STEP_FLAGS)))
            interval_losses.append(metrics["loss"])  # stays on device until the log step
            if done < t.steps:  # loaded ahead by the iterator while the device works on this step
                waited = time.perf_counter()
                with watchdog.input(done + 1):
                    batch = next(batches)
                data_wait += time.perf_counter() - waited  # time the host blocked on the loader
            profile.after_step(done, lambda: jax.block_until_ready(state))
            log_now = done % t.log_every == 0 or done == t.steps
            save_now = c.every and done % c.every == 0
            stop = read_flags(done if log_now or save_now else done - 1)  # these steps wait for the device anyway
            # one process alone needs no agreement: it stops at the first step boundary after the signal
            stop |= single_process and preemption.requested is not None
            if log_now:
                values = scalar_metrics(jax.device_get(metrics))
                values["loss_avg"] = float(np.mean(jax.device_get(interval_losses)))  # since the last log line
                interval = time.perf_counter() - interval_start
                values.update(throughput(interval, len(interval_losses)))
                values["interval_steps"] = len(interval_losses)
                values["consumed_tokens"] = position.at(done).consumed_tokens
                values["data_wait_s"] = data_wait / len(interval_losses)  # per step, host blocked on the loader
                values["data_wait_share"] = data_wait / interval
                values.update(device_memory())
                if not history:
                    values["compile_time_s"] = compile_s
                if writer:
                    writer.write(done, values)
                history.append({"step": done, **values})
                interval_start, interval_losses, data_wait = time.perf_counter(), [], 0.0
            if t.eval_every and done % t.eval_every == 0 and done < t.steps:
                watchdog.pause()
                loss = evaluate(cfg, eval_fn, state.params, validation, mesh, implementation)
                if writer and loss is not None:
                    writer.write(done, {"eval/loss": loss})
                interval_start, data_wait = time.perf_counter(), 0.0  # evaluation time is not training time
                watchdog.resume()
            if stop and done < t.steps:
                save(done, force=True)
                checkpointer.wait()
                why = preemption.requested or "a stop request from another process"
                log.warning("checkpointed step %d after %s; exiting with %d", done, why, PREEMPTED_EXIT_CODE)
                summary.update(preempted=why, stopped_at=done, history=history, state=state)
                return summary
            save(done, force=done == t.steps)  # periodic saves, and always the last step
        last = history[-1]
        validation_loss = evaluate(cfg, eval_fn, state.params, validation, mesh, implementation)
        summary.update({"final_loss": last.get("loss_avg"), "validation_loss": validation_loss,
                        "compile_time_s": compile_s, "slow_steps": watchdog.slow_steps, **facts,
                        **{k: last.get(k) for k in ("tokens_per_sec", "tflops_per_device", "mfu")}})
        if writer:
            if validation_loss is not None:
                writer.write(t.steps, {"eval/loss": validation_loss})
            writer.log(_summary_line(summary))
    finally:
        profile.close(done)
        watchdog.close()
        preemption.close()
        checkpointer.close()  # waits for a save in flight
        batches.close()
        if writer:
            writer.close()
    summary.update(history=history, state=state)
    return summary


def _write_collectives(workdir: str, compiled) -> None:
    """The collectives of the compiled step (count and result bytes per step and device, by kind) into
    ``collectives.json``, for ``jaxtron.metrics.report``."""
    try:
        text = compiled.as_text()
    except Exception as e:  # some backends cannot print an executable; the report then says so
        log.warning("could not read the compiled step's HLO (%s); collectives.json not written", e)
        return
    with open(os.path.join(workdir, "collectives.json"), "w") as f:
        json.dump(collectives(text), f, indent=1)


def _drop_metrics_after(workdir: str, step: int) -> None:
    """Keeps metrics.jsonl consistent with the resumed state: lines of steps after it are re-logged."""
    path = os.path.join(workdir, "metrics.jsonl")
    if not os.path.exists(path):
        return
    with open(path) as f:
        lines = [line for line in f if line.strip() and json.loads(line).get("step", 0) <= step]
    with open(path + ".tmp", "w") as f:
        f.writelines(lines)
    os.replace(path + ".tmp", path)


def _summary_line(summary: dict[str, Any]) -> str:
    parts = [f"train loss {summary['final_loss']:.4f} nats/token (mean of the last log interval)"]
    if summary.get("validation_loss") is not None:
        parts.append(f"validation loss {summary['validation_loss']:.4f}")
    if summary.get("unigram_entropy") is not None:
        parts.append(f"unigram entropy of the text {summary['unigram_entropy']:.4f}")
    return "done: " + "; ".join(parts)
