"""RL with a verifiable reward (GRPO): a small byte-level model learns to add two numbers.

Two runs. First the base: supervised fine-tuning of a fresh model on the 400 sums of two numbers
below 20, asked as questions (configs/grpo.py:sft, data.prepare='arithmetic-chat'). One answer in four is
the number alone; the others add the terms, "7 (3 + 4)". Then GRPO from it on the same questions
(data.prepare='arithmetic-prompts'): each step samples rl.group_size answers to each prompt, and
jaxtron.data.arithmetic's reward gives 1 to the right sum written alone, 0 otherwise. RL so learns
the form the checker takes, and the sums the base still gets wrong.
    python train.py --config=configs/grpo.py:sft --workdir=runs/arithmetic_sft
    python train.py --config=configs/grpo.py --workdir=runs/grpo
"""

import sys

import ml_collections


def get_config(stage: str = "grpo"):
    if stage not in ("sft", "grpo"):
        raise ValueError(f"configs/grpo.py takes 'sft' or nothing, not {stage!r}")
    c = ml_collections.ConfigDict()
    version = f"{sys.version_info.major}{sys.version_info.minor}"
    c.model = dict(family="llama", name="adder", vocab_size=256, embed_dim=192, num_layers=4, mlp_dim=512,
                   max_seq_len=64, tie_embeddings=True, attention=dict(num_heads=6, num_kv_heads=2),
                   rope=dict(theta=10_000.0))
    c.execution = dict(dtype="float32")
    c.mesh = dict(data=1, fsdp=-1, tensor=1, sequence=1, expert=1)
    if stage == "sft":
        c.train = dict(steps=400, seed=0, global_batch_size=32, log_every=20, eval_every=100, eval_batches=4)
        c.optimizer = dict(learning_rate=3e-3, warmup_steps=30, weight_decay=0.1, min_lr_ratio=0.1)
        c.data = dict(source="store", prepare="arithmetic-chat", path=f"~/.cache/jaxtron/arithmetic-chat-py{version}",
                      seq_len=64, validation_fraction=0.05, packing=False)
        return c
    c.train = dict(steps=100, seed=0, global_batch_size=64, log_every=1, init_from="runs/arithmetic_sft",
                   objective="grpo")
    c.optimizer = dict(learning_rate=5e-5, warmup_steps=5, weight_decay=0.0, min_lr_ratio=0.1)
    c.rl = dict(reward="jaxtron.data.arithmetic:reward", group_size=8, max_new_tokens=12, temperature=1.0,
                updates=1, kl=0.04)
    c.data = dict(source="store", prepare="arithmetic-prompts",
                  path=f"~/.cache/jaxtron/arithmetic-prompts-py{version}", seq_len=64, validation_fraction=0.0)
    return c
