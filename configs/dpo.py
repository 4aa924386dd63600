"""Preference training (DPO) of the fine-tuned main-job model: prefer grammatical answers.

Each pair asks what a documented standard-library function does; the chosen answer is that function's signature
and first docstring sentence, the rejected one the same with two words of the sentence swapped (data.prepare=
'stdlib-pairs', prepared on first use). The reference model is train.init_from's, frozen. Held-out pairs give
dpo/accuracy at each evaluation. It starts from the SFT run, so run the main job and SFT first:
    python train.py --config=configs/default.py --workdir=runs/default
    python train.py --config=configs/sft.py --workdir=runs/sft
    python train.py --config=configs/dpo.py --workdir=runs/dpo
"""

import importlib.util
import os
import sys


def get_config():
    # the SFT config's model and mesh (configs/sft.py, itself the main job's), whose parameters this run starts from
    spec = importlib.util.spec_from_file_location("sft", os.path.join(os.path.dirname(__file__), "sft.py"))
    sft = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sft)
    c = sft.get_config()
    version = f"{sys.version_info.major}{sys.version_info.minor}"
    # global_batch_size counts sequences: 16 rows are 8 pairs; 12 evaluation batches cover the ~93 held-out pairs
    c.train = dict(steps=150, seed=0, global_batch_size=16, log_every=10, eval_every=10, eval_batches=12,
                   init_from="runs/sft", objective="dpo")  # or --config.train.init_from=DIR
    c.dpo = dict(beta=0.1)
    c.optimizer = dict(learning_rate=1e-4, warmup_steps=10, weight_decay=0.0, min_lr_ratio=0.1)
    c.data = dict(source="store", prepare="stdlib-pairs", path=f"~/.cache/jaxtron/stdlib-pairs-py{version}-byte",
                  seq_len=256, validation_fraction=0.1)
    return c
