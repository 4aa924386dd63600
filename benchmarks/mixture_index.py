"""Cost per sample index of a two-store mixture: grain's MapDataset.mix (one index at a time, as a grain map
dataset is read) against jaxtron's Mixture (a batch of indices at once). Only the index arithmetic is timed;
the parts return their indices.

    python benchmarks/mixture_index.py [--samples 200000] [--batch 64]
"""

import argparse
import os
import sys
import time

import grain
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from jaxtron.data.packing import Mixture


class _Indices:
    def rows(self, index: np.ndarray) -> dict[str, np.ndarray]:
        return {"index": index[:, None]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--samples", type=int, default=200_000)
    parser.add_argument("--batch", type=int, default=64)
    args = parser.parse_args()
    weights = [0.7, 0.3]
    mixed = grain.MapDataset.mix([grain.MapDataset.range(1 << 40) for _ in weights], weights)
    start = time.perf_counter()
    for i in range(args.samples):
        mixed[i]
    grain_us = (time.perf_counter() - start) / args.samples * 1e6
    mixture, samples = Mixture([_Indices() for _ in weights], weights), np.arange(args.samples)
    start = time.perf_counter()
    for i in range(0, args.samples, args.batch):
        mixture.rows(samples[i:i + args.batch])
    ours_us = (time.perf_counter() - start) / args.samples * 1e6
    print(f"grain MapDataset.mix: {grain_us:.2f} us per index; jaxtron Mixture in batches of {args.batch}: "
          f"{ours_us:.2f} us per index")


if __name__ == "__main__":
    main()
