"""Token stores: end-of-document tokens, the spread validation split, row-local positions, checksums on
demand, old formats, and prepare's refusal to replace an existing output."""

import itertools
import json
import logging
import os
from pathlib import Path

import jax
import numpy as np
import pytest
from helpers import tiny_config

from jaxtron import cli
from jaxtron.data.corpus import ensure_builtin
from jaxtron.data.errors import DataError
from jaxtron.data.loader import BatchLimits, LocalBatch, global_batch, make_sources
from jaxtron.data.packing import STRIPES, PackedSplit, split_ranges
from jaxtron.data.prepare import prepare
from jaxtron.data.store import MANIFEST, StoreWriter, TokenStore
from jaxtron.data.tokenizers import load_tokenizer
from jaxtron.parallel.mesh import make_mesh
from jaxtron.training.loop import batch_limits


def _write(path, text):
    with open(path, "w") as f:
        f.write(text)
    return str(path)


def _error_line(capsys) -> str:
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line]
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err, err
    return lines[0][len("error: "):]


def _word_tokenizer(path, extra: list[str], template: str | None = None) -> str:
    """A word-level tokenizer.json: '<unk>' 0, 'a' 1, 'b' 2, then ``extra`` tokens; optional post-processor."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    vocab = {w: i for i, w in enumerate(["<unk>", "a", "b", *extra])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    if template:
        names = [w for w in template.split() if w != "$A"]
        tok.post_processor = processors.TemplateProcessing(single=template,
                                                           special_tokens=[(n, vocab[n]) for n in names])
    tok.save(str(path))
    return str(path)


# ---------------------------------------------------------------------------------------------- end of document


def test_the_end_of_document_token_is_found_named_or_refused(tmp_path, capsys):
    names = _word_tokenizer(tmp_path / "names.json", ["<eos>", "<|endoftext|>"])
    assert load_tokenizer(names).eos_id == 4  # <|endoftext|> comes before <eos> in the list of common names
    processor = _word_tokenizer(tmp_path / "processor.json", ["<eos>", "<|endoftext|>", "<s>"], "<s> $A <eos>")
    assert load_tokenizer(processor).eos_id == 3  # what the post-processor appends wins over the names
    assert load_tokenizer(processor, eos="b").eos_id == 2 and load_tokenizer(processor, eos=None).eos_id is None
    assert load_tokenizer(processor).describe()["eos"] == "<eos>"

    bos_only = _word_tokenizer(tmp_path / "bos.json", ["<s>"], "<s> $A")
    text = _write(tmp_path / "t.txt", "a b")
    out = str(tmp_path / "out")
    assert cli.run("prepare", ["--input", text, "--tokenizer", bos_only, "--output", out]) == 2
    assert _error_line(capsys) == (f"tokenizer file '{bos_only}' has no end-of-document token that jaxtron "
                                   "recognises (none of </s>, <|end_of_text|>, <|endoftext|>, <eos>); name it with "
                                   "--eos TOKEN or pass --no-eos.")
    assert cli.run("prepare", ["--input", text, "--tokenizer", bos_only, "--output", out, "--eos", "zz"]) == 2
    assert _error_line(capsys) == f"--eos 'zz' is not a token of '{bos_only}'; name one of its tokens or pass --no-eos."
    assert cli.run("prepare", ["--input", text, "--tokenizer", "byte", "--output", out, "--eos", "a"]) == 2
    assert _error_line(capsys) == ("--eos 'a' cannot be used with the byte tokenizer, which has no end-of-document "
                                   "token; leave --eos out.")
    assert not os.path.exists(out)
    assert cli.run("prepare", ["--input", text, "--tokenizer", bos_only, "--output", out, "--no-eos"]) == 0
    store = TokenStore(out)
    assert store.eos_id is None and store.read(0, store.num_tokens).tolist() == [1, 2]
    assert cli.run("prepare", ["--input", text, "--tokenizer", bos_only, "--output", out, "--eos", "<s>",
                               "--overwrite"]) == 0
    assert TokenStore(out).read(0, 3).tolist() == [1, 2, 3] and TokenStore(out).eos_id == 3

    import sentencepiece
    corpus = _write(tmp_path / "sp.txt", "\n".join(f"alpha beta {i} gamma delta" for i in range(200)))
    sentencepiece.SentencePieceTrainer.train(input=corpus, model_prefix=str(tmp_path / "noeos"), vocab_size=40,
                                             eos_id=-1, hard_vocab_limit=False, minloglevel=2)
    model = str(tmp_path / "noeos.model")
    assert cli.run("prepare", ["--input", text, "--tokenizer", model, "--output", str(tmp_path / "sp")]) == 2
    assert _error_line(capsys) == (f"tokenizer file '{model}' was trained without an end-of-document piece; name one "
                                   "with --eos PIECE or pass --no-eos.")
    assert load_tokenizer(model, eos="<unk>").eos_id == 0
    with pytest.raises(DataError, match="^--eos 'zz' is not a piece of"):
        load_tokenizer(model, eos="zz")


def test_the_end_of_document_target_is_trained_and_the_next_document_is_not(tmp_path):
    tok = _word_tokenizer(tmp_path / "tok.json", ["<|endoftext|>"])
    files = [_write(tmp_path / "0.txt", "a b"), _write(tmp_path / "1.txt", "b a b"), _write(tmp_path / "2.txt", "")]
    manifest = prepare(files, tok, str(tmp_path / "s"), workers=1)
    assert manifest["eos_id"] == 3 and manifest["format"] == 2 and manifest["num_documents"] == 2  # no lone EOS
    row = PackedSplit(TokenStore(str(tmp_path / "s")), 6, "train", 0.0, seed=0).rows(np.array([0]))
    assert {k: v[0].tolist() for k, v in row.items()} == {
        "inputs": [1, 2, 3, 2, 1, 2], "targets": [2, 3, 2, 1, 2, 3],
        "loss_mask": [1, 1, 0, 1, 1, 1],  # EOS targets count; the first token of the next document does not
        "segment_ids": [1, 1, 1, 2, 2, 2], "positions": [0, 1, 2, 0, 1, 2]}


def test_stores_of_format_1_still_load_and_newer_formats_are_refused(tmp_path, caplog):
    prepare([_write(tmp_path / "a.txt", "a b a")], _word_tokenizer(tmp_path / "t.json", ["</s>"]),
            str(tmp_path / "s"), workers=1)
    path = os.path.join(str(tmp_path / "s"), MANIFEST)
    manifest = json.loads(Path(path).read_text())
    old = {k: v for k, v in manifest.items() if k != "eos_id"}
    Path(path).write_text(json.dumps({**old, "format": 1}))
    with caplog.at_level(logging.WARNING):
        store = TokenStore(str(tmp_path / "s"))
    assert store.format == 1 and store.eos_id is None and store.num_tokens == 4
    assert "has no end-of-document tokens" in caplog.text
    Path(path).write_text(json.dumps({**manifest, "format": 4}))
    with pytest.raises(DataError) as e:
        TokenStore(str(tmp_path / "s"))
    assert str(e.value) == (f"store '{tmp_path / 's'}' has format 4, newer than the format 3 this jaxtron reads; "
                            "update jaxtron or prepare the store with this version.")


# ---------------------------------------------------------------------------------------------- validation split


def _doc_store(path: str, lengths: list[int], shard_tokens: int = 1 << 28) -> TokenStore:
    """Document d is ``lengths[d]`` copies of token d: every token names its document."""
    writer = StoreWriter(path, vocab_size=20000, dtype="uint16", shard_tokens=shard_tokens)
    for d, n in enumerate(lengths):
        writer.add(np.full(n, d, np.uint32))
    writer.finish({"kind": "test"}, [])
    return TokenStore(path)


def test_validation_documents_come_from_the_whole_corpus(tmp_path):
    lengths = np.random.default_rng(0).integers(5, 40, 400).tolist()
    store = _doc_store(str(tmp_path / "s"), lengths, shard_tokens=3000)
    assert len(store.shards) > 2
    train, validation = (split_ranges(store, s, 0.05) for s in ("train", "validation"))
    # 20 held-out documents: the last of each of 20 stripes of 20
    held = sorted({int(d) for b, e in validation for d in store.doc_index(np.arange(b, e))})
    assert held == list(range(19, 400, 20))
    assert held[0] < 40 and held[-1] >= 360  # from the first and the last tenth of the corpus
    # train and validation tile the store exactly
    edges = sorted(map(tuple, np.concatenate([train, validation]).tolist()))
    assert edges[0][0] == 0 and edges[-1][1] == store.num_tokens
    assert all(a[1] == b[0] for a, b in itertools.pairwise(edges))

    split = PackedSplit(store, 16, "train", 0.05, seed=0)
    rows = split.rows(np.arange(split.num_windows))
    seen = set(np.unique(np.r_[rows["inputs"].ravel(), rows["targets"].ravel()]).tolist())
    assert seen.isdisjoint(held) and len(seen) > 370  # train windows never touch a validation document
    val = PackedSplit(store, 16, "validation", 0.05, seed=0)
    val_rows = val.rows(np.arange(val.num_windows))
    assert set(np.unique(val_rows["inputs"]).tolist()) <= set(held)
    again = PackedSplit(store, 16, "validation", 0.05, seed=0).rows(np.arange(val.num_windows))
    np.testing.assert_array_equal(again["inputs"], val_rows["inputs"])  # deterministic

    many = _doc_store(str(tmp_path / "m"), [3] * 3000)
    validation = split_ranges(many, "validation", 0.05)
    per_range = np.diff(validation, axis=1).ravel() // 3  # documents per held-out run
    assert len(validation) == STRIPES == 100 and per_range.sum() == 150 and set(per_range.tolist()) == {1, 2}


# ---------------------------------------------------------------------------------------------- positions


class OldPositions:
    """Rows with positions counted from each document's start, as before they restarted at the row start."""

    seq_len = 8

    def __init__(self, split: PackedSplit):
        self.split = split

    def rows(self, samples):
        rows = self.split.rows(samples)
        starts = self.split.windows(samples)[:, None] * self.seq_len + np.arange(self.seq_len)
        docs = self.split.store.doc_index(starts)
        rows["positions"] = (starts - self.split.store.doc_start(docs)).astype(np.int32)
        return rows


def test_positions_restart_at_the_row_start_and_the_loader_refuses_larger_ones(tmp_path):
    store = _doc_store(str(tmp_path / "s"), [100, 3, 61])
    split = PackedSplit(store, 8, "train", 0.0, seed=0)
    rows = split.rows(np.arange(split.num_windows))
    assert int(rows["positions"].max()) == 7
    inside = np.all(rows["segment_ids"] == 1, axis=1)  # rows in the middle of a long document
    assert inside.sum() > 10 and (rows["positions"][inside] == np.arange(8)).all()
    window = int(np.nonzero(split.windows(np.arange(split.num_windows)) == 12)[0][0])  # tokens 96..104
    assert rows["positions"][window].tolist() == [0, 1, 2, 3, 0, 1, 2, 0]
    assert rows["segment_ids"][window].tolist() == [1, 1, 1, 1, 2, 2, 2, 3]

    old = OldPositions(split)
    local = LocalBatch(old, np.arange(4), np.arange(8), 4, BatchLimits(max_positions=16))
    with pytest.raises(DataError) as e:
        for step in range(split.num_windows // 4):
            local(step)
    assert str(e.value).startswith("batch ") and str(e.value).endswith(
        ", outside the range [0, 16) of model.max_seq_len; positions must restart inside every row.")
    mesh = make_mesh(dict(data=1, fsdp=1, sequence=1, expert=1, tensor=1), jax.devices()[:1])
    global_batch(split, 0, mesh, 4, BatchLimits(max_positions=8))  # in range
    with pytest.raises(DataError, match=r"^batch 2 holds position 7, outside the range \[0, 7\)"):
        global_batch(split, 2, mesh, 4, BatchLimits(max_positions=7))
    cfg = tiny_config(model=dict(max_seq_len=8), data=dict(seq_len=8))  # the loop checks batches against it
    assert batch_limits(cfg, "xla") == BatchLimits(max_positions=8)
    assert batch_limits(cfg, "cudnn").max_segments == cfg.execution.attention_max_segments


# ---------------------------------------------------------------------------------------------- checksums


def test_checksums_are_checked_on_demand_and_once_per_run(tmp_path, monkeypatch, capsys):
    path = str(tmp_path / "s")
    store = _doc_store(path, [40] * 10, shard_tokens=100)
    assert len(store.shards) == 5
    assert cli.run("verify-data", [path]) == 0
    tokens = os.path.join(path, store.shards[0]["tokens"])
    data = bytearray(Path(tokens).read_bytes())
    data[0] ^= 1
    Path(tokens).write_bytes(bytes(data))
    message = (f"shard file '{tokens}' does not match its checksum in the manifest; the store is corrupted, "
               "prepare it again.")
    assert cli.run("verify-data", [path]) == 2 and _error_line(capsys) == message

    cfg = tiny_config(model=dict(vocab_size=20000), data=dict(source="store", path=path, seq_len=8, verify=True))
    assert make_sources(tiny_config(model=dict(vocab_size=20000), data=dict(source="store", path=path, seq_len=8)))
    with pytest.raises(DataError) as e:  # one process hashes every shard
        make_sources(cfg)
    assert str(e.value) == message
    hashed = []
    monkeypatch.setattr(TokenStore, "verify", lambda self, shards: hashed.extend(shards))
    monkeypatch.setattr(jax, "process_count", lambda: 3)
    for process in range(3):  # of three processes each hashes its share, so shard 0 once
        monkeypatch.setattr(jax, "process_index", lambda process=process: process)
        make_sources(cfg)
    assert sorted(hashed) == [0, 1, 2, 3, 4]


# ---------------------------------------------------------------------------------------------- overwrite


def test_prepare_refuses_an_existing_output_unless_overwrite(tmp_path, capsys):
    first, second = _write(tmp_path / "1.txt", "first"), _write(tmp_path / "2.txt", "second text")
    out = str(tmp_path / "store")
    assert cli.run("prepare", ["--input", first, "--tokenizer", "byte", "--output", out]) == 0
    manifest = Path(out, MANIFEST).read_text()
    assert cli.run("prepare", ["--input", second, "--tokenizer", "byte", "--output", out]) == 2
    assert _error_line(capsys) == (f"--output '{out}' already exists and is not empty; pass --overwrite to replace "
                                   "it or choose another directory.")
    assert Path(out, MANIFEST).read_text() == manifest  # untouched
    assert cli.run("prepare", ["--input", second, "--tokenizer", "byte", "--output", out, "--overwrite"]) == 0
    assert TokenStore(out).num_tokens == len("second text")
    assert sorted(os.listdir(tmp_path)) == ["1.txt", "2.txt", "store"]  # no .tmp or .old left behind

    other = tmp_path / "notes"
    other.mkdir()
    _write(other / "keep.txt", "mine")
    assert cli.run("prepare", ["--input", first, "--tokenizer", "byte", "--output", str(other)]) == 2
    assert "already exists and is not empty" in _error_line(capsys) and os.listdir(other) == ["keep.txt"]
    with pytest.raises(DataError, match="exists but holds no token store"):
        ensure_builtin("stdlib", str(other))
    (tmp_path / "empty").mkdir()
    assert cli.run("prepare", ["--input", first, "--tokenizer", "byte", "--output", str(tmp_path / "empty")]) == 0
