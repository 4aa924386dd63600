"""Typed, validated configuration.

Config files are ml_collections ConfigDicts (``get_config()``); at entry (``jaxtron.config.loader``) they
become the frozen dataclasses below (the model's two sections live in ``jaxtron.config.model``), which are the
single source of field names, types and defaults. A config file only sets what differs from these defaults. Every
problem is a ``ConfigError`` (``jaxtron.config.checks``) with one sentence that names the field and the fix.
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any

from jaxtron.config.checks import ConfigError, _check, _choice, _non_negative, _positive
from jaxtron.config.model import ExecutionConfig, ModelConfig, replace  # noqa: F401 (re-exported)
from jaxtron.config.post_training import OBJECTIVES, DpoConfig, LoraConfig, RlConfig, check_post_training
from jaxtron.config.recipes import check_block_recipe

# the corpora data.prepare builds (data/corpus.py)
BUILTIN_CORPORA = ("stdlib", "stdlib-chat", "stdlib-pairs", "arithmetic-chat", "arithmetic-prompts")
# outermost to innermost device order: pipeline stages span nodes, tensor groups stay inside one
MESH_AXES = ("pipeline", "data", "fsdp", "sequence", "expert", "tensor")


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """Degrees of parallelism; -1 on one axis means 'all remaining devices'."""

    pipeline: int = 1  # pipeline stages: the layer stack is cut into this many parts (see PipelineConfig)
    data: int = 1
    fsdp: int = -1
    sequence: int = 1
    expert: int = 1
    tensor: int = 1

    def __post_init__(self):
        for name in MESH_AXES:
            value = getattr(self, name)
            _check(value == -1 or value >= 1, f"mesh.{name}", f"is {value}",
                   "use a positive size or -1 for 'the rest of the devices'")
        rest = [n for n in MESH_AXES if getattr(self, n) == -1]
        _check(len(rest) <= 1, f"mesh.{rest[-1] if rest else ''}",
               f"is -1 but so is mesh.{rest[0] if rest else ''}",
               "give a positive size to all but one of them, since only one axis can take 'the rest'")

    def resolve(self, num_devices: int) -> dict[str, int]:
        """Axis sizes (outermost first) whose product equals ``num_devices``."""
        sizes = {n: getattr(self, n) for n in MESH_AXES}
        fixed = math.prod(v for v in sizes.values() if v != -1)
        rest = [n for n, v in sizes.items() if v == -1]
        if rest:
            _check(num_devices % fixed == 0, f"mesh.{rest[0]}",
                   f"is -1 but the other axes multiply to {fixed}, which does not divide the {num_devices} devices",
                   "choose axis sizes whose product divides the device count")
            sizes[rest[0]] = num_devices // fixed
        elif fixed != num_devices:
            raise ConfigError(f"config fields 'mesh.*' ({', '.join(f'{n}={v}' for n, v in sizes.items())}) multiply "
                              f"to {fixed} but there are {num_devices} devices; make pipeline*data*fsdp*sequence*"
                              "expert*tensor equal the device count or set one axis to -1.")
        return sizes


SCHEDULES = ("fill_drain", "1f1b", "interleaved")  # pipeline.schedule
ONE_F_ONE_B = ("1f1b", "interleaved")  # the schedules that run each stage's backward themselves
FSDP_GATHERS = ("iteration", "step")  # pipeline.fsdp_gather


@dataclasses.dataclass(frozen=True)
class PipelineConfig:
    """The pipeline schedule over the ``mesh.pipeline`` stages (``jaxtron/training/pipeline/fill_drain.py``,
    ``jaxtron/training/pipeline/one_f_one_b.py``)."""

    # 'fill_drain': every microbatch's forward, then the backward by differentiation (the activations of every
    # microbatch in flight); '1f1b': each stage runs one forward and one backward an iteration, the loss inside the
    # schedule, so a stage holds at most 2 x stages - 1 microbatches' inputs whatever the microbatch count;
    # 'interleaved': 1F1B over virtual_stages chunks of layers on each stage (the bubble shrinks by that factor,
    # for as many more transfers between stages), the microbatches in waves of one per stage
    schedule: str = "fill_drain"
    microbatches: int = 0  # microbatches in flight in one forward and backward pass (0: one per stage)
    # each stage's layers split into this many circular repeats (shrinks the bubble): fill-drain and interleaved
    virtual_stages: int = 1
    # layers (MoE: periods) that stages x virtual stages do not divide are filled up with identity layers at the
    # end of the last stage (each costs a layer's memory and compute, changes nothing the model computes)
    uneven_stages: bool = False
    # where a stage's weights split over fsdp are gathered: 'iteration', in every iteration of the schedule (each
    # period's as it runs; their gradients reduce-scattered as they are made), or 'step' (1F1B), once before the
    # schedule and held whole through it (float32, with a whole gradient accumulator: one gather and one
    # reduce-scatter a step, for 8 bytes per weight of a stage more on each device)
    fsdp_gather: str = "iteration"

    def __post_init__(self):
        _choice(self.schedule, "pipeline.schedule", SCHEDULES)
        _choice(self.fsdp_gather, "pipeline.fsdp_gather", FSDP_GATHERS)
        _check(self.fsdp_gather == "iteration" or self.schedule in ONE_F_ONE_B, "pipeline.fsdp_gather",
               f"'{self.fsdp_gather}' holds a stage's weights whole through the '1f1b' and 'interleaved' schedules; "
               "fill-drain's backward would sum their whole gradients over fsdp in every iteration",
               "use pipeline.schedule='1f1b' with it")
        _non_negative(self.microbatches, "pipeline.microbatches")
        _positive(self.virtual_stages, "pipeline.virtual_stages")
        _check(self.virtual_stages == 1 or self.schedule != "1f1b", "pipeline.virtual_stages",
               f"({self.virtual_stages}) splits each stage into rounds, which the '1f1b' schedule does not run",
               "set it to 1, or use pipeline.schedule='interleaved' (1F1B over virtual stages)")
        _check(self.virtual_stages > 1 or self.schedule != "interleaved", "pipeline.virtual_stages",
               "(1) leaves the 'interleaved' schedule one chunk of layers a stage, which is plain 1F1B",
               "set it to 2 or more, or use pipeline.schedule='1f1b'")

    def sizes(self, stages: int) -> tuple[int, int]:
        """(microbatches, virtual stages) for this many stages (one stage has no virtual stages: its rounds
        would run the same stack in the same order)."""
        return self.microbatches or stages, self.virtual_stages if stages > 1 else 1


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    steps: int = 1000
    seed: int = 0
    global_batch_size: int = 32
    microbatches: int = 1  # gradient accumulation: the global batch is split into this many parts
    log_every: int = 10
    z_loss: float = 0.0  # coefficient of the logsumexp^2 auxiliary loss
    router_aux_loss: float = 0.01  # MoE: coefficient of the load-balancing loss (mean over MoE blocks)
    router_z_loss: float = 0.001  # MoE: coefficient of the router's squared log-partition (mean over MoE blocks)
    # sigmoid router: after every step each block's balancing bias moves this much toward balance, up for experts
    # below the mean load and down for those above (auxiliary-loss-free balancing; no gradient involved)
    router_bias_rate: float = 0.0
    mtp_loss: float = 0.3  # multi-token prediction (model.mtp.depth): weight of the modules' mean cross-entropy
    logit_chunks: int = 1  # logits and loss in this many slices of the sequence: never all float32 logits at once
    max_nonfinite_in_row: int = 5  # stop (exit 3) after this many skipped (non-finite) updates in a row (0: never)
    eval_every: int = 0  # steps between validation losses (0: only at the end)
    eval_batches: int = 4  # validation batches per evaluation (0: no validation)
    watchdog_factor: float = 5.0  # warn when a step takes this many times the recent median (0: off)
    init_from: str = ""  # start from these parameters (a converted model or a run's workdir), optimizer fresh
    # lm-evaluation-harness tasks (comma-separated names) scored with the validation loss, from the task YAMLs in
    # eval_tasks_path (local data only); eval_tasks_limit: documents per task (0: all)
    eval_tasks: str = ""
    eval_tasks_path: str = ""
    eval_tasks_limit: int = 0
    wandb_project: str = ""  # Weights & Biases project of the run's metrics ("": off; jaxtron.metrics.wandb_sink)
    wandb_name: str = ""  # the W&B run's name ("": the workdir's name)
    # what the step minimizes: the next token's cross-entropy, DPO's loss on chosen/rejected pairs (dpo section), or
    # GRPO's on sampled completions (rl section)
    objective: str = "language_model"

    def __post_init__(self):
        for name in ("steps", "global_batch_size", "microbatches", "log_every", "logit_chunks"):
            _positive(getattr(self, name), f"train.{name}")
        for name in ("seed", "z_loss", "router_aux_loss", "router_z_loss", "router_bias_rate", "mtp_loss"):
            _non_negative(getattr(self, name), f"train.{name}")
        for name in ("eval_batches", "eval_every", "eval_tasks_limit"):
            _non_negative(getattr(self, name), f"train.{name}")
        _check(not self.eval_tasks.strip() or os.path.isdir(os.path.expanduser(self.eval_tasks_path)),
               "train.eval_tasks_path", f"('{self.eval_tasks_path}') is not a directory",
               "point it at a directory of lm-eval task YAMLs whose data are local files")
        _non_negative(self.max_nonfinite_in_row, "train.max_nonfinite_in_row")
        _choice(self.objective, "train.objective", OBJECTIVES)
        _check(self.watchdog_factor == 0 or self.watchdog_factor > 1, "train.watchdog_factor",
               f"is {self.watchdog_factor}", "use 0 to turn the watchdog off or a factor above 1, e.g. 5")
        _check(self.global_batch_size % self.microbatches == 0, "train.microbatches",
               f"({self.microbatches}) must divide train.global_batch_size ({self.global_batch_size})",
               "choose a divisor of the global batch size")


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    """AdamW, or Muon for the blocks' matrices, with linear warmup then cosine decay to ``min_lr_ratio *
    learning_rate``."""

    # adamw | muon: Newton-Schulz orthogonalized momentum for the blocks' matrices (each whole, per layer and
    # expert), AdamW (b1, b2, eps) for the embedding, head, norms, biases and routers (jaxtron/training/optimizer.py)
    name: str = "adamw"
    learning_rate: float = 3e-4
    warmup_steps: int = 100
    decay_steps: int = 0  # 0 means train.steps
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    clip_norm: float = 1.0  # global gradient norm clipping; 0 disables it
    # the distributed optimizer: the moments split over the axes that split the batch's tokens (data, sequence, and
    # fsdp and expert where the weight is not cut over them: the rules' ``optimizer_state``), the float32 weights as
    # their rule places them; gradients reduce-scattered onto the moments' shards, the updated weights gathered once
    # per step. Checkpoints restore across it
    distributed: bool = False
    # muon: Nesterov momentum's decay; Newton-Schulz iterations and their precision (float32 | bfloat16); each update
    # scaled to muon_rms x sqrt(max(fan in, fan out)), AdamW's RMS, so AdamW's rate and decay carry over (Moonlight)
    muon_momentum: float = 0.95
    muon_steps: int = 5
    muon_dtype: str = "float32"
    muon_rms: float = 0.2

    def __post_init__(self):
        _choice(self.name, "optimizer.name", ("adamw", "muon"))
        _choice(self.muon_dtype, "optimizer.muon_dtype", ("float32", "bfloat16"))
        _check(0 <= self.muon_momentum < 1, "optimizer.muon_momentum", f"must lie in [0, 1) (got {self.muon_momentum})",
               "set --config.optimizer.muon_momentum inside that range")
        for name in ("muon_steps", "muon_rms", "learning_rate", "eps"):
            _positive(getattr(self, name), f"optimizer.{name}")
        for name in ("warmup_steps", "decay_steps", "weight_decay", "clip_norm"):
            _non_negative(getattr(self, name), f"optimizer.{name}")
        _check(self.decay_steps == 0 or self.decay_steps > self.warmup_steps, "optimizer.decay_steps",
               f"({self.decay_steps}) must exceed optimizer.warmup_steps ({self.warmup_steps}) or be 0 for train.steps",
               "raise it or set it to 0")
        for name in ("b1", "b2", "min_lr_ratio"):
            value = getattr(self, name)
            top = "]" if name == "min_lr_ratio" else ")"  # a ratio of 1 (constant rate) is allowed
            _check(0 <= value < 1 or (name == "min_lr_ratio" and value == 1), f"optimizer.{name}",
                   f"must lie in [0, 1{top} (got {value})", f"set --config.optimizer.{name} inside that range")


@dataclasses.dataclass(frozen=True)
class DataConfig:
    source: str = "synthetic"  # store (prepared token stores) | synthetic (random tokens, no I/O)
    path: str = ""  # store directory; several comma-separated directories make a mixture
    weights: str = ""  # comma-separated mixture weights, one per path ('' = equal)
    # a built-in corpus prepared into data.path once (data/corpus.py): stdlib (source), stdlib-chat (conversations),
    # stdlib-pairs (DPO), arithmetic-chat and arithmetic-prompts (SFT, then GRPO)
    prepare: str = ""
    seq_len: int = 256
    validation_fraction: float = 0.05  # documents held out: the last ones of each of 100 stripes of a store
    # False: one document a row, padded (short conversations then keep their question with their answer)
    packing: bool = True
    verify: bool = False  # hash every shard before training (processes split them); sizes are always checked
    workers: int = 0  # loader processes; 0 loads in a background thread of the training process
    resume_from_tokens: bool = False  # accept a data setup changed since the checkpoint: go on from its token count

    def __post_init__(self):
        _choice(self.source, "data.source", ("store", "synthetic"))
        _positive(self.seq_len, "data.seq_len")
        _check(self.source != "store" or bool(self.path.strip()), "data.path",
               "is empty but data.source is 'store'", "set it to a prepared store's directory")
        _choice(self.prepare, "data.prepare", ("", *BUILTIN_CORPORA))
        _check(0 <= self.validation_fraction < 1, "data.validation_fraction",
               f"must lie in [0, 1) (got {self.validation_fraction})", "set it inside that range")
        _non_negative(self.workers, "data.workers")
        paths = [p for p in self.path.split(",") if p.strip()]
        if self.weights.strip():
            try:
                weights = [float(w) for w in self.weights.split(",")]
            except ValueError:
                weights = []
            _check(len(weights) == len(paths) and all(w > 0 for w in weights), "data.weights",
                   f"({self.weights!r}) must be {len(paths)} positive comma-separated numbers, one per data.path entry",
                   "fix the list or leave it empty for equal weights")


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    every: int = 1000  # steps between saves (0: only at the end and on preemption)
    keep: int = 3  # most recent checkpoints kept
    keep_every: int = 0  # also keep every checkpoint whose step is a multiple of this, forever (0: none)
    async_save: bool = True  # write in the background while training goes on

    def __post_init__(self):
        _non_negative(self.every, "checkpoint.every")
        _positive(self.keep, "checkpoint.keep")
        _non_negative(self.keep_every, "checkpoint.keep_every")


@dataclasses.dataclass(frozen=True)
class DistributedConfig:
    """How processes find each other. Empty fields are taken from the environment (JAX_COORDINATOR_ADDRESS,
    JAX_NUM_PROCESSES, JAX_PROCESS_ID), else from an srun step or Open MPI, else the run is one process."""

    coordinator_address: str = ""  # host:port of process 0
    num_processes: int = 0  # 0: from the environment
    process_id: int = -1  # -1: from the environment
    port: int = 0  # coordinator port when the address comes from Slurm (0: derived from the job and step ids)
    initialization_timeout_s: int = 300  # how long processes wait for each other at start
    heartbeat_timeout_s: int = 60  # a process silent this long is declared dead and the others stop
    peer_check_s: float = 5.0  # how often each process asks which peers are alive (0: leave it to jax, see below)

    def __post_init__(self):
        _non_negative(self.num_processes, "distributed.num_processes")
        _check(self.process_id >= -1, "distributed.process_id", f"is {self.process_id}",
               "use -1 (from the environment) or the index of this process")
        _check(0 <= self.port < 65536, "distributed.port", f"is {self.port}", "use 0 (derived) or a TCP port")
        _positive(self.initialization_timeout_s, "distributed.initialization_timeout_s")
        _positive(self.heartbeat_timeout_s, "distributed.heartbeat_timeout_s")
        _non_negative(self.peer_check_s, "distributed.peer_check_s")
        given = [bool(self.coordinator_address), self.num_processes > 0, self.process_id >= 0]
        _check(all(given) or not any(given), "distributed.coordinator_address",
               "is set with only some of distributed.num_processes and distributed.process_id",
               "set all three or none")
        _check(not all(given) or self.process_id < self.num_processes, "distributed.process_id",
               f"({self.process_id}) is not below distributed.num_processes ({self.num_processes})",
               "number processes from 0")


@dataclasses.dataclass(frozen=True)
class ProfileConfig:
    """A jax.profiler trace of a window of steps: it starts once step ``start_step`` has finished and stops once
    step ``end_step`` has, so it holds steps start_step+1 .. end_step as numbered in metrics.jsonl."""

    start_step: int = 0
    end_step: int = 0  # 0: no trace
    processes: str = "0"  # which processes write a trace: comma-separated indices, or 'all'
    dir: str = ""  # where the trace goes ('': WORKDIR/profile)

    def __post_init__(self):
        _non_negative(self.start_step, "profile.start_step")
        _non_negative(self.end_step, "profile.end_step")
        _check(self.end_step == 0 or self.end_step > self.start_step, "profile.end_step",
               f"({self.end_step}) must exceed profile.start_step ({self.start_step})",
               "set the end of the window after its start, or 0 for no trace")
        text = self.processes.strip()
        _check(text == "all" or (bool(text) and all(p.strip().isdigit() for p in text.split(","))),
               "profile.processes", f"is {self.processes!r}", "use 'all' or comma-separated process indices like '0,8'")

    @property
    def enabled(self) -> bool:
        return self.end_step > 0

    def traces(self, process_index: int) -> bool:
        """Whether process ``process_index`` writes a trace."""
        if not self.enabled:
            return False
        text = self.processes.strip()
        return text == "all" or process_index in {int(p) for p in text.split(",")}


SECTIONS = {"model": ModelConfig, "execution": ExecutionConfig, "mesh": MeshConfig, "pipeline": PipelineConfig,
            "train": TrainConfig,
            "optimizer": OptimizerConfig, "data": DataConfig, "checkpoint": CheckpointConfig,
            "distributed": DistributedConfig, "profile": ProfileConfig, "lora": LoraConfig, "dpo": DpoConfig,
            "rl": RlConfig}


@dataclasses.dataclass(frozen=True)
class Config:
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    execution: ExecutionConfig = dataclasses.field(default_factory=ExecutionConfig)
    mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)
    pipeline: PipelineConfig = dataclasses.field(default_factory=PipelineConfig)
    train: TrainConfig = dataclasses.field(default_factory=TrainConfig)
    optimizer: OptimizerConfig = dataclasses.field(default_factory=OptimizerConfig)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)
    distributed: DistributedConfig = dataclasses.field(default_factory=DistributedConfig)
    profile: ProfileConfig = dataclasses.field(default_factory=ProfileConfig)
    lora: LoraConfig = dataclasses.field(default_factory=LoraConfig)
    dpo: DpoConfig = dataclasses.field(default_factory=DpoConfig)
    rl: RlConfig = dataclasses.field(default_factory=RlConfig)

    def __post_init__(self):
        m, d, x = self.model, self.data, self.execution
        _check(not x.fp8 or 2 * x.fp8_skip_layers < m.num_layers, "execution.fp8_skip_layers",
               f"({x.fp8_skip_layers}) leaves no FP8 block among model.num_layers ({m.num_layers})",
               "lower it, or set execution.fp8=False")
        _check(not (x.fp8 and m.moe.num_experts) or x.fp8_skip_layers % m.moe.every == 0, "execution.fp8_skip_layers",
               f"({x.fp8_skip_layers}) must be a multiple of model.moe.every ({m.moe.every})",
               "round it to a multiple")
        check_block_recipe(m, x, d.seq_len)
        _check(d.seq_len <= m.max_seq_len, "data.seq_len",
               f"({d.seq_len}) exceeds model.max_seq_len ({m.max_seq_len})",
               "shorten the sequence or raise model.max_seq_len")
        _check(d.source != "store" or not d.prepare or m.vocab_size >= 256, "model.vocab_size",
               f"({m.vocab_size}) is too small for the byte tokens of data.prepare={d.prepare!r}", "use at least 256")
        _check(self.profile.end_step <= self.train.steps, "profile.end_step",
               f"({self.profile.end_step}) is beyond train.steps ({self.train.steps})",
               "end the window at or before the last step")
        _check(not self.train.router_bias_rate or (m.moe.router == "sigmoid" and m.moe.balance_bias),
               "train.router_bias_rate", f"({self.train.router_bias_rate}) moves the sigmoid router's balancing bias, "
               f"but model.moe.router is {m.moe.router!r} (balance_bias={m.moe.balance_bias})",
               "set it to 0 or use model.moe.router='sigmoid' with its balance_bias")
        _check(not self.train.router_bias_rate or m.num_moe_layers, "train.router_bias_rate",
               f"({self.train.router_bias_rate}) moves the routed experts' balancing bias, but the model has no MoE "
               f"blocks (model.moe.num_experts is {m.moe.num_experts})", "set it to 0")
        _check(not self.train.eval_tasks.strip() or d.source == "store", "train.eval_tasks",
               "needs a tokenizer, but data.source is not 'store'", "train on a token store or leave it empty")
        _check(not self.train.eval_tasks.strip() or self.mesh.pipeline == 1, "train.eval_tasks",
               f"cannot run on a pipeline of {self.mesh.pipeline} stages yet", "leave it empty under mesh.pipeline")
        check_post_training(self)
        _check(d.seq_len % self.train.logit_chunks == 0, "train.logit_chunks",
               f"({self.train.logit_chunks}) must divide data.seq_len ({d.seq_len})", "choose a divisor of it")

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return {name: dataclasses.asdict(getattr(self, name)) for name in SECTIONS}

