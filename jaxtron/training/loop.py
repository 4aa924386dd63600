"""The training run (``Trainer``): the only place with side effects (data, logging, metrics files). Its parts are
opened under one ExitStack, its step compiled, and its hooks run after each step at their cadences."""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax

from jaxtron.checkpoint.train_state import LAYER_ORDER, Checkpointer
from jaxtron.common.files import write_json
from jaxtron.config.schema import Config, ConfigError
from jaxtron.data import position as data_position
from jaxtron.data.loader import BatchIterator, BatchLimits, global_batch, make_sources
from jaxtron.metrics import flops as flops_lib
from jaxtron.metrics.collectives import collectives
from jaxtron.metrics.throughput import Throughput
from jaxtron.metrics.wandb_sink import wandb_missing
from jaxtron.metrics.writers import MetricsWriter
from jaxtron.models import lora
from jaxtron.parallel.sharding import batch_sharding
from jaxtron.training import state as state_lib
from jaxtron.training import workdir as workdir_lib
from jaxtron.training.hooks import Hook, RunParts
from jaxtron.training.placement import place
from jaxtron.training.preemption import PREEMPTED_EXIT_CODE, PreemptionWatcher, StopVotes
from jaxtron.training.profiling import Meter, ProfileWindow
from jaxtron.training.rewards import load_reward
from jaxtron.training.rollouts import Rollouts
from jaxtron.training.run_summary import RunSummary, summary_line
from jaxtron.training.step import compile_train_step, eval_step, state_finite
from jaxtron.training.step_flags import NonFiniteError, NonFiniteStreak, StepFlags, scalar_metrics
from jaxtron.training.watchdog import Watchdog
from jaxtron.training.workdir_lock import WorkdirLock

log = logging.getLogger(__name__)


def save_checkpoint(checkpointer: Checkpointer, step: int, state, cfg: Config, data_state: dict | None = None,
                    layer_order: tuple[int, ...] | None = None) -> None:
    """What the loop does to save: refuse a non-finite state (one read of the state on its devices), then save
    (asynchronously if so configured) with the data position (default: step alone) and the order the layer
    stack's periods are stored in (default: natural)."""
    if not state_finite(state):  # never write a non-finite state
        raise NonFiniteError(f"the state is not finite at step {step}; it was not saved.")
    config = cfg.to_dict()
    if layer_order is not None:
        config[LAYER_ORDER] = list(layer_order)
    # a LoRA run saves its adapters alone: the frozen base is train.init_from's, read again on resume
    checkpointer.save(step, state_lib.saved_part(state), data_state or {"step": step}, config)


def batch_limits(cfg: Config, implementation: str) -> BatchLimits:
    """What the model accepts of a batch: positions inside its table, and as many documents a row as cuDNN's
    packed attention is built for."""
    return BatchLimits(max_positions=cfg.model.max_seq_len,
                       max_segments=cfg.execution.attention_max_segments if implementation == "cudnn" else None)


def evaluate(cfg: Config, eval_fn, params, source, mesh, implementation: str = "xla") -> dict[str, float]:
    """Each of ``eval_fn``'s metrics (``step.eval_step``: ``eval/loss``, the mean cross-entropy, or DPO's) over the
    same ``train.eval_batches`` validation batches every time; empty without validation."""
    if source is None or cfg.train.eval_batches == 0:
        return {}
    sums: dict[str, float] = {}
    for i in range(cfg.train.eval_batches):
        batch = global_batch(source, i, mesh, cfg.train.global_batch_size, batch_limits(cfg, implementation))
        for name, value in jax.device_get(eval_fn(params, batch)).items():
            sums[name] = sums.get(name, 0.0) + float(value)
    count = sums.pop("count")
    return {name: value / count for name, value in sums.items()}


def run(cfg: Config, workdir: str, *, use_tqdm: bool | None = None, devices: list[jax.Device] | None = None,
        hooks: Sequence[Hook] = (), resolve_remat: Callable | None = None) -> RunSummary:
    """Trains ``cfg`` on ``devices`` (default: all) into ``workdir``; ``Trainer`` says what each argument is."""
    return Trainer(cfg, workdir, hooks, devices=devices, resolve_remat=resolve_remat, use_tqdm=use_tqdm).run()


class Trainer:
    """One training run, from its parts to its summary. ``run`` reads top to bottom; what runs beside the steps is
    ``hooks``, each with its cadence.

    ``hooks``: the caller's, run after the built-in ones of a step but its checkpoint (``jaxtron.Hook``). A hook's
    ``start`` gets this Trainer once its step is compiled; it may read ``cfg``, ``setup``, ``mesh`` and ``state``
    and call ``record``. ``resolve_remat``: see ``place``. ``use_tqdm``: a progress bar (default: on a terminal).
    """

    def __init__(self, cfg: Config, workdir: str, hooks: Sequence[Hook] = (), *,
                 devices: list[jax.Device] | None = None, resolve_remat: Callable | None = None,
                 use_tqdm: bool | None = None):
        self.cfg, self.workdir, self.use_tqdm, self.given_hooks = cfg, workdir, use_tqdm, tuple(hooks)
        self.devices, self.resolve_remat = devices, resolve_remat
        self.is_main = jax.process_index() == 0
        self.history: list[dict[str, Any]] = []
        self.scores: dict[str, float] = {}  # the newest of each evaluation's values (``record``)
        self.checkpointer: Checkpointer | None = None
        self.parts: RunParts | None = None  # with steps left
        self.saved_at = -1  # the step of the newest save
        self.accepted = False  # the config, checkpoint, data and init_from checks passed: files may change now

    def hooks(self) -> list[Hook]:
        """What runs after a step, in this order, each at its cadence: the built-in work, the given hooks, then
        the checkpoint (so that a checkpoint follows all of its step's work)."""
        t, parts = self.cfg.train, self.parts
        writer = parts.writer
        return [Hook(1, lambda done, _: parts.profile.after_step(done, lambda: jax.block_until_ready(self.state)),
                     name="profile", reads_step=False, device_metrics=True, pauses=False),
                Hook(t.log_every, self._log, name="log", last=True, device_metrics=True, pauses=False),
                Hook(1, lambda done, _: writer.advance(done) if writer is not None else None, name="progress",
                     reads_step=False, device_metrics=True, pauses=False),
                Hook(t.eval_every, lambda done, _: self.record(done, self._validation()), name="evaluate",
                     last=True, device_metrics=True),
                *self.given_hooks,
                Hook(self.cfg.checkpoint.every, lambda done, _: self._save(done), name="save", last=True,
                     device_metrics=True, pauses=False)]

    def run(self) -> RunSummary:
        """Places the run, opens its parts under one ExitStack (closed in the reverse order of opening), compiles
        the step and trains to ``train.steps`` or a stop request."""
        with contextlib.ExitStack() as stack:
            done = self._open(stack)
            if done >= self.cfg.train.steps:  # a finished run: nothing left to train
                log.info("the run already reached train.steps = %d; raise it to train further", self.cfg.train.steps)
                return RunSummary(self.state, [])
            parts = self.parts = self._open_parts(stack)
            compiled, compile_s = compile_train_step(self.setup, self.shardings, batch_sharding(self.mesh),
                                                     self.state, self.batch, parts.votes(False))
            self._compiled(compiled, compile_s)
            return self._loop(done)

    def _open(self, stack: contextlib.ExitStack) -> int:
        """The placement, the workdir's lock, the data sources, the checkpointer and the state (restored or
        fresh). Returns the step the run starts from. A run refused before it was accepted leaves the workdir as
        it was."""
        if self.cfg.train.eval_tasks.strip() and not any(h.name == "tasks" for h in self.given_hooks):
            raise ConfigError("config field 'train.eval_tasks' is set but no hook of this run scores it; train "
                              "with jaxtron.train (or pass hooks=[jaxtron.inference.downstream.task_hook(cfg)]).")
        if (missing := wandb_missing(self.cfg.train.wandb_project)) is not None:
            raise ConfigError(missing)
        placement = place(self.cfg, self.devices, self.resolve_remat)
        self.cfg, self.mesh, self.setup = placement.cfg, placement.mesh, placement.setup
        self.shardings, self.implementation = placement.shardings, placement.implementation
        stack.enter_context(jax.set_mesh(self.mesh))
        state_lib.check_fits(self.setup.abstract_state, self.shardings, list(self.mesh.devices.flat))
        before = workdir_lib.listing(self.workdir)
        workdir_lib.check_writable(self.workdir)
        stack.enter_context(contextlib.closing(WorkdirLock(self.workdir).acquire()))  # refused: nothing was made
        stack.push(lambda kind, error, _: self._refused(error, before))  # runs before the lock is given back
        cfg, c = self.cfg, self.cfg.checkpoint
        self.train_source, self.validation, self.facts = make_sources(cfg)
        # GRPO's reward function, loaded before anything is written: one that cannot be is refused like bad data
        self.reward = load_reward(cfg.rl.reward) if cfg.train.objective == "grpo" else None
        self._log_start()
        self.checkpointer = stack.enter_context(contextlib.closing(
            Checkpointer(self.workdir, c.keep, c.keep_every, c.async_save)))  # waits for a save in flight
        self.state, self.position = self._restore_or_init()
        self.start = self.done = self.position.step
        if self.reward is not None and self.start < cfg.train.steps:  # GRPO: its first batch scored before any write
            self.rollouts = Rollouts(cfg, self.train_source, self.mesh, self.setup.graphdef, self.shardings.params,
                                     lambda: self.state, self.start, self.reward)
            self.batch = next(self.rollouts)
        self.accepted = True
        if self.is_main:  # only now the run's files change (a damaged metrics.jsonl is refused before any)
            workdir_lib.drop_metrics_after(self.workdir, self.start)
            write_json(os.path.join(self.workdir, "config.json"), cfg.to_dict(), indent=2)
            self.checkpointer.remove_incomplete()
        return self.start

    def _refused(self, error: BaseException | None, before: list[str] | None) -> bool:
        if isinstance(error, ConfigError) and not self.accepted:  # a checkpoint, data or init_from mismatch
            workdir_lib.remove_created(self.workdir, before)
        return False  # the error goes on

    def _open_parts(self, stack: contextlib.ExitStack) -> RunParts:
        """The loader at the resumed position and its first batch, then what runs beside the steps."""
        cfg, t, mesh = self.cfg, self.cfg.train, self.mesh
        if self.reward is not None:  # GRPO: each batch sampled from the state of its time, the first one already
            batches = self.rollouts
        else:
            batches = stack.enter_context(contextlib.closing(BatchIterator(
                self.train_source, mesh, t.global_batch_size, step=self.start, workers=cfg.data.workers,
                limits=batch_limits(cfg, self.implementation), sample_offset=self.position.offset)))
            self.batch = next(batches)
        writer = stack.enter_context(contextlib.closing(MetricsWriter(
            self.workdir, t.steps, use_tqdm=self.use_tqdm, sinks=self._sinks()))) if self.is_main else None
        profile = ProfileWindow(cfg.profile, self.workdir, self.start)
        stack.callback(lambda: profile.close(self.done))
        preemption = stack.enter_context(contextlib.closing(PreemptionWatcher()))
        watchdog = stack.enter_context(contextlib.closing(Watchdog(t.watchdog_factor, jax.process_index())))
        streak = NonFiniteStreak(t.max_nonfinite_in_row, self.start, int(jax.device_get(self.state.nonfinite)[1]))
        return RunParts(batches, StopVotes(mesh), writer, profile, preemption, watchdog, StepFlags(streak, watchdog))

    def _sinks(self) -> list:
        """The metrics' receivers beyond the workdir's own files: W&B when train.wandb_project names a project."""
        t = self.cfg.train
        if not t.wandb_project:
            return []
        from jaxtron.metrics.wandb_sink import WandbSink
        return [WandbSink(self.workdir, t.wandb_project, t.wandb_name, self.cfg.to_dict())]

    def _compiled(self, compiled, compile_s: float) -> None:
        """What the compiled step gives the run: its log line, collectives.json, the meter, the hooks' start."""
        cfg, parts, schedule = self.cfg, self.parts, self.setup.stack_runner
        self.compiled, self.compile_s = compiled, compile_s
        throughput = Throughput(cfg, self.mesh.size, self.mesh.devices.flat[0].device_kind, self.implementation)
        log.info("compiled the train step in %.1f s; %.4g model TFLOP per step; %s", compile_s,
                 throughput.model_flops / 1e12, throughput.peak_note)
        hlo = _hlo_text(compiled)  # printed once: collectives.json and the pipeline layout read it
        if self.is_main and hlo is not None:
            write_json(os.path.join(self.workdir, "collectives.json"), collectives(hlo))  # for jaxtron report
        if schedule and parts.profile.enabled:  # what the report needs to find each stage's idle iterations
            parts.profile.write_pipeline_layout(self.mesh, schedule, hlo)
        evaluate_fn = jax.jit(functools.partial(eval_step, self.setup), in_shardings=(
            self.shardings.params, batch_sharding(self.mesh), self.shardings.reference))
        self.eval_fn = lambda params, batch: evaluate_fn(params, batch, self.state.reference)
        self.meter = Meter(throughput, {"pipeline_bubble": schedule.bubble} if schedule else None)
        for hook in self.given_hooks:
            if hook.start is not None:
                hook.start(self)

    def _loop(self, done: int) -> RunSummary:
        t, parts, hooks = self.cfg.train, self.parts, self.hooks()
        parts.watchdog.start(done)
        for step in range(self.start, t.steps):
            self.done = done = step + 1
            metrics = self._step(step, done)
            if done < t.steps:
                self._next_batch(done)
            due = [hook for hook in hooks if hook.due(done, t.steps)]
            # steps whose hooks read the device wait for it anyway, so their own flags are read now
            stop = parts.flags.read(done if any(h.reads_step for h in due) else done - 1)
            # one process alone needs no agreement: it stops at the first step boundary after the signal
            stop |= jax.process_count() == 1 and parts.preemption.requested is not None
            host = scalar_metrics(jax.device_get(metrics)) if any(not h.device_metrics for h in due) else None
            for hook in due:
                self._run_hook(hook, done, metrics if hook.device_metrics else host)
            if stop and done < t.steps:
                return self._stop(done)
        return self._finish()

    def _run_hook(self, hook: Hook, done: int, metrics: dict[str, Any]) -> None:
        if not hook.pauses:
            hook.run(done, metrics)
            return
        self.parts.watchdog.pause()  # its time is neither a slow step nor training time
        hook.run(done, metrics)
        self.meter.restart_clock()
        self.parts.watchdog.resume()

    def record(self, done: int, scores: dict[str, float]) -> None:
        """An evaluation's ``scores`` of the state after ``done`` steps: a metrics line, and the run's summary."""
        if self.parts.writer and scores:
            self.parts.writer.write(done, scores)
        self.scores.update(scores)

    def _log_start(self) -> None:
        cfg = self.cfg
        active = f" ({flops_lib.param_count(cfg.model, active=True) / 1e6:.4g}M active per token)" \
            if cfg.model.moe.num_experts else ""
        log.info("model %s: %.4gM parameters%s; mesh %s; attention %s; compute %s", cfg.model.name,
                 flops_lib.param_count(cfg.model) / 1e6, active, dict(self.mesh.shape), self.implementation,
                 cfg.execution.dtype)
        schedule = self.setup.stack_runner
        if schedule is not None:
            log.info("pipeline: %s schedule, %d stages x %d virtual stages, %d microbatches; bubble fraction %.3f "
                     "((stages - 1) / (microbatches x virtual stages + stages - 1))", schedule.kind, schedule.stages,
                     schedule.virtual_stages, schedule.microbatches, schedule.bubble)
            if schedule.pads:
                log.info("pipeline: the last stage's stack is filled with %d identity layers (uneven split; each "
                         "costs a layer's memory and compute there)", schedule.pads * cfg.model.period)
        if "unigram_entropy" in self.facts:
            log.info("data: %d tokens; unigram entropy of the training text %.4f nats/token (the loss of the best "
                     "context-free model)", self.facts["train_tokens"], self.facts["unigram_entropy"])

    def _restore_or_init(self) -> tuple[Any, data_position.DataPosition]:
        """The newest intact checkpoint with its data position, or a fresh (or fine-tuning) state at step 0. A
        changed data setup is refused before any array of the checkpoint is read."""
        cfg, data_setup, resumed = self.cfg, data_position.fingerprint(self.cfg), {}

        def check_data(saved: dict) -> None:
            resumed["position"] = data_position.resume(cfg, data_setup, saved)

        abstract = self.setup.abstract_state
        init_from = functools.partial(state_lib.init_from_params, cfg, abstract.params, self.shardings.params,
                                      self.setup.layer_order)
        restored = self.checkpointer.restore_latest(state_lib.saved_part(abstract),
                                                    state_lib.saved_part(self.shardings, abstract),
                                                    cfg, check_data, self.setup.layer_order)
        if restored is not None:
            position = resumed["position"]
            log.info("resumed from the checkpoint of step %d in %s", position.step, self.checkpointer.directory)
            state = restored[0].train_state()
            if cfg.lora.rank:  # the checkpoint holds the adapters; the frozen base is train.init_from's
                state = state.replace(params=lora.join(state.params, init_from()))
            if abstract.reference is not None:  # DPO's reference, train.init_from's parameters, is never saved
                state = state.replace(reference=jax.device_put(init_from(), self.shardings.reference))
            return state, position
        state = state_lib.init_state(cfg, self.implementation, self.shardings)
        if cfg.train.init_from:  # fine-tuning start: these parameters, a fresh optimizer and step 0
            base = init_from()
            state = state.replace(params=lora.join(lora.own(state.params), base) if cfg.lora.rank else base)
            if state.reference is not None:  # a copy: the step donates the parameters, never the reference (placed
                # as its rules say: the distributed optimizer splits the parameters over data, not the reference)
                state = state.replace(reference=jax.device_put(jax.tree.map(jax.numpy.copy, base),
                                                               self.shardings.reference))
            log.info("parameters from %s; %s", cfg.train.init_from,
                     f"LoRA adapters of rank {cfg.lora.rank} fresh, the base frozen" if cfg.lora.rank
                     else "optimizer state fresh")
        return state, data_position.DataPosition.start(cfg, data_setup)

    def _step(self, step: int, done: int) -> dict[str, Any]:
        parts = self.parts
        parts.profile.before_step(step, lambda: jax.block_until_ready(self.state))
        with parts.profile.annotate(done):
            self.state, metrics = self.compiled(self.state, self.batch,
                                                parts.votes(parts.preemption.requested is not None))
        parts.flags.push(done, metrics)
        self.meter.losses.append(metrics["loss"])  # stays on the device until the log step
        return metrics

    def _next_batch(self, done: int) -> None:
        """The next batch, loaded ahead by the iterator while the device works on this step."""
        waited = time.perf_counter()
        # GRPO's batches are its sampling, the step's own work: the watchdog times them as a step, not as input
        rollouts = isinstance(self.parts.batches, Rollouts)
        with contextlib.nullcontext() if rollouts else self.parts.watchdog.input(done + 1):
            self.batch = next(self.parts.batches)
        self.meter.data_wait += time.perf_counter() - waited

    def _log(self, done: int, metrics: dict[str, Any]) -> None:
        values = self.meter.values(metrics)
        values["consumed_tokens"] = self.position.at(done).consumed_tokens
        if isinstance(self.parts.batches, Rollouts):
            values.update(self.parts.batches.log_values(done, values))
        if not self.history:
            values["compile_time_s"] = self.compile_s
        if self.parts.writer:
            self.parts.writer.write(done, values)
        self.history.append({"step": done, **values})
        self.meter.reset()

    def _validation(self) -> dict[str, float]:
        """The validation loss of the state now (none without validation batches)."""
        return evaluate(self.cfg, self.eval_fn, self.state.params, self.validation, self.mesh, self.implementation)

    def _save(self, done: int) -> None:
        """Checkpoints the state after ``done`` steps (once: the save hook and a stop may both ask)."""
        if self.saved_at == done:
            return
        self.parts.flags.read(done)  # a state is saved only once its step's flags were read
        self.parts.watchdog.pause()
        save_checkpoint(self.checkpointer, done, self.state, self.cfg, self.position.at(done).to_dict(),
                        self.setup.layer_order)
        self.saved_at = done
        self.parts.watchdog.resume()

    def _stop(self, done: int) -> RunSummary:
        """A preemption signal or another process's stop request: checkpoint this step and leave."""
        self._save(done)
        self.checkpointer.wait()
        why = self.parts.preemption.requested or "a stop request from another process"
        log.warning("checkpointed step %d after %s; exiting with %d", done, why, PREEMPTED_EXIT_CODE)
        return RunSummary(self.state, self.history, preempted=why, stopped_at=done, scores=dict(self.scores))

    def _finish(self) -> RunSummary:
        last, scores = self.history[-1], self.scores
        tasks = {k: v for k, v in scores.items() if k != "eval/loss"}
        summary = RunSummary(self.state, self.history, final_loss=last.get("loss_avg"),
                             validation_loss=scores.get("eval/loss"), compile_time_s=self.compile_s,
                             slow_steps=self.parts.watchdog.slow_steps, tokens_per_sec=last.get("tokens_per_sec"),
                             tflops_per_device=last.get("tflops_per_device"), mfu=last.get("mfu"),
                             data={**self.facts, **tasks}, scores=dict(scores))
        if self.parts.writer:
            self.parts.writer.log(summary_line(summary))
        return summary


def _hlo_text(compiled) -> str | None:
    """The compiled step's HLO text (its collectives and pipeline loops are read from it); None, with a warning,
    where the backend cannot print an executable (the report then says what it lacks)."""
    try:
        return compiled.as_text()
    except Exception as e:  # noqa: BLE001 - backends raise their own types; the run goes on without the text
        log.warning("could not read the compiled step's HLO (%s); no collectives.json and no per-stage idle share",
                    e)
        return None
