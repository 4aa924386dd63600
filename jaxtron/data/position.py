"""Where a run stands in its data stream, as a checkpoint records it, and the check made when a run resumes.

Row ``r`` of step ``s`` is global sample ``offset + s * global_batch_size + r`` of the train source; a run that
never changed its data setup has offset 0. A checkpoint saves, beside the step, the tokens trained on so far,
the offset, and a fingerprint of everything that decides which tokens a sample holds: batch size, sequence
length, seed, the stores (path, tokenizer and their tokens' checksums) and their mixture weights. A resumed run whose
fingerprint differs would silently skip or repeat data, so it is refused, naming the changed fields, unless
``data.resume_from_tokens`` accepts the change: the run then goes on from the token the old setup had reached
in its stream (the sample that holds it under the new setup), which is what changing the batch size mid-run
needs.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
from typing import Any

from jaxtron.config.schema import Config
from jaxtron.data.errors import DataError

log = logging.getLogger(__name__)

ACCEPT_FLAG = "--config.data.resume_from_tokens=true"
# Version of the way samples are cut from stores (packing, shuffle, validation hold-out); raised whenever that
# code changes which tokens a sample holds, so that a run resumed across such a change is told.
SAMPLING_VERSION = 2


def _store_facts(path: str) -> dict[str, Any]:
    """A store's tokenizer, a digest of what its tokens are (each shard's token, document and loss-mask checksums:
    a store prepared again from the same text by a version whose manifest has more fields keeps it), and the
    digests its manifest had as each older version wrote it (``_manifest_digests``), one of which checkpoints of
    those versions recorded instead."""
    import json

    from jaxtron.data.store import MANIFEST
    try:
        with open(os.path.join(path, MANIFEST), "rb") as f:
            raw = f.read()
        manifest = json.loads(raw)
        shards = [[s.get("tokens_sha256"), s.get("docs_sha256"), s.get("mask_sha256")] for s in manifest["shards"]]
        tokenizer = manifest.get("tokenizer")
        digests = _manifest_digests(raw, manifest)
    except (OSError, ValueError, AttributeError, KeyError, TypeError):
        return {"tokenizer": None, "tokens": None, "manifests": ()}  # opening the store names the problem
    return {"tokenizer": tokenizer, "tokens": hashlib.sha256(json.dumps(shards).encode()).hexdigest(),
            "manifests": digests}


def _manifest_digests(raw: bytes, manifest: dict[str, Any]) -> tuple[str, ...]:
    """The SHA-256 of a store's manifest file as written, and as the versions before 3e08f3c wrote the same store:
    without its ``loss_mask`` key, which they did not have (a store without loss masks only; they wrote
    ``json.dump(manifest, f, indent=2, sort_keys=True)`` as today). A checkpoint of those versions recorded one
    of these ("content of"), so a store that today's prepare writes again from the same text still matches it."""
    import json

    digests = [hashlib.sha256(raw).hexdigest()]
    if manifest.get("loss_mask") is False:
        before = {k: v for k, v in manifest.items() if k != "loss_mask"}
        digests.append(hashlib.sha256(json.dumps(before, indent=2, sort_keys=True).encode()).hexdigest())
    return tuple(digests)


def fingerprint(cfg: Config, legacy: bool = False) -> dict[str, Any]:
    """The fields of the data setup that decide which tokens each training sample holds; ``legacy``: each store's
    content as checkpoints of older versions recorded it ("content of": its manifest's digest, here the tuple of
    the digests it has under each version's manifest format)."""
    d, t = cfg.data, cfg.train
    out: dict[str, Any] = {"train.global_batch_size": t.global_batch_size, "data.seq_len": d.seq_len,
                           "train.seed": t.seed, "data.source": d.source, "sampling version": SAMPLING_VERSION}
    if d.source == "synthetic":
        out["model.vocab_size"] = cfg.model.vocab_size  # synthetic tokens are drawn from the model vocabulary
        return out
    paths = [os.path.expanduser(p.strip()) for p in d.path.split(",") if p.strip()]
    out.update({"data.path": ",".join(paths), "data.weights": d.weights.replace(" ", ""),
                "data.validation_fraction": d.validation_fraction})  # the hold-out decides the train windows
    for i, path in enumerate(paths):
        facts = _store_facts(path)
        name = f"data.path[{i}]" if len(paths) > 1 else "data.path"
        out[f"tokenizer of {name}"] = facts["tokenizer"]
        if legacy:
            out[f"content of {name}"] = facts["manifests"]
        else:
            out[f"tokens of {name}"] = facts["tokens"]
    return out


@dataclasses.dataclass(frozen=True)
class DataPosition:
    """The data stream's position after ``step`` steps; its ``to_dict`` is what a checkpoint saves."""

    step: int
    consumed_tokens: int  # trained on so far, over every data setup this run had
    offset: int  # sample index of row 0 of step s: offset + s * global_batch_size
    fingerprint: dict[str, Any]
    tokens_per_step: int

    @classmethod
    def start(cls, cfg: Config, fingerprint_now: dict[str, Any]) -> DataPosition:
        return cls(0, 0, 0, fingerprint_now, cfg.train.global_batch_size * cfg.data.seq_len)

    def at(self, step: int) -> DataPosition:
        """The position after ``step`` steps of this setup (step >= self.step)."""
        return dataclasses.replace(self, step=step,
                                   consumed_tokens=self.consumed_tokens + (step - self.step) * self.tokens_per_step)

    def to_dict(self) -> dict[str, Any]:
        return {"step": self.step, "consumed_tokens": self.consumed_tokens, "sample_offset": self.offset,
                "fingerprint": self.fingerprint}


def resume(cfg: Config, fingerprint_now: dict[str, Any], saved: dict[str, Any]) -> DataPosition:
    """The position to go on from, given the data state a checkpoint saved; refuses a changed data setup
    (a DataError naming the changed fields) unless ``data.resume_from_tokens`` accepts it."""
    step = int(saved["step"])
    batch, seq_len = cfg.train.global_batch_size, cfg.data.seq_len
    if "fingerprint" not in saved:  # written before data setups were recorded: nothing to compare
        log.warning("the checkpoint of step %d has no record of its data setup; assuming it is unchanged", step)
        return DataPosition(step, step * batch * seq_len, 0, fingerprint_now, batch * seq_len)
    before = saved["fingerprint"]
    compared = fingerprint_now
    if any(k.startswith("content of") for k in before):  # an older version's checkpoint: its stores' manifests
        compared = fingerprint(cfg, legacy=True)
    changed = [k for k in sorted(set(before) | set(compared)) if not _same(k, before.get(k), compared.get(k))]
    here = DataPosition(step, int(saved["consumed_tokens"]), int(saved["sample_offset"]), fingerprint_now,
                        batch * seq_len)
    if not changed:
        return here
    # how far the old setup had read into its stream, in tokens
    old_batch, old_len = int(before["train.global_batch_size"]), int(before["data.seq_len"])
    stream_tokens = (here.offset + step * old_batch) * old_len
    if not cfg.data.resume_from_tokens:
        raise DataError(f"the checkpoint of step {step} was written with another data setup "
                        f"({'; '.join(_describe(k, before.get(k), fingerprint_now.get(k)) for k in changed)}), so "
                        f"resuming would skip or repeat data; restore those settings, or pass {ACCEPT_FLAG} to go "
                        f"on from token {stream_tokens:,} of the data stream ({here.consumed_tokens:,} tokens "
                        "trained so far).")
    offset = stream_tokens // seq_len - step * batch
    log.warning("data setup changed since the checkpoint of step %d (%s); going on from token %d of the stream "
                "(sample %d of the new setup)", step, ", ".join(changed), stream_tokens, stream_tokens // seq_len)
    return dataclasses.replace(here, offset=offset)


def _same(key: str, saved: Any, now: Any) -> bool:
    """Whether a fingerprint field is unchanged: a store's manifest digest matches any of its versions' forms."""
    if key.startswith("content of"):
        return saved in (now or ())
    return saved == now


def _describe(key: str, old: Any, new: Any) -> str:
    if key.startswith(("content of", "tokens of", "tokenizer of")):
        return f"{key} differs"  # digests and tokenizer records say nothing readable
    return f"{key} {old!r} -> {new!r}"
