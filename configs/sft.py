"""Supervised fine-tuning of the main job's model on conversations about Python's standard library.

Each conversation asks what a documented standard-library function does; the assistant answers with the
function's signature in backticks and the first sentence of its docstring. The conversations are made from the
library's source and prepared on first use (data.prepare='stdlib-chat'), rendered with a plain byte-level chat
template; only the assistant's tokens carry loss. It starts from the main job's run (train.init_from), so run
that first:
    python train.py --config=configs/default.py --workdir=runs/default
    python train.py --config=configs/sft.py --workdir=runs/sft
    jaxtron generate --run runs/sft --chat --prompt "What does json.dumps do?"
"""

import importlib.util
import os
import sys


def get_config():
    # the main job's config (configs/default.py): its model, whose parameters this run starts from, and its mesh
    spec = importlib.util.spec_from_file_location("default", os.path.join(os.path.dirname(__file__), "default.py"))
    default = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(default)
    c = default.get_config()
    version = f"{sys.version_info.major}{sys.version_info.minor}"
    c.train = dict(steps=300, seed=0, global_batch_size=16, log_every=20, eval_every=100, eval_batches=4,
                   init_from="runs/default")  # or --config.train.init_from=DIR
    c.optimizer = dict(learning_rate=2e-3, warmup_steps=20, weight_decay=0.1, min_lr_ratio=0.1)
    c.data = dict(source="store", prepare="stdlib-chat", path=f"~/.cache/jaxtron/stdlib-chat-py{version}-byte",
                  seq_len=256, validation_fraction=0.05)
    return c
