"""A Hugging Face checkpoint's tensors against the family's plan of them (``families.tensors``), before an import
writes anything: every planned tensor present with its shape, and no tensor left without a place, but for the
parts the family declares it does not model (``Family.unmodelled``), which are left out and counted in the log."""

from __future__ import annotations

import logging

from jaxtron import families
from jaxtron.config.schema import ModelConfig
from jaxtron.families import Tensor
from jaxtron.interop.hf import safetensors as st

log = logging.getLogger("jaxtron.interop.convert")  # the import's log, where a user reads what was left out

IGNORED = (".rotary_emb.inv_freq",)  # buffers some exports include; recomputed from the config


def check_plan(cfg: ModelConfig, plan: list[Tensor], files: st.ModelFiles, hf_dir: str, model_type: str | None) -> None:
    """FormatError for a planned tensor missing or of another shape, or a tensor with no place in ``cfg``."""
    expected = {name for t in plan for name in (t.hf_name, *t.read_with)}
    for t in plan:
        for name in (t.hf_name, *t.read_with):
            if name not in files:
                raise st.FormatError(f"tensor '{name}' is missing from '{hf_dir}'; the checkpoint is incomplete or "
                                     "not of the architecture its config.json names.")
        if files.shape(t.hf_name) != t.shape:
            raise st.FormatError(f"tensor '{t.hf_name}' has shape {files.shape(t.hf_name)} but config.json implies "
                                 f"{t.shape}; the weights do not belong to this config.")
    unmodelled = families.get(cfg.family).unmodelled
    left_out = {n for n in files.names() if n not in expected and n.startswith(unmodelled)}
    if left_out:
        log.info("left out %d tensors of '%s' that a %s model has no place for (%s)", len(left_out), hf_dir,
                 cfg.family, ", ".join(sorted(p for p in unmodelled if any(n.startswith(p) for n in left_out))))
    extra = [n for n in files.names() if n not in expected and not n.endswith(IGNORED) and n not in left_out
             and not (cfg.tie_embeddings and n == "lm_head.weight")]
    if extra:
        raise st.FormatError(f"tensor '{extra[0]}' in '{hf_dir}' has no place in a {model_type} model "
                             f"({len(extra)} such tensors); the architecture differs from what jaxtron converts.")
