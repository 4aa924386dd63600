"""DeepSeek-V3 (671B parameters, 37B active per token): published dimensions.

Multi-head latent attention (query rank 1536, key-value rank 512, heads of 128 + 64 rotated dimensions, values
of 128) with YaRN stretching the 4k pre-training context 40 times; the first 3 of 61 blocks dense (width 18432),
then 256 routed experts of width 2048 in 8 groups (a token's top-8 come from its best 4 groups) plus one shared
expert, a sigmoid router whose balancing bias moves 0.001 per step (auxiliary-loss-free balancing) with the
sequence-wise balance loss at 0.0001, as the technical report trains it.

Experts are split over an expert axis of 64 and everything else over fsdp; data comes from the synthetic source
until a tokenized store is given (data.source/data.path).
"""

import ml_collections


def get_config():
    c = ml_collections.ConfigDict()
    c.model = dict(family="deepseek_v3", name="deepseek_v3",
                   vocab_size=129280, embed_dim=7168, num_layers=61, mlp_dim=18432, norm_eps=1e-6,
                   max_seq_len=163840, tie_embeddings=False, init_std=0.006,
                   attention=dict(num_heads=128, num_kv_heads=128, head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                                  q_lora_rank=1536, kv_lora_rank=512),
                   rope=dict(theta=10000.0, scaling="yarn", factor=40.0, original_max_len=4096, beta_fast=32.0,
                             beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0),
                   moe=dict(num_experts=256, experts_per_token=8, expert_dim=2048, shared_experts=1,
                            first_dense_layers=3, every=1, router="sigmoid", router_groups=8, router_top_groups=4,
                            router_scale=2.5, router_renormalize=True))
    # expert=64: a device's receive buffer holds twice its own routed rows, not the worst case of all 64 peers'
    # (287 GiB a device at 4 layers on 64 H100s, against 64 GiB at 1.25x: benchmarks/moe_target.md); a device
    # that gets more drops the rest, and moe_dropped_fraction says so. Two token chunks: with the budget's costs the
    # H100 program of 4 layers on expert=16 over 2 nodes hides 72% of its exchanges' network time, one chunk 39%
    # (benchmarks/moe_overlap_budget.md)
    c.execution = dict(dtype="bfloat16", remat="auto", moe_mode="dropless", moe_receive_factor=2.0, moe_chunks=2)
    c.train = dict(steps=1000, global_batch_size=1024, log_every=10, eval_batches=0, router_aux_loss=0.0001,
                   router_z_loss=0.0, router_bias_rate=0.001)
    c.optimizer = dict(learning_rate=2.2e-4, warmup_steps=100, weight_decay=0.1)
    c.data = dict(source="synthetic", seq_len=4096)
    c.mesh = dict(data=1, fsdp=-1, tensor=1, sequence=1, expert=64)
    return c
