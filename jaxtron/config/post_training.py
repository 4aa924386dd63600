"""The sections of training after pretraining: LoRA's adapters and DPO's preference loss, and what each needs of
the rest of a config (``check_post_training``)."""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxtron.config.checks import _check, _non_negative

OBJECTIVES = ("language_model", "dpo")  # train.objective's choices
PREFERENCE = ("dpo",)  # the objectives that read chosen/rejected pairs: two rows a pair
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


def check_post_training(cfg: Any) -> None:
    """What LoRA and the preference objectives need of a whole config; ConfigError otherwise."""
    t, schedule = cfg.train, cfg.pipeline.schedule
    _check(not cfg.lora.rank or schedule not in ONE_F_ONE_B, "lora.rank",
           f"({cfg.lora.rank}) cannot be used with pipeline.schedule={schedule!r}, whose stages "
           "compute every parameter's gradient themselves", "use pipeline.schedule='fill_drain' for LoRA")
    _check(not cfg.lora.rank or bool(t.init_from), "train.init_from",
           f"is empty but lora.rank is {cfg.lora.rank}: adapters train on top of a model",
           "point it at a run or a converted model to adapt")
    if t.objective not in PREFERENCE:
        return
    _check(bool(t.init_from), "train.init_from", f"is empty but train.objective is {t.objective!r}, whose reference "
           "model is the starting one", "point it at a run or a converted model (an SFT run, say)")
    _check(cfg.data.source == "store", "data.source", f"is {cfg.data.source!r} but train.objective={t.objective!r} "
           "reads chosen/rejected pairs", "prepare a pair store (jaxtron prepare --pairs) and set data.source='store'")
    _check(cfg.mesh.pipeline == 1, "mesh.pipeline", f"is {cfg.mesh.pipeline} but train.objective={t.objective!r} "
           "does not run under a pipeline yet", "use the data, fsdp, sequence and tensor axes")
    _check(t.global_batch_size % (2 * t.microbatches) == 0, "train.global_batch_size",
           f"({t.global_batch_size}) counts sequences, two a pair, so it must be an even multiple of "
           f"train.microbatches ({t.microbatches})", "use an even number of rows in each microbatch")
