"""Writes the Hugging Face parity fixtures under tests/fixtures/hf/ with transformers and torch.

    pip install torch transformers && python scripts/hf_fixtures.py [NAME ...]   # all, or only those models
    python scripts/hf_fixtures.py --greedy [NAME ...]   # only greedy.npy, from the models already saved

Tests only read the files this writes (CI needs neither torch nor transformers). Each model is tiny and
random (fixed seed), saved by transformers itself, with the float32 logits its own forward pass gives on
tokens.npy:
  llama/        Llama 3.1-style: GQA, llama3 RoPE scaling, untied head; config.json as transformers 5 writes it
  llama_tied/   Llama 3.2-style tied embeddings, sharded safetensors with an index, config.json rewritten in the
                transformers 4.x form (rope_theta + rope_scaling)
  mixtral/      Mixtral: 4 experts, top-2
  qwen3/        Qwen3 dense: per-head query and key RMSNorm, head size (16) not hidden / heads, tied embeddings
  qwen3_moe/    Qwen3-MoE: a dense block of width 64, then an MoE block of 4 experts of width 24, top-2
                renormalised (decoder_sparse_step 2)
  deepseek_v3/  DeepSeek-V3: latent attention with a low-rank query, YaRN, one dense block then MoE blocks of 8
                experts in 4 groups (top-2 groups, top-2 experts) plus a shared expert, a non-zero balancing bias
  deepseek_v3_q/  the same with a full-rank query projection and DeepSeek's (non-yarn) default RoPE, config.json
                in the transformers 4.x form
Each model gets its own seed, so writing some leaves the others as they are. Beside each model, greedy.npy holds the
8 tokens transformers' ``generate`` continues the first 8 tokens of each row of tokens.npy with, greedily (no
end-of-document stop), read from the saved model (``--greedy`` writes only these).
"""

import json
import os
import shutil
import sys

import numpy as np
import torch
import transformers
from transformers import (
    DeepseekV3Config,
    DeepseekV3ForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

OUT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests", "fixtures", "hf")
VOCAB = 96
ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 32}


def llama(tied: bool) -> LlamaForCausalLM:
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=48, intermediate_size=80, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         rms_norm_eps=1e-5, tie_word_embeddings=tied, rope_parameters=dict(ROPE),
                         attn_implementation="eager")
    return LlamaForCausalLM(config)


def mixtral() -> MixtralForCausalLM:
    config = MixtralConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                           max_position_embeddings=128, rms_norm_eps=1e-5, attn_implementation="eager",
                           rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    return MixtralForCausalLM(config)


def qwen3() -> Qwen3ForCausalLM:
    config = Qwen3Config(vocab_size=VOCAB, hidden_size=48, intermediate_size=80, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=128,
                         rms_norm_eps=1e-6, tie_word_embeddings=True, attn_implementation="eager",
                         rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    return Qwen3ForCausalLM(config)


def qwen3_moe() -> Qwen3MoeForCausalLM:
    config = Qwen3MoeConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, moe_intermediate_size=24,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                            num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=2,
                            mlp_only_layers=[], max_position_embeddings=128, rms_norm_eps=1e-6,
                            attn_implementation="eager", rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    return Qwen3MoeForCausalLM(config)


def deepseek_v3(low_rank_query: bool) -> DeepseekV3ForCausalLM:
    rope = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 32,
            "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0} if low_rank_query else \
        {"rope_type": "default", "rope_theta": 10000.0}
    config = DeepseekV3Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                              num_hidden_layers=3, first_k_dense_replace=1, num_attention_heads=4,
                              num_key_value_heads=4, q_lora_rank=24 if low_rank_query else None, kv_lora_rank=16,
                              qk_rope_head_dim=8, qk_nope_head_dim=12, v_head_dim=10, n_routed_experts=8,
                              n_shared_experts=1, num_experts_per_tok=2, n_group=4, topk_group=2,
                              norm_topk_prob=True, routed_scaling_factor=2.5, max_position_embeddings=128,
                              rms_norm_eps=1e-6, rope_interleave=True, tie_word_embeddings=False,
                              attn_implementation="eager", rope_parameters=rope)
    return DeepseekV3ForCausalLM(config)


def to_v4(path: str) -> None:
    """Rewrites config.json with transformers 4.x RoPE fields (what older Hub checkpoints carry)."""
    with open(path) as f:
        config = json.load(f)
    rope = config.pop("rope_parameters")
    config["rope_theta"] = rope.pop("rope_theta")
    config["rope_scaling"] = rope if rope.get("rope_type", "default") != "default" else None
    config["transformers_version"] = "4.46.0"
    with open(path, "w") as f:
        json.dump(config, f, indent=2)


MODELS = {"llama": (lambda: llama(False), None), "llama_tied": (lambda: llama(True), "60KB"),
          "mixtral": (mixtral, None), "qwen3": (qwen3, None), "qwen3_moe": (qwen3_moe, None),
          "deepseek_v3": (lambda: deepseek_v3(True), None), "deepseek_v3_q": (lambda: deepseek_v3(False), None)}


def greedy(name: str) -> None:
    """greedy.npy of a saved fixture: transformers' greedy continuation of tokens.npy[:, :8] by 8 tokens."""
    directory = os.path.join(OUT, name)
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    prompt = torch.from_numpy(np.load(os.path.join(OUT, "tokens.npy"))[:, :8]).long()
    with torch.no_grad():
        out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=8, min_new_tokens=8,
                             do_sample=False, eos_token_id=None, pad_token_id=0)
    continuation = out[:, prompt.shape[1]:].numpy().astype(np.int32)
    np.save(os.path.join(directory, "greedy.npy"), continuation)
    print(name, "greedy", continuation.tolist())


def main(names: list[str]) -> None:
    if names[:1] == ["--greedy"]:
        for name in names[1:] or MODELS:
            greedy(name)
        return
    unknown = sorted(set(names) - set(MODELS))
    if unknown:
        sys.exit(f"unknown fixture(s) {unknown}; the fixtures are {sorted(MODELS)}")
    if not names:
        shutil.rmtree(OUT, ignore_errors=True)
    os.makedirs(OUT, exist_ok=True)
    tokens = np.random.default_rng(0).integers(0, VOCAB, size=(2, 24)).astype(np.int32)
    np.save(os.path.join(OUT, "tokens.npy"), tokens)
    for seed, (name, (build, shard)) in enumerate(MODELS.items()):
        if names and name not in names:
            continue
        torch.manual_seed(seed)
        model = build()
        for p in model.parameters():  # larger than the default 0.02 so that logits differ visibly
            torch.nn.init.normal_(p, std=0.2)
        for buffer_name, b in model.named_buffers():  # DeepSeek's balancing bias: large enough to change choices
            if buffer_name.endswith("e_score_correction_bias"):
                b.copy_(0.3 * torch.randn(b.shape))
        model.eval()
        directory = os.path.join(OUT, name)
        shutil.rmtree(directory, ignore_errors=True)
        kwargs = {"max_shard_size": shard} if shard else {}
        model.save_pretrained(directory, safe_serialization=True, **kwargs)
        if name in ("llama_tied", "deepseek_v3_q"):
            to_v4(os.path.join(directory, "config.json"))
        with torch.no_grad():
            logits = model(torch.from_numpy(tokens).long()).logits.float().numpy()
        np.save(os.path.join(directory, "logits.npy"), logits)
        print(name, "logits", logits.shape, "files", sorted(os.listdir(directory)))
        with open(os.path.join(OUT, "VERSIONS"), "a" if names else "w") as f:
            f.write(f"{name}/: torch {torch.__version__}, transformers {transformers.__version__}\n")
        greedy(name)


if __name__ == "__main__":
    main(sys.argv[1:])
