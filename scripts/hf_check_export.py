"""Loads a directory written by `jaxtron convert to-hf` with transformers and compares its logits.

    pip install torch transformers
    jaxtron score --checkpoint CKPT --tokens TOKENS.npy --output LOGITS.npy   # in jaxtron's environment
    python scripts/hf_check_export.py HF_DIR TOKENS.npy LOGITS.npy                      # in transformers' one

Prints the model class transformers chose and the largest absolute difference of the float32 logits;
exits 1 when it exceeds --tolerance (default 1e-4).
"""

import argparse
import sys

import numpy as np
import torch
from transformers import AutoModelForCausalLM


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("hf_dir")
    parser.add_argument("tokens")
    parser.add_argument("logits")
    parser.add_argument("--tolerance", type=float, default=1e-4)
    args = parser.parse_args()
    model = AutoModelForCausalLM.from_pretrained(args.hf_dir, attn_implementation="eager", dtype=torch.float32)
    model.eval()
    tokens = torch.from_numpy(np.load(args.tokens, allow_pickle=False)).long()
    with torch.no_grad():
        theirs = model(tokens).logits.float().numpy()
    ours = np.load(args.logits, allow_pickle=False)
    diff = float(np.abs(theirs - ours).max())
    print(f"{type(model).__name__}: max |logits difference| = {diff:.3g} over shape {theirs.shape}")
    return 0 if diff <= args.tolerance else 1


if __name__ == "__main__":
    sys.exit(main())
