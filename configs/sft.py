"""Supervised fine-tuning of the main job's model on conversations about Python's standard library.

Each conversation asks what a documented standard-library function does; the assistant answers with the
function's signature in backticks and the first sentence of its docstring. The conversations are made from the
library's source and prepared on first use (data.prepare='stdlib-chat'), rendered with a plain byte-level chat
template; only the assistant's tokens carry loss. It starts from the main job's run (train.init_from), so run
that first:
    python train.py --config=configs/default.py --workdir=runs/default
    python train.py --config=configs/sft.py --workdir=runs/sft
    python -m jaxtron.generate --run runs/sft --chat --prompt "What does json.dumps do?"
"""

import sys

import ml_collections


def get_config():
    c = ml_collections.ConfigDict()
    version = f"{sys.version_info.major}{sys.version_info.minor}"
    # the model must be the main job's (configs/default.py), whose parameters it starts from
    c.model = dict(name="tiny", vocab_size=256, embed_dim=192, num_layers=4, mlp_dim=512, max_seq_len=1024,
                   tie_embeddings=True, attention=dict(num_heads=6, num_kv_heads=2), rope=dict(theta=10_000.0))
    c.execution = dict(dtype="float32")
    c.train = dict(steps=300, seed=0, global_batch_size=16, log_every=20, eval_every=100, eval_batches=4,
                   init_from="runs/default")  # or --config.train.init_from=DIR
    c.optimizer = dict(learning_rate=2e-3, warmup_steps=20, weight_decay=0.1, min_lr_ratio=0.1)
    c.data = dict(source="store", prepare="stdlib-chat", path=f"~/.cache/jaxtron/stdlib-chat-py{version}-byte",
                  seq_len=256, validation_fraction=0.05)
    c.mesh = dict(data=1, fsdp=-1, tensor=1, sequence=1, expert=1)
    return c
