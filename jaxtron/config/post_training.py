"""The sections of training after pretraining: LoRA's adapters, DPO's preference loss and GRPO's rollouts and
update, and what each needs of the rest of a config (``check_post_training``)."""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxtron.config.checks import _check, _non_negative

OBJECTIVES = ("language_model", "dpo", "grpo")  # train.objective's choices
PREFERENCE = ("dpo",)  # the objectives that read chosen/rejected pairs: two rows a pair
REFERENCED = ("dpo", "grpo")  # the objectives that start from train.init_from and may compare with it
ONE_F_ONE_B = ("1f1b", "interleaved")  # the schedules that run each stage's backward themselves


@dataclasses.dataclass(frozen=True)
class LoraConfig:
    """Low-rank adapters (LoRA): each target projection W computes x W + (alpha / rank) (drop(x) A) B, with A
    [inputs, rank] and B [rank, outputs] (B starts at zero) the only trained parameters; the base model, loaded
    from ``train.init_from``, stays frozen and holds no optimizer state, and checkpoints hold the adapters alone
    (``jaxtron.models.lora``)."""

    rank: int = 0  # 0: no adapters (full fine-tuning or pretraining)
    alpha: float = 16.0
    # projections by name: q, k, v, o (attention), gate, up, down (the MLP), q_a, q_b, kv_a, kv_b (latent
    # attention); Hugging Face's q_proj, ..., down_proj name the same ones
    targets: str = "q,k,v,o"
    dropout: float = 0.0  # dropout on each adapter's input (training steps only)

    def __post_init__(self):
        _non_negative(self.rank, "lora.rank")
        _check(0 <= self.dropout < 1, "lora.dropout", f"must lie in [0, 1) (got {self.dropout})",
               "use e.g. 0.05, or 0 for none")
        _check(self.alpha > 0, "lora.alpha", f"must be positive (got {self.alpha})", "use e.g. 16 or 2 * lora.rank")
        _check(not self.rank or bool(self.targets.strip()), "lora.targets", "is empty",
               "name projections, e.g. 'q,k,v,o'")
        defaults = LoraConfig.__dataclass_fields__
        changed = [name for name in ("targets", "alpha", "dropout") if getattr(self, name) != defaults[name].default]
        _check(self.rank or not changed, f"lora.{changed[0] if changed else ''}",
               "is set while lora.rank is 0, which trains no adapters (a full fine-tune)",
               "set --config.lora.rank (e.g. 8) for LoRA, or leave the lora section out")


@dataclasses.dataclass(frozen=True)
class DpoConfig:
    """Direct preference optimization (``train.objective='dpo'``): the loss of a pair is
    -log sigmoid(beta * margin), margin = (log pi(chosen) - log ref(chosen)) - (log pi(rejected) - log ref(rejected)),
    each a response's summed log-probability. The reference is ``train.init_from``'s model, frozen (under LoRA:
    the base without its adapters). ``label_smoothing`` e mixes in the flipped pair's loss with weight e (cDPO)."""

    beta: float = 0.1
    label_smoothing: float = 0.0

    def __post_init__(self):
        _check(self.beta > 0, "dpo.beta", f"must be positive (got {self.beta})", "use e.g. 0.1")
        _check(0 <= self.label_smoothing < 0.5, "dpo.label_smoothing",
               f"must lie in [0, 0.5) (got {self.label_smoothing})", "use 0, or e.g. 0.1 for noisy labels")


@dataclasses.dataclass(frozen=True)
class RlConfig:
    """GRPO (``train.objective='grpo'``): each step samples ``group_size`` completions of each prompt from the
    parameters being trained, scores them with ``reward``, normalizes the rewards within each group into
    advantages, and makes ``updates`` optimizer updates on those samples with the clipped importance ratio and
    a KL penalty to the reference (the k3 estimator), as ``jaxtron.training.rollouts`` describes."""

    reward: str = ""  # "module:function" or "path/to/file.py:function": f(prompt, completion, record) -> float
    group_size: int = 8  # completions of each prompt; train.global_batch_size counts them all
    max_new_tokens: int = 64  # a completion's length at most; data.seq_len holds the prompt and it
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    updates: int = 1  # optimizer updates on each batch of samples (the importance ratio is 1 in the first)
    clip: float = 0.2  # the ratio is clipped to [1 - clip, 1 + clip]
    kl: float = 0.04  # the KL penalty's weight (0: none, and no reference is kept)
    length_normalization: bool = True  # a completion's loss is its tokens' mean, else their sum / max_new_tokens
    scale_rewards: bool = True  # advantages divided by the group's standard deviation, else centred only

    def __post_init__(self):
        for name in ("max_new_tokens", "updates"):
            _check(getattr(self, name) >= 1, f"rl.{name}", f"must be at least 1 (got {getattr(self, name)})",
                   "use a positive count")
        for name in ("temperature", "top_k", "clip", "kl"):
            _non_negative(getattr(self, name), f"rl.{name}")
        _check(0 < self.top_p <= 1, "rl.top_p", f"must lie in (0, 1] (got {self.top_p})", "use 1 to keep all tokens")
        _check(not self.reward or (":" in self.reward and all(self.reward.rpartition(":")[::2])), "rl.reward",
               f"('{self.reward}') is not 'module:function'", "name it as my_rewards:score or rewards.py:score")


def keeps_reference(cfg: Any) -> bool:
    """Whether the train state holds a copy of the reference model: DPO, or GRPO with a KL penalty, when the whole
    model trains (under LoRA the reference is the base with its adapters off)."""
    uses = cfg.train.objective == "dpo" or (cfg.train.objective == "grpo" and cfg.rl.kl > 0)
    return uses and not cfg.lora.rank


def check_post_training(cfg: Any) -> None:
    """What LoRA and the preference objectives need of a whole config; ConfigError otherwise."""
    t, schedule = cfg.train, cfg.pipeline.schedule
    _check(not cfg.lora.rank or schedule not in ONE_F_ONE_B, "lora.rank",
           f"({cfg.lora.rank}) cannot be used with pipeline.schedule={schedule!r}, whose stages "
           "compute every parameter's gradient themselves", "use pipeline.schedule='fill_drain' for LoRA")
    _check(not cfg.lora.rank or bool(t.init_from), "train.init_from",
           f"is empty but lora.rank is {cfg.lora.rank}: adapters train on top of a model",
           "point it at a run or a converted model to adapt")
    if t.objective == "grpo":
        _check_rl(cfg)
    if t.objective not in REFERENCED:
        return
    _check(bool(t.init_from), "train.init_from", f"is empty but train.objective is {t.objective!r}, whose reference "
           "model is the starting one", "point it at a run or a converted model (an SFT run, say)")
    kind = "pairs" if t.objective == "dpo" else "prompts"
    _check(cfg.data.source == "store", "data.source", f"is {cfg.data.source!r} but train.objective={t.objective!r} "
           f"reads {'chosen/rejected pairs' if kind == 'pairs' else 'prompts'} from a store",
           f"prepare one (jaxtron prepare --{kind}) and set data.source='store'")
    _check(cfg.mesh.pipeline == 1, "mesh.pipeline", f"is {cfg.mesh.pipeline} but train.objective={t.objective!r} "
           "does not run under a pipeline yet", "use the data, fsdp, sequence and tensor axes")
    _check(t.objective != "dpo" or t.global_batch_size % (2 * t.microbatches) == 0, "train.global_batch_size",
           f"({t.global_batch_size}) counts sequences, two a pair, so it must be an even multiple of "
           f"train.microbatches ({t.microbatches})", "use an even number of rows in each microbatch")


def _check_rl(cfg: Any) -> None:
    rl, t = cfg.rl, cfg.train
    _check(bool(rl.reward), "rl.reward", "is empty but train.objective is 'grpo'",
           "name the reward function as module:function (it gets the prompt, the completion and the record)")
    _check(rl.group_size >= 2, "rl.group_size", f"is {rl.group_size}, but advantages compare the completions of "
           "one prompt, so a group needs at least 2", "use e.g. 8")
    # the advantages are made before the rows split into microbatches: a row's loss needs no other row
    _check(t.global_batch_size % rl.group_size == 0, "train.global_batch_size",
           f"({t.global_batch_size}) counts completions, rl.group_size ({rl.group_size}) a prompt, so it must be a "
           "multiple of rl.group_size", "use whole groups")
    _check(rl.max_new_tokens < cfg.data.seq_len, "rl.max_new_tokens", f"({rl.max_new_tokens}) leaves no room for "
           f"a prompt in data.seq_len ({cfg.data.seq_len})", "lower it or raise data.seq_len")
