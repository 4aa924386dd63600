"""PNG plots of a run's metrics.jsonl: loss (and validation loss) over steps, throughput and MFU over steps."""

from __future__ import annotations

import os
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only: no display on clusters
import matplotlib.pyplot as plt

from jaxtron.common.files import atomic_path


def _series(records: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    points = [(r["step"], r[key]) for r in records if isinstance(r.get(key), (int, float))]
    return [p[0] for p in points], [p[1] for p in points]


def write_plots(records: list[dict[str, Any]], out_dir: str, title: str) -> list[str]:
    """Writes loss.png and throughput.png into ``out_dir``; returns their paths."""
    paths = []
    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    steps, loss = _series(records, "loss_avg")
    if not steps:
        steps, loss = _series(records, "loss")
    ax.plot(steps, loss, label="train loss (mean of each log interval)")
    eval_steps, eval_loss = _series(records, "eval/loss")
    if eval_steps:
        ax.plot(eval_steps, eval_loss, "o-", label="validation loss")
    ax.set(xlabel="step", ylabel="nats / token", title=f"{title}: loss")
    ax.grid(alpha=0.3)
    ax.legend()
    paths.append(_save(fig, os.path.join(out_dir, "loss.png")))

    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    steps, tokens = _series(records, "tokens_per_sec")
    ax.plot(steps, tokens, color="tab:blue")
    ax.set(xlabel="step", ylabel="tokens / s", title=f"{title}: throughput and MFU")
    ax.grid(alpha=0.3)
    mfu_steps, mfu = _series(records, "mfu")
    other = ax.twinx()
    if mfu_steps:
        other.plot(mfu_steps, [100 * v for v in mfu], color="tab:orange")
        other.set_ylabel("MFU (%)", color="tab:orange")
    else:
        other.set_yticks([])
        other.text(0.5, 0.5, "MFU n/a: no dense peak known for this device", transform=ax.transAxes,
                   ha="center", color="tab:orange")
    paths.append(_save(fig, os.path.join(out_dir, "throughput.png")))
    return paths


def _save(fig, path: str) -> str:
    fig.tight_layout()
    with atomic_path(path) as aside:
        fig.savefig(aside, format="png")
    plt.close(fig)
    return path
