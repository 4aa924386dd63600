"""The training loop: the only place with side effects (data, logging, metrics files)."""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import time
from collections.abc import Callable
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
from jaxtron.metrics.writers import MetricsWriter
from jaxtron.models import lora
from jaxtron.parallel.sharding import batch_sharding
from jaxtron.training import state as state_lib
from jaxtron.training import workdir as workdir_lib
from jaxtron.training.hooks import Hook, RunParts
from jaxtron.training.placement import Placement, place
from jaxtron.training.preemption import PREEMPTED_EXIT_CODE, PreemptionWatcher, StopVotes
from jaxtron.training.profiling import Meter, ProfileWindow
from jaxtron.training.step import compile_train_step, eval_step, state_finite
from jaxtron.training.step_flags import NonFiniteError, NonFiniteStreak, StepFlags
from jaxtron.training.watchdog import Watchdog

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
    checkpointer.save(step, lora.saved_part(state), data_state or {"step": step}, config)


def batch_limits(cfg: Config, implementation: str) -> BatchLimits:
    """What the model accepts of a batch: positions inside its table, and as many documents a row as cuDNN's
    packed attention is built for."""
    return BatchLimits(max_positions=cfg.model.max_seq_len,
                       max_segments=cfg.execution.attention_max_segments if implementation == "cudnn" else None)


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


@dataclasses.dataclass
class RunSummary:
    """What a training run ended with."""

    state: Any  # the final train state
    history: list[dict[str, Any]]  # the lines this process logged in this run, each with its step
    preempted: str | None = None  # why the run stopped before train.steps (a signal, another process's request)
    stopped_at: int | None = None  # the step it checkpointed then
    final_loss: float | None = None  # mean train loss of the last log interval
    validation_loss: float | None = None  # mean cross-entropy over the validation batches at the end
    compile_time_s: float | None = None
    slow_steps: int = 0  # steps the watchdog reported as slow
    tokens_per_sec: float | None = None  # of the last log interval, as the next three
    tflops_per_device: float | None = None
    mfu: float | None = None
    data: dict[str, Any] = dataclasses.field(default_factory=dict)  # facts of the training text (tokens, entropy)


def run(cfg: Config, workdir: str, *, use_tqdm: bool | None = None,
        devices: list[jax.Device] | None = None, evaluator: Callable | None = None,
        resolve_remat: Callable | None = None) -> RunSummary:
    """Trains ``cfg`` on ``devices`` (default: all) and writes metrics and checkpoints into ``workdir``.
    ``evaluator(cfg, graphdef, mesh)`` builds what scores ``train.eval_tasks`` (params -> {metric: value};
    ``jaxtron.inference.downstream.TaskEvaluator``, which ``jaxtron train`` passes); ``resolve_remat``: see
    ``place``."""
    placement = place(cfg, devices, resolve_remat)
    with jax.set_mesh(placement.mesh):
        state_lib.check_fits(placement.setup.abstract_state, placement.shardings, list(placement.mesh.devices.flat))
        before = workdir_lib.listing(workdir)
        workdir_lib.check_writable(workdir)
        trainer = Trainer(placement.cfg, workdir, placement, use_tqdm, evaluator)
        try:
            return trainer.train()
        except ConfigError:
            if not trainer.accepted:  # refused (checkpoint, data or init_from mismatch): leave no trace
                workdir_lib.remove_created(workdir, before)
            raise


class Trainer:
    """One training run, from its components to its summary; ``train`` reads top to bottom, and what runs beside
    the steps is ``hooks``, each with its cadence."""

    def __init__(self, cfg: Config, workdir: str, placement: Placement, use_tqdm: bool | None,
                 evaluator: Callable | None = None):
        self.cfg, self.workdir, self.use_tqdm, self.evaluator = cfg, workdir, use_tqdm, evaluator
        self.mesh, self.setup = placement.mesh, placement.setup
        self.shardings, self.implementation = placement.shardings, placement.implementation
        self.is_main = jax.process_index() == 0
        self.history: list[dict[str, Any]] = []
        self.checkpointer: Checkpointer | None = None
        self.parts: RunParts | None = None  # with steps left
        self.saved_at = -1  # the step of the newest save
        self.accepted = False  # the config, checkpoint, data and init_from checks passed: files may change now

    def hooks(self) -> list[Hook]:
        """What runs after a step, in this order, each at its cadence."""
        t, parts = self.cfg.train, self.parts
        writer = parts.writer
        return [Hook("profile", 1, lambda done, _: parts.profile.after_step(
                    done, lambda: jax.block_until_ready(self.state))),
                Hook("log", t.log_every, self._log, last=True, reads_step=True),
                Hook("progress", 1, lambda done, _: writer.advance(done) if writer is not None else None),
                Hook("evaluate", t.eval_every, lambda done, _: self._evaluate_midway(done), last=False),
                Hook("save", self.cfg.checkpoint.every, lambda done, _: self._save(done), last=True,
                     reads_step=True)]

    def train(self) -> RunSummary:
        t, done = self.cfg.train, 0
        try:
            done = self._build()
            if done >= t.steps:  # a finished run: nothing left to train
                log.info("the run already reached train.steps = %d; raise it to train further", t.steps)
                return RunSummary(self.state, [])
            parts, hooks = self.parts, self.hooks()
            parts.watchdog.start(done)
            for step in range(self.start, t.steps):
                done = step + 1
                metrics = self._step(step, done)
                if done < t.steps:
                    self._next_batch(done)
                # steps whose hooks read the device wait for it anyway, so their own flags are read now
                stop = parts.flags.read(done if any(h.reads_step and h.due(done, t.steps) for h in hooks)
                                        else done - 1)
                # one process alone needs no agreement: it stops at the first step boundary after the signal
                stop |= jax.process_count() == 1 and parts.preemption.requested is not None
                for hook in hooks:
                    if hook.due(done, t.steps):
                        hook.run(done, metrics)
                if stop and done < t.steps:
                    return self._stop(done)
            return self._finish()
        finally:
            self._close(done)

    def _build(self) -> int:
        """The data sources, the checkpointer and the state (restored or fresh), then, when steps are left, the
        parts that run beside it (``_parts``). Returns the step the run starts from."""
        cfg, t = self.cfg, self.cfg.train
        self.train_source, self.validation, self.facts = make_sources(cfg)
        self._log_start()
        c = cfg.checkpoint
        self.checkpointer = Checkpointer(self.workdir, c.keep, c.keep_every, c.async_save)
        self.state, self.position = self._restore_or_init()
        self.start = self.position.step
        self.accepted = True
        if self.is_main:  # only now the run's files change (a damaged metrics.jsonl is refused before any)
            workdir_lib.drop_metrics_after(self.workdir, self.start)
            write_json(os.path.join(self.workdir, "config.json"), cfg.to_dict(), indent=2)
            self.checkpointer.remove_incomplete()
        if self.start < t.steps:
            self.parts = self._parts()
        return self.start

    def _parts(self) -> RunParts:
        """The loader at the resumed position, the compiled step and what runs beside it, in the order each needs
        the others; whatever was opened is closed again if a later part fails."""
        cfg, t, mesh = self.cfg, self.cfg.train, self.mesh
        opened = []
        try:
            batches = BatchIterator(self.train_source, mesh, t.global_batch_size, step=self.start,
                                    workers=cfg.data.workers, limits=batch_limits(cfg, self.implementation),
                                    sample_offset=self.position.offset)
            opened.append(batches)
            self.batch = next(batches)
            votes = StopVotes(mesh)
            compiled, compile_s = compile_train_step(self.setup, self.shardings, batch_sharding(mesh), self.state,
                                                     self.batch, votes(False))
            throughput = Throughput(cfg, mesh.size, mesh.devices.flat[0].device_kind, self.implementation)
            log.info("compiled the train step in %.1f s; %.4g model TFLOP per step; %s", compile_s,
                     throughput.model_flops / 1e12, throughput.peak_note)
            hlo = _hlo_text(compiled)  # printed once: collectives.json and the pipeline layout read it
            if self.is_main and hlo is not None:
                write_json(os.path.join(self.workdir, "collectives.json"), collectives(hlo))  # for jaxtron report
            eval_fn = jax.jit(functools.partial(eval_step, self.setup),
                              in_shardings=(self.shardings.params, batch_sharding(mesh)))
            tasks = self._task_evaluator()
            writer = MetricsWriter(self.workdir, t.steps, use_tqdm=self.use_tqdm) if self.is_main else None
            opened.append(writer)
            schedule = self.setup.stack_runner
            meter = Meter(throughput, {"pipeline_bubble": schedule.bubble} if schedule else None)
            profile = ProfileWindow(cfg.profile, self.workdir, self.start)
            opened.append(profile)
            if schedule and profile.enabled:  # what the report needs to find each stage's idle iterations
                profile.write_pipeline_layout(self.mesh, schedule, hlo)
            preemption = PreemptionWatcher()
            opened.append(preemption)
            watchdog = Watchdog(t.watchdog_factor, jax.process_index())
            opened.append(watchdog)
        except BaseException:
            for part in reversed(opened):
                if part is not None:
                    part.close(self.start) if isinstance(part, ProfileWindow) else part.close()
            raise
        streak = NonFiniteStreak(t.max_nonfinite_in_row, self.start, int(jax.device_get(self.state.nonfinite)[1]))
        return RunParts(batches, votes, compiled, compile_s, eval_fn, tasks, writer, meter, profile, preemption,
                        watchdog, StepFlags(streak, watchdog))

    def _task_evaluator(self) -> Callable | None:
        """What scores ``train.eval_tasks`` (None when it is empty)."""
        if not self.cfg.train.eval_tasks.strip():
            return None
        if self.evaluator is None:
            raise ConfigError("config field 'train.eval_tasks' is set but this run was given no task evaluator; "
                              "train with `jaxtron train` (or pass run(..., evaluator=jaxtron.inference."
                              "downstream.TaskEvaluator)).")
        return self.evaluator(self.cfg, self.setup.graphdef, self.mesh)

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
        restored = self.checkpointer.restore_latest(lora.saved_part(abstract), lora.saved_part(self.shardings,
                                                                                               abstract),
                                                    cfg, check_data, self.setup.layer_order)
        if restored is not None:
            position = resumed["position"]
            log.info("resumed from the checkpoint of step %d in %s", position.step, self.checkpointer.directory)
            state = restored[0]
            if cfg.lora.rank:  # the checkpoint holds the adapters; the frozen base is train.init_from's
                state = state.replace(params=lora.join(state.params, init_from()))
            return state, position
        state = state_lib.init_state(cfg, self.implementation, self.shardings)
        if cfg.train.init_from:  # fine-tuning start: these parameters, a fresh optimizer and step 0
            base = init_from()
            state = state.replace(params=lora.join(lora.own(state.params), base) if cfg.lora.rank else base)
            log.info("parameters from %s; %s", cfg.train.init_from,
                     f"LoRA adapters of rank {cfg.lora.rank} fresh, the base frozen" if cfg.lora.rank
                     else "optimizer state fresh")
        return state, data_position.DataPosition.start(cfg, data_setup)

    def _step(self, step: int, done: int) -> dict[str, Any]:
        parts = self.parts
        parts.profile.before_step(step, lambda: jax.block_until_ready(self.state))
        with parts.profile.annotate(done):
            self.state, metrics = parts.compiled(self.state, self.batch,
                                                 parts.votes(parts.preemption.requested is not None))
        parts.flags.push(done, metrics)
        parts.meter.losses.append(metrics["loss"])  # stays on the device until the log step
        return metrics

    def _next_batch(self, done: int) -> None:
        """The next batch, loaded ahead by the iterator while the device works on this step."""
        waited = time.perf_counter()
        with self.parts.watchdog.input(done + 1):
            self.batch = next(self.parts.batches)
        self.parts.meter.data_wait += time.perf_counter() - waited

    def _log(self, done: int, metrics: dict[str, Any]) -> None:
        parts = self.parts
        values = parts.meter.values(metrics)
        values["consumed_tokens"] = self.position.at(done).consumed_tokens
        if not self.history:
            values["compile_time_s"] = parts.compile_s
        if parts.writer:
            parts.writer.write(done, values)
        self.history.append({"step": done, **values})
        parts.meter.reset()

    def _scores(self, done: int) -> dict[str, float]:
        """The validation loss and train.eval_tasks' scores of the state now, written to the metrics at ``done``."""
        parts = self.parts
        loss = evaluate(self.cfg, parts.eval_fn, self.state.params, self.validation, self.mesh, self.implementation)
        scores = {"eval/loss": loss} if loss is not None else {}
        scores.update(parts.tasks(self.state.params) if parts.tasks else {})
        if parts.writer and scores:
            parts.writer.write(done, scores)
        return scores

    def _evaluate_midway(self, done: int) -> None:
        self.parts.watchdog.pause()
        self._scores(done)
        self.parts.meter.restart_clock()
        self.parts.watchdog.resume()

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
        return RunSummary(self.state, self.history, preempted=why, stopped_at=done)

    def _finish(self) -> RunSummary:
        last, scores = self.history[-1], self._scores(self.cfg.train.steps)
        tasks = {k: v for k, v in scores.items() if k != "eval/loss"}
        summary = RunSummary(self.state, self.history, final_loss=last.get("loss_avg"),
                             validation_loss=scores.get("eval/loss"), compile_time_s=self.parts.compile_s,
                             slow_steps=self.parts.watchdog.slow_steps, tokens_per_sec=last.get("tokens_per_sec"),
                             tflops_per_device=last.get("tflops_per_device"), mfu=last.get("mfu"),
                             data={**self.facts, **tasks})
        if self.parts.writer:
            self.parts.writer.log(_summary_line(summary))
        return summary

    def _close(self, done: int) -> None:
        """Stops and closes what was built (the checkpointer last but the loader: it waits for a save in flight)."""
        parts = self.parts
        if parts is not None:
            parts.profile.close(done)
        for part in ((parts.watchdog, parts.preemption) if parts else ()) + (self.checkpointer,) + \
                ((parts.batches, parts.writer) if parts else ()):
            if part is not None:
                part.close()


def _hlo_text(compiled) -> str | None:
    """The compiled step's HLO text (its collectives and pipeline loops are read from it); None, with a warning,
    where the backend cannot print an executable (the report then says what it lacks)."""
    try:
        return compiled.as_text()
    except Exception as e:  # noqa: BLE001 - backends raise their own types; the run goes on without the text
        log.warning("could not read the compiled step's HLO (%s); no collectives.json and no per-stage idle share",
                    e)
        return None


def _summary_line(summary: RunSummary) -> str:
    parts = [f"train loss {summary.final_loss:.4f} nats/token (mean of the last log interval)"]
    if summary.validation_loss is not None:
        parts.append(f"validation loss {summary.validation_loss:.4f}")
    if summary.data.get("unigram_entropy") is not None:
        parts.append(f"unigram entropy of the text {summary.data['unigram_entropy']:.4f}")
    return "done: " + "; ".join(parts)
