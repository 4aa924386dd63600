"""Token data: tokenizers, the prepare CLI, token stores, packing, sampling, loading and mixtures."""

import functools
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from conftest import REPO, cpu_xla_flags
from helpers import tiny_config

from jaxtron import cli
from jaxtron.config.schema import ConfigError
from jaxtron.data.errors import DataError
from jaxtron.data.loader import BatchIterator, LocalBatch, _local_columns, _local_indices, global_batch, make_sources
from jaxtron.data.packing import Mixture, PackedSplit
from jaxtron.data.prepare import prepare
from jaxtron.data.store import StoreWriter, TokenStore
from jaxtron.data.tokenizers import load_tokenizer
from jaxtron.parallel.mesh import make_mesh
from jaxtron.parallel.sharding import batch_sharding, sequence_order

TESTS = os.path.dirname(os.path.abspath(__file__))
WORDS = ["alpha", "beta", "gamma", "delta", "token", "store", "pack", "window", "shard", "jax", "héllo", "wörld"]


def _sentences(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 9))) for _ in range(n)]


def _mesh(**sizes):
    return make_mesh({**dict(data=1, fsdp=1, sequence=1, expert=1, tensor=1), **sizes})


def _write(path, text, mode="w"):
    with open(path, mode) as f:
        f.write(text)
    return str(path)


def _files(directory) -> dict[str, bytes]:
    return {name: Path(directory, name).read_bytes() for name in sorted(os.listdir(directory))}


def _error_line(capsys) -> str:
    """The one line the CLI printed for an error, without its 'error: ' prefix."""
    err = capsys.readouterr().err
    lines = [l for l in err.splitlines() if l]
    assert len(lines) == 1 and lines[0].startswith("error: ") and lines[0].endswith("."), err
    assert "Traceback" not in err
    return lines[0][len("error: "):]


# ---------------------------------------------------------------------------------------------- tokenizers


@pytest.fixture(scope="module")
def tokenizer_files(tmp_path_factory):
    """A tiny byte-level BPE tokenizer.json and a tiny SentencePiece model, trained here (no network)."""
    import sentencepiece
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    root = tmp_path_factory.mktemp("tokenizers")
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(_sentences(200, 0), trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
        special_tokens=["<|endoftext|>"]))
    hf = str(root / "tokenizer.json")
    bpe.save(hf)

    corpus = _write(root / "sp.txt", "\n".join(_sentences(300, 1)) + "\n")
    sentencepiece.SentencePieceTrainer.train(input=corpus, model_prefix=str(root / "sp"), vocab_size=60,
                                             hard_vocab_limit=False, minloglevel=2)
    return {"huggingface": hf, "sentencepiece": str(root / "sp.model"), "byte": "byte"}


@pytest.mark.parametrize("kind,text", [
    ("byte", "héllo wörld 😀\n\ttabs and  spaces"),
    ("huggingface", "héllo wörld 😀\n\ttabs, unseen zq words and  spaces"),
    ("sentencepiece", "alpha beta héllo wörld jax shard"),  # SentencePiece normalises whitespace
])
def test_tokenizers_round_trip_and_are_detected_from_the_file(kind, text, tokenizer_files):
    tok = load_tokenizer(tokenizer_files[kind])
    assert tok.kind == kind
    ids = tok.encode(text)
    assert ids.dtype == np.uint32 and 0 < ids.size and int(ids.max()) < tok.vocab_size
    assert tok.decode(ids) == text
    if kind == "byte":
        assert tok.vocab_size == 256 and ids.tolist() == list(text.encode("utf-8")) and tok.eos_id is None
    if kind == "huggingface":
        from tokenizers import Tokenizer
        lib = Tokenizer.from_file(tokenizer_files[kind])
        assert tok.vocab_size == lib.get_vocab_size() > 256  # trained merges on top of the 256 bytes
        assert ids.tolist() == lib.encode(text, add_special_tokens=False).ids
        assert ids.size < len(text.encode("utf-8"))  # merges really apply
        assert tok.eos_id == lib.token_to_id("<|endoftext|>") == 0 and tok.eos_id not in ids
    if kind == "sentencepiece":
        import sentencepiece
        sp = sentencepiece.SentencePieceProcessor(model_file=tokenizer_files[kind])
        assert tok.vocab_size == sp.GetPieceSize() and ids.tolist() == sp.EncodeAsIds(text)
        assert tok.eos_id == sp.eos_id() == 2 and sp.IdToPiece(2) == "</s>"
    assert tok.describe()["kind"] == kind and tok.describe()["vocab_size"] == tok.vocab_size
    assert tok.describe()["eos_id"] == tok.eos_id


# ---------------------------------------------------------------------------------------------- prepare


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """Three plain-text documents and a JSONL file whose 'body' field holds the text (one empty)."""
    root = tmp_path_factory.mktemp("corpus")
    texts = _sentences(9, 2)
    paths = [_write(root / f"doc{i}.txt", "\n".join(texts[3 * i:3 * i + 3]) + "\n") for i in range(3)]
    lines = _sentences(12, 3) + [""]
    records = [json.dumps({"text": "WRONG FIELD", "body": line, "n": i}) for i, line in enumerate(lines)]
    _write(root / "more.jsonl", "\n".join(records[:5]) + "\n\n" + "\n".join(records[5:]) + "\n")
    # sorted input order: doc0.txt, doc1.txt, doc2.txt, more.jsonl
    documents = [Path(p).read_text() for p in paths] + lines
    return {"root": str(root), "documents": documents}


def _prepare_args(corpus, tokenizer, output, *extra):
    return ["--input", os.path.join(corpus["root"], "*.txt"), "--input", os.path.join(corpus["root"], "*.jsonl"),
            "--tokenizer", tokenizer, "--output", str(output), "--text-field", "body", *extra]


def test_prepare_counts_contents_and_determinism(corpus, tokenizer_files, tmp_path):
    from tokenizers import Tokenizer
    hf = tokenizer_files["huggingface"]
    lib = Tokenizer.from_file(hf)
    eos = lib.token_to_id("<|endoftext|>")
    encoded = [lib.encode(t, add_special_tokens=False).ids for t in corpus["documents"]]
    encoded = [e + [eos] for e in encoded if e]  # empty documents are skipped; the others end with EOS
    assert len(encoded) == 3 + 12  # the empty JSONL record and the blank line hold no document

    assert cli.run("prepare", _prepare_args(corpus, hf, tmp_path / "a", "--workers", "1")) == 0
    manifest = json.loads(Path(tmp_path / "a" / "manifest.json").read_text())
    assert manifest["num_documents"] == 15
    assert manifest["num_tokens"] == sum(len(e) for e in encoded)
    assert manifest["dtype"] == "uint16" and manifest["vocab_size"] == lib.get_vocab_size()
    assert manifest["tokenizer"]["kind"] == "huggingface" and manifest["format"] == 2
    assert manifest["eos_id"] == eos == 0 and manifest["tokenizer"]["eos"] == "<|endoftext|>"
    assert [os.path.basename(s["path"]) for s in manifest["sources"]] == ["doc0.txt", "doc1.txt", "doc2.txt",
                                                                         "more.jsonl"]
    store = TokenStore(str(tmp_path / "a"))
    np.testing.assert_array_equal(store.read(0, store.num_tokens), np.concatenate(encoded))
    np.testing.assert_array_equal(store.doc_start(np.arange(16)), np.cumsum([0] + [len(e) for e in encoded]))
    assert store.eos_id == eos and isinstance(store._docs[0], np.memmap)  # offsets stay on disk
    assert Path(tmp_path / "a" / "tokens-00000.bin").read_bytes() == np.concatenate(encoded).astype("<u2").tobytes()
    begin, end = store.doc_start(np.array([3, 4]))
    first_jsonl = store.read(int(begin), int(end - begin))
    assert first_jsonl[-1] == eos
    assert load_tokenizer(hf).decode(first_jsonl[:-1]) == corpus["documents"][3]  # the 'body' field, not 'text'

    reference = _files(tmp_path / "a")
    assert sorted(reference) == ["docs-00000.bin", "manifest.json", "tokens-00000.bin"]
    assert cli.run("prepare", _prepare_args(corpus, hf, tmp_path / "a", "--workers", "1", "--overwrite")) == 0
    assert _files(tmp_path / "a") == reference
    assert cli.run("prepare", _prepare_args(corpus, hf, tmp_path / "b", "--workers", "2")) == 0
    assert _files(tmp_path / "b") == reference
    assert not [name for name in os.listdir(tmp_path) if ".tmp-" in name]


def test_small_shards_read_across_boundaries(corpus, tmp_path):
    documents = [d.encode("utf-8") for d in corpus["documents"] if d]
    stream = np.frombuffer(b"".join(documents), np.uint8)
    manifest = prepare([os.path.join(corpus["root"], "*")], "byte", str(tmp_path / "s"), text_field="body",
                       workers=1, shard_tokens=120)
    sizes = [s["num_tokens"] for s in manifest["shards"]]
    assert len(sizes) >= 4 and sum(sizes) == stream.size == manifest["num_tokens"]
    assert manifest["dtype"] == "uint16" and manifest["num_documents"] == len(documents)
    # shards end at document boundaries and stay under shard_tokens unless one document is larger
    boundaries = set(np.cumsum([len(d) for d in documents]).tolist())
    assert set(np.cumsum(sizes).tolist()) <= boundaries
    assert all(n <= 120 or s["num_documents"] == 1 for n, s in zip(sizes, manifest["shards"], strict=True))
    assert sorted(os.listdir(tmp_path / "s")) == sorted(
        ["manifest.json"] + [f"{k}-{i:05d}.bin" for i in range(len(sizes)) for k in ("tokens", "docs")])

    store = TokenStore(str(tmp_path / "s"))
    starts = np.cumsum([0] + [len(d) for d in documents])
    np.testing.assert_array_equal(store.doc_start(np.arange(len(documents) + 1)), starts)
    doc_of_token = np.repeat(np.arange(len(documents)), [len(d) for d in documents])
    np.testing.assert_array_equal(store.doc_index(np.arange(stream.size)), doc_of_token)
    np.testing.assert_array_equal(store.take(np.array([[5, int(starts[-1]) - 1]])), [stream[[5, -1]]])
    ends = np.cumsum(sizes)[:-1]
    for start, length in [(int(ends[0]) - 3, 7), (int(ends[0]) - 1, int(ends[2] - ends[0]) + 5), (0, stream.size),
                          (int(ends[1]), 1), (int(ends[1]) - 1, 1), (stream.size - 2, 2)]:
        np.testing.assert_array_equal(store.read(start, length), stream[start:start + length])
    # the vectorised gather the loader uses agrees with single reads, inside shards and across them
    starts = np.random.default_rng(0).integers(0, stream.size - 40, 200)
    np.testing.assert_array_equal(store.gather(starts, 40), np.stack([stream[s:s + 40] for s in starts]))


# ---------------------------------------------------------------------------------------------- bad input


@pytest.fixture(scope="module")
def big_vocab_tokenizer(tmp_path_factory):
    from tokenizers import Tokenizer, models, pre_tokenizers
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(70000)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    path = str(tmp_path_factory.mktemp("big") / "tokenizer.json")
    tok.save(path)
    return path


def test_bad_inputs_are_one_line_errors(tmp_path, capsys, big_vocab_tokenizer):
    assert issubclass(DataError, ConfigError)
    out = str(tmp_path / "out")
    text = _write(tmp_path / "one.txt", "some text")

    pattern = str(tmp_path / "nothing" / "*.txt")
    assert cli.run("prepare", ["--input", pattern, "--tokenizer", "byte", "--output", out]) == 2
    assert _error_line(capsys) == (f"--input '{pattern}' matches no files jaxtron reads; check the path or quote "
                                   "the glob.")

    (tmp_path / "empty").mkdir()
    for i in range(2):
        _write(tmp_path / "empty" / f"e{i}.txt", "")
    empty = str(tmp_path / "empty" / "*.txt")
    assert cli.run("prepare", ["--input", empty, "--tokenizer", "byte", "--output", out]) == 2
    assert "the inputs hold no text" in _error_line(capsys)

    binary = _write(tmp_path / "garbage.model", b"\x00\x01\x02not a model\xff" * 8, "wb")
    not_tokenizer = _write(tmp_path / "settings.json", json.dumps({"learning_rate": 0.1}))
    half_json = _write(tmp_path / "half.json", '{"model": {"type": "BPE"')
    for path, what in [(binary, "is not a SentencePiece model"), (not_tokenizer, "is not a Hugging Face tokenizer"),
                       (half_json, "starts like JSON but is not valid JSON")]:
        assert cli.run("prepare", ["--input", text, "--tokenizer", path, "--output", out]) == 2
        message = _error_line(capsys)
        assert message.startswith(f"tokenizer file '{path}' {what}"), message
    assert cli.run("prepare", ["--input", text, "--tokenizer", str(tmp_path / "missing.json"), "--output", out]) == 2
    assert "missing.json' is neither 'byte' nor an existing file" in _error_line(capsys)

    assert cli.run("prepare", ["--input", text, "--tokenizer", big_vocab_tokenizer, "--output", out,
                         "--dtype", "uint16", "--no-eos"]) == 2
    assert _error_line(capsys) == ("a vocabulary of 70000 tokens does not fit the token dtype uint16; "
                                   "use --dtype auto or a larger dtype.")
    assert cli.run("prepare", ["--input", text, "--tokenizer", "byte", "--output", out, "--dtype", "int8"]) == 2
    assert "token dtype 'int8' is not one of auto, uint16, uint32" in _error_line(capsys)
    # auto picks uint32 for the same vocabulary
    manifest = prepare([_write(tmp_path / "w.txt", "w1 w69999 w65536")], big_vocab_tokenizer, out, workers=1,
                       eos=None)
    assert manifest["dtype"] == "uint32"
    np.testing.assert_array_equal(TokenStore(out).read(0, 3), [1, 69999, 65536])

    bad_json = _write(tmp_path / "bad.jsonl", '{"text": "fine"}\n{"text": "cut off\n')
    no_field = _write(tmp_path / "nofield.jsonl", '{"text": "fine"}\n\n{"body": "wrong field"}\n')
    not_object = _write(tmp_path / "list.jsonl", '["text"]\n')
    for path, message in [(bad_json, f"line 2 of '{bad_json}' is not valid JSON; fix or remove it."),
                          (no_field, (f"line 3 of '{no_field}' has no text field 'text' (its fields are: body); "
                                     "pass the right --text-field.")),
                          (not_object, (f"line 1 of '{not_object}' has no text field 'text' (its fields are: none); "
                                        "pass the right --text-field."))]:
        assert cli.run("prepare", ["--input", path, "--tokenizer", "byte", "--output", out + "_j",
                                   "--workers", "1"]) == 2
        assert _error_line(capsys) == message
        assert not os.path.exists(out + "_j")  # nothing half-written
        assert not [name for name in os.listdir(os.path.dirname(out)) if ".tmp-" in name]
    latin1 = _write(tmp_path / "latin1.txt", "caf\xe9".encode("latin-1"), "wb")
    assert cli.run("prepare", ["--input", latin1, "--tokenizer", "byte", "--output", out + "_l",
                               "--workers", "1"]) == 2
    assert _error_line(capsys) == f"input file '{latin1}' is not UTF-8 text (byte 3); convert it or leave it out."


@pytest.mark.integration
def test_cli_exits_2_without_traceback_when_a_worker_fails(tmp_path):
    """A real `jaxtron prepare` whose error is raised inside a tokenizing worker process."""
    good = [_write(tmp_path / f"g{i}.jsonl", json.dumps({"text": "ok"}) + "\n") for i in range(3)]
    bad = _write(tmp_path / "h.jsonl", '{"text": "fine"}\nnot json\n')
    out = subprocess.run([sys.executable, "-m", "jaxtron", "prepare", "--input", str(tmp_path / "*.jsonl"),
                          "--tokenizer", "byte", "--output", str(tmp_path / "out"), "--workers", "2"],
                         cwd=REPO, capture_output=True, text=True, timeout=120, check=False)
    assert good and out.returncode == 2, out.stderr
    assert "Traceback" not in out.stderr
    assert out.stderr.strip().splitlines() == [f"error: line 2 of '{bad}' is not valid JSON; fix or remove it."]
    assert not os.path.exists(tmp_path / "out") and not [name for name in os.listdir(tmp_path) if ".tmp-" in name]


@pytest.fixture()
def byte_store(tmp_path):
    path = str(tmp_path / "store")
    prepare([_write(tmp_path / "a.txt", "first document"), _write(tmp_path / "b.txt", "second one")], "byte", path,
            workers=1)
    return path


def test_truncated_corrupted_and_missing_stores(byte_store, tmp_path):
    tokens = os.path.join(byte_store, "tokens-00000.bin")
    original = Path(tokens).read_bytes()
    assert len(original) == 2 * len("first documentsecond one")  # uint16 for the byte vocabulary
    assert TokenStore(byte_store).num_tokens == 24

    _write(tokens, original[:-2], "wb")
    with pytest.raises(DataError) as e:
        TokenStore(byte_store)
    assert str(e.value) == (f"shard file '{tokens}' has 46 bytes but the manifest says 48; the store is truncated "
                            "or incomplete, prepare it again.")

    flipped = bytearray(original)
    flipped[4] ^= 0x01  # the low byte of token 2
    _write(tokens, bytes(flipped), "wb")
    assert TokenStore(byte_store).read(2, 1)[0] == ord("r") ^ 0x01  # opening checks sizes, not hashes
    with pytest.raises(DataError) as e:
        TokenStore(byte_store, verify=True)
    assert str(e.value) == (f"shard file '{tokens}' does not match its checksum in the manifest; the store is "
                            "corrupted, prepare it again.")

    os.remove(os.path.join(byte_store, "docs-00000.bin"))
    with pytest.raises(DataError, match="docs-00000.bin' has 0 bytes but the manifest says 24"):
        TokenStore(byte_store)

    empty = tmp_path / "not_a_store"
    empty.mkdir()
    with pytest.raises(DataError) as e:
        TokenStore(str(empty))
    assert str(e.value) == (f"'{empty}' is not a prepared token store (no manifest.json); create one with "
                            "jaxtron prepare.")
    _write(os.path.join(byte_store, "manifest.json"), "{")
    with pytest.raises(DataError, match=r"^the manifest of store '.*' is unreadable \(JSONDecodeError"):
        TokenStore(byte_store)


def test_store_vocabulary_larger_than_the_model(corpus, tokenizer_files, tmp_path):
    path = str(tmp_path / "hf")
    manifest = prepare([os.path.join(corpus["root"], "*.txt")], tokenizer_files["huggingface"], path, workers=1)
    vocab = manifest["vocab_size"]
    assert vocab > 256
    cfg = tiny_config(data=dict(source="store", path=path, seq_len=8))  # model.vocab_size = 256
    with pytest.raises(DataError) as e:
        make_sources(cfg)
    assert str(e.value) == (f"store '{path}' has a vocabulary of {vocab} tokens but model.vocab_size is 256; use a "
                            f"model vocabulary of at least {vocab} or a store made with the model's tokenizer.")
    _, validation, facts = make_sources(tiny_config(model=dict(vocab_size=vocab + 4),
                                                        data=dict(source="store", path=path, seq_len=8)))
    assert facts["train_tokens"] == manifest["num_tokens"] and validation is None  # eval_batches=0


# ---------------------------------------------------------------------------------------------- packing

SHORT_DOCS = ["abc", "de", "fghij", "k", "lmnopqr", "stu", "vwxyz01", "2345"]


@pytest.fixture()
def short_store(tmp_path):
    files = [_write(tmp_path / f"d{i}.txt", d) for i, d in enumerate(SHORT_DOCS)]
    prepare(files, "byte", str(tmp_path / "short"), workers=1)
    return TokenStore(str(tmp_path / "short"))


def _brute_force(documents: list[str], start: int, length: int) -> dict[str, np.ndarray]:
    """Row fields from the token stream [start, start + length + 1), computed token by token."""
    stream = [(ord(c), d) for d, doc in enumerate(documents) for c in doc]
    window = stream[start:start + length + 1]
    segments, positions, seg, pos = [], [], 1, 0
    for t in range(length):
        if t and window[t][1] != window[t - 1][1]:
            seg, pos = seg + 1, 0
        segments.append(seg)
        positions.append(pos)  # counts from the document's start, or from the row's for an earlier document
        pos += 1
    return {"inputs": np.array([w[0] for w in window[:-1]]), "targets": np.array([w[0] for w in window[1:]]),
            "segment_ids": np.array(segments), "positions": np.array(positions),
            "loss_mask": np.array([int(window[t + 1][1] == window[t][1]) for t in range(length)])}


def _by_window(split: PackedSplit) -> dict[int, dict[str, np.ndarray]]:
    samples = np.arange(split.num_windows)
    rows, windows = split.rows(samples), split.windows(samples)
    return {int(w): {k: v[i] for k, v in rows.items()} for i, w in enumerate(windows)}


def test_packed_rows_match_the_documents(short_store):
    # 8 documents, 25% held out: 2 stripes of 4 documents, the last of each ("k", "2345") for validation
    train = PackedSplit(short_store, seq_len=4, split="train", validation_fraction=0.25, seed=0)
    assert train.ranges.tolist() == [[0, 10], [11, 28]] and train.num_tokens == 27
    assert train.num_windows == 6  # (27 - 1) // 4
    train_docs = [d for i, d in enumerate(SHORT_DOCS) if i not in (3, 7)]
    rows = _by_window(train)
    assert sorted(rows) == [0, 1, 2, 3, 4, 5] and all(v.dtype == np.int32 for v in rows[0].values())
    # window 0 = "abcde": the target 'd' starts document "de"
    assert {k: v.tolist() for k, v in rows[0].items()} == {
        "inputs": [ord(c) for c in "abcd"], "targets": [ord(c) for c in "bcde"], "segment_ids": [1, 1, 1, 2],
        "positions": [0, 1, 2, 0], "loss_mask": [1, 1, 0, 1]}
    # window 2 = "ijlmn": the end of "fghij" (begun in an earlier row: positions restart at 0, not 3), then
    # "lmnopqr", which follows it in the train stream because "k" is held out
    assert {k: v.tolist() for k, v in rows[2].items()} == {
        "inputs": [ord(c) for c in "ijlm"], "targets": [ord(c) for c in "jlmn"], "segment_ids": [1, 1, 2, 2],
        "positions": [0, 1, 0, 1], "loss_mask": [1, 0, 1, 1]}
    assert rows[3]["positions"].tolist() == [0, 1, 2, 3]  # "nopq", the middle of "lmnopqr"
    for w, row in rows.items():
        expected = _brute_force(train_docs, w * 4, 4)
        for k in expected:
            np.testing.assert_array_equal(row[k], expected[k], err_msg=f"window {w} {k}")
        np.testing.assert_array_equal(row["inputs"][1:], row["targets"][:-1])

    validation = PackedSplit(short_store, seq_len=4, split="validation", validation_fraction=0.25, seed=1)
    assert validation.ranges.tolist() == [[10, 11], [28, 32]] and validation.num_windows == 1
    assert {k: v.tolist() for k, v in _by_window(validation)[0].items()} == {  # "k" + "2345"
        "inputs": [ord(c) for c in "k234"], "targets": [ord(c) for c in "2345"], "segment_ids": [1, 2, 2, 2],
        "positions": [0, 0, 1, 2], "loss_mask": [0, 1, 1, 1]}
    train_tokens = {chr(t) for r in rows.values() for t in np.r_[r["inputs"], r["targets"]]}
    assert train_tokens.isdisjoint(set("k2345"))  # no train window reaches a validation token

    with pytest.raises(DataError, match="has 8 document\\(s\\), too few to hold out 90% for validation"):
        PackedSplit(short_store, seq_len=4, split="train", validation_fraction=0.9, seed=0)
    with pytest.raises(DataError, match="the validation split of store .* has 5 tokens, fewer than one sequence "
                                        "of data.seq_len \\+ 1 = 17"):
        PackedSplit(short_store, seq_len=16, split="validation", validation_fraction=0.25, seed=0)


# ---------------------------------------------------------------------------------------------- sampling


@pytest.fixture(scope="module")
def word_store(tmp_path_factory):
    """About 1,700 byte tokens in 60 documents of one JSONL file."""
    root = tmp_path_factory.mktemp("words")
    jsonl = _write(root / "docs.jsonl", "".join(json.dumps({"text": t}) + "\n" for t in _sentences(60, 4)))
    prepare([jsonl], "byte", str(root / "store"), workers=1)
    return str(root / "store")


def test_same_seed_same_rows_and_one_epoch_visits_every_window_once(word_store):
    store = TokenStore(word_store)
    a, b, c = (PackedSplit(store, 16, "train", 0.1, seed) for seed in (7, 7, 8))
    n = a.num_windows
    assert n > 50
    epoch = np.arange(n)
    for k, v in a.rows(epoch).items():
        np.testing.assert_array_equal(v, b.rows(epoch)[k])
    assert not np.array_equal(a.rows(epoch)["inputs"], c.rows(epoch)["inputs"])
    np.testing.assert_array_equal(np.sort(a.windows(epoch)), epoch)
    assert not np.array_equal(a.windows(epoch), epoch)  # really shuffled
    second = a.windows(epoch + n)  # the next epoch is another permutation
    np.testing.assert_array_equal(np.sort(second), epoch)
    assert not np.array_equal(second, a.windows(epoch))


RESUME = """
import json, sys
import numpy as np
sys.path.insert(0, {tests!r})
import conftest  # 8 fake CPU devices, before jax
from helpers import tiny_config
from jaxtron.data.loader import BatchIterator, make_sources
from jaxtron.parallel.mesh import make_mesh
sections, step, count, out = json.loads(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
cfg = tiny_config(**sections)
mesh = make_mesh(dict(data=2, fsdp=2, sequence=2, expert=1, tensor=1))
it = BatchIterator(make_sources(cfg)[0], mesh, cfg.train.global_batch_size, step=step)
batches = [next(it) for _ in range(count)]
it.close()
np.savez(out, **{{f"{{i}}_{{k}}": np.asarray(v) for i, b in enumerate(batches) for k, v in b.items()}})
"""


@pytest.mark.integration
def test_a_new_process_resumes_with_the_same_batches(word_store, tmp_path):
    sections = dict(data=dict(source="store", path=word_store, seq_len=16, validation_fraction=0.1),
                    train=dict(global_batch_size=8, seed=3))
    cfg = tiny_config(**sections)
    source = make_sources(cfg)[0]
    mesh = _mesh(data=2, fsdp=2, sequence=2)
    it = BatchIterator(source, mesh, 8)
    before = [next(it) for _ in range(3)]
    state = it.get_state()
    assert state == {"step": 3}
    after = [{k: np.asarray(v) for k, v in next(it).items()} for _ in range(2)]
    it.close()
    assert before[0]["inputs"].sharding == batch_sharding(mesh) and before[0]["inputs"].shape == (8, 16)
    order = sequence_order(16, 2)  # the columns of a row sharded over sequence=2: load-balanced
    for step, batch in enumerate([{k: np.asarray(v) for k, v in b.items()} for b in before] + after):
        for k, v in source.rows(step * 8 + np.arange(8)).items():
            np.testing.assert_array_equal(batch[k], v[:, order])

    out = str(tmp_path / "resumed.npz")
    run = subprocess.run([sys.executable, "-c", RESUME.format(tests=TESTS), json.dumps(sections),
                          str(state["step"]), "2", out], cwd=REPO, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "XLA_FLAGS": cpu_xla_flags()}, check=False)
    assert run.returncode == 0, run.stderr
    resumed = np.load(out)
    assert sorted(resumed.files) == sorted(f"{i}_{k}" for i in range(2) for k in after[0])
    for i, batch in enumerate(after):
        for k, v in batch.items():
            np.testing.assert_array_equal(resumed[f"{i}_{k}"], v, err_msg=f"batch {3 + i} {k}")
    assert not np.array_equal(after[0]["inputs"], after[1]["inputs"])


def _grain_workers() -> list:
    import multiprocessing
    return [p for p in multiprocessing.active_children() if p.name.startswith("grain-")]


@pytest.mark.slow
def test_grain_worker_processes_give_the_same_batches(word_store):
    source = PackedSplit(TokenStore(word_store), 16, "train", 0.1, seed=5)
    mesh = _mesh(data=2, fsdp=2, sequence=2)
    threaded = BatchIterator(source, mesh, 8, step=2)
    expected = [{k: np.asarray(v) for k, v in next(threaded).items()} for _ in range(3)]
    threaded.close()
    workers = BatchIterator(source, mesh, 8, step=2, workers=2)
    try:
        got = [{k: np.asarray(v) for k, v in next(workers).items()} for _ in range(3)]
        assert workers.get_state() == {"step": 5}
        assert len(_grain_workers()) == 2
    finally:
        workers.close()
    assert _grain_workers() == []  # close() stops the worker processes
    for i, (g, e) in enumerate(zip(got, expected, strict=True)):
        assert sorted(g) == sorted(e)
        for k in e:
            np.testing.assert_array_equal(g[k], e[k], err_msg=f"step {2 + i} {k}")


@pytest.mark.parametrize("sizes,dim", [(dict(data=2, fsdp=2, sequence=2), 0), (dict(sequence=2, tensor=4), 1)],
                         ids=["rows_split", "columns_split"])
def test_two_processes_hold_disjoint_parts_of_the_batch(sizes, dim, word_store):
    """Processes own contiguous halves of the mesh's devices; each builds only the part its devices hold."""
    source = PackedSplit(TokenStore(word_store), 16, "train", 0.1, seed=1)
    mesh = _mesh(**sizes)
    sharding, shape, B = batch_sharding(mesh), (8, 16), 8

    class ProcessView:  # the addressable part of the sharding for a process that owns `devices`
        def __init__(self, devices):
            self.devices, self.mesh = set(devices), mesh

        def addressable_devices_indices_map(self, shape):
            return {d: i for d, i in sharding.devices_indices_map(shape).items() if d in self.devices}

    flat = list(mesh.devices.flat)
    views = [ProcessView(flat[:4]), ProcessView(flat[4:])]
    rows = [_local_indices(v, shape, 0) for v in views]
    cols = [_local_columns(v, shape) for v in views]  # the tokens of a row each process holds, column order
    order = sequence_order(16, mesh.shape["sequence"])  # the load-balanced layout of a sharded sequence
    halves = [np.arange(0, shape[dim] // 2), np.arange(shape[dim] // 2, shape[dim])]
    whole = [np.arange(shape[1 - dim])] * 2
    wanted = (halves, [order] * 2) if dim == 0 else (whole, [order[h] for h in halves])
    for got, want in zip((rows, cols), wanted, strict=True):
        np.testing.assert_array_equal(got[0], want[0])
        np.testing.assert_array_equal(got[1], want[1])
    np.testing.assert_array_equal(_local_indices(sharding, shape, 0), np.arange(8))  # this one process: all

    step = 4
    parts = [LocalBatch(source, r, c, B)(step) for r, c in zip(rows, cols, strict=True)]
    full = LocalBatch(source, np.arange(B), np.arange(16), B)(step)
    assembled = global_batch(source, step, mesh, B)
    for k, v in full.items():
        np.testing.assert_array_equal(v, source.rows(step * B + np.arange(B))[k])
        assert parts[0][k].shape == parts[1][k].shape == ((4, 16) if dim == 0 else (8, 8))
        np.testing.assert_array_equal(np.concatenate([parts[0][k], parts[1][k]], axis=dim), v[:, order])
        np.testing.assert_array_equal(np.asarray(assembled[k]), v[:, order])
    if dim == 0:  # disjoint rows hold different windows
        first = {tuple(r) for r in parts[0]["inputs"]}
        assert not first & {tuple(r) for r in parts[1]["inputs"]}


# ---------------------------------------------------------------------------------------------- mixture


def _counting_store(path: str, offset: int, num_tokens: int, doc_len: int) -> str:
    """Tokens offset, offset+1, ...: a window is recognisable from its first token."""
    writer = StoreWriter(path, vocab_size=20000, dtype="uint16")
    for start in range(0, num_tokens, doc_len):
        writer.add(np.arange(offset + start, offset + min(start + doc_len, num_tokens), dtype=np.uint32))
    writer.finish({"kind": "test"}, [])
    return path


def test_mixture_follows_weights_and_reads_each_store_once_per_epoch(tmp_path):
    a = _counting_store(str(tmp_path / "a"), 0, 8 * 300 + 1, 37)
    b = _counting_store(str(tmp_path / "b"), 10000, 8 * 70 + 1, 50)
    cfg = tiny_config(model=dict(vocab_size=20000),
                      data=dict(source="store", path=f"{a},{b}", weights="3,1", seq_len=8, validation_fraction=0))
    mixture = make_sources(cfg)[0]
    assert isinstance(mixture, Mixture) and [p.num_windows for p in mixture.parts] == [300, 70]
    samples = np.arange(4000)
    rows = mixture.rows(samples)
    again = make_sources(cfg)[0].rows(samples)
    for k in rows:
        np.testing.assert_array_equal(rows[k], again[k])
    first = rows["inputs"][:, 0]
    from_a = first < 10000
    assert abs(from_a.mean() - 0.75) <= 0.01
    assert abs(from_a[:100].mean() - 0.75) <= 0.01  # every prefix follows the weights, not just the total
    assert np.all(np.diff(rows["inputs"], axis=1) == 1)  # whole windows of one store, in order
    assert np.all(rows["inputs"][:, 0] % 8 == 0)  # windows start at multiples of seq_len
    for window, (count, n) in ((first[from_a] // 8, (int(from_a.sum()), 300)),
                               ((first[~from_a] - 10000) // 8, (int((~from_a).sum()), 70))):
        for e in range(count // n):  # each full epoch of a store is a permutation of its windows
            np.testing.assert_array_equal(np.sort(window[e * n:(e + 1) * n]), np.arange(n))
        assert len(set(window[(count // n) * n:].tolist())) == count % n  # no repeat in the partial epoch
    reseeded = make_sources(tiny_config(model=dict(vocab_size=20000), train=dict(seed=1),
                                          data=dict(source="store", path=f"{a},{b}", weights="3,1", seq_len=8,
                                                    validation_fraction=0)))[0]
    assert not np.array_equal(reseeded.rows(samples[:50])["inputs"], rows["inputs"][:50])


# ---------------------------------------------------------------------------------------------- loss


@pytest.mark.slow
def test_packed_loss_of_a_document_equals_its_loss_alone(tmp_path):
    """Fails if the model ignores segment_ids (or positions): packing must not leak across documents."""
    from jaxtron.training import state as state_lib
    from jaxtron.training.loss import loss_sums

    first, second = "The first document, 20", "then the second one."
    files = [_write(tmp_path / "0.txt", first), _write(tmp_path / "1.txt", second)]
    prepare(files, "byte", str(tmp_path / "pair"), workers=1)
    L = len(first) + len(second) - 1
    split = PackedSplit(TokenStore(str(tmp_path / "pair")), L, "train", 0.0, seed=0)
    assert split.num_windows == 1
    packed = split.rows(np.array([0]))
    b0 = len(first)  # input position where the second document starts
    assert packed["segment_ids"][0].tolist() == [1] * b0 + [2] * (L - b0)
    assert packed["positions"][0, b0:].tolist() == list(range(L - b0))
    assert packed["loss_mask"][0].tolist() == [1] * (b0 - 1) + [0] + [1] * (L - b0)

    tokens = np.frombuffer(second.encode(), np.uint8).astype(np.int32)
    alone = {"inputs": np.zeros((1, L), np.int32), "targets": np.zeros((1, L), np.int32),
             "positions": np.arange(L, dtype=np.int32)[None], "segment_ids": np.ones((1, L), np.int32)}
    alone["inputs"][0, :len(tokens) - 1] = tokens[:-1]
    alone["targets"][0, :len(tokens) - 1] = tokens[1:]

    cfg = tiny_config(data=dict(seq_len=L))
    setup = state_lib.setup(cfg, "xla")
    params = state_lib.init_state(cfg, "xla", None).params

    @functools.partial(jax.jit, static_argnums=1)
    def per_token(batch, offset):
        """The loss of each of the second document's targets, one loss_mask at a time."""
        masks = jax.numpy.eye(L, dtype=jax.numpy.int32)[offset:offset + len(tokens) - 1][:, None, :]
        return jax.vmap(lambda m: loss_sums(params, setup.graphdef, {**batch, "loss_mask": m})[1][0])(masks)

    want = np.asarray(per_token(alone, 0))
    got = np.asarray(per_token(packed, b0))
    assert want.shape == (len(tokens) - 1,) and np.all(want > 0.1)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    leaky = np.asarray(per_token({k: v for k, v in packed.items() if k != "segment_ids"}, b0))
    assert np.abs(leaky - want).max() > 1e-3
    # the first document's losses do not depend on the segments (causal attention never looks ahead)
    np.testing.assert_allclose(np.asarray(per_token(packed, 0)), np.asarray(
        per_token({k: v for k, v in packed.items() if k != "segment_ids"}, 0)), rtol=1e-5)


@pytest.mark.parametrize("n", [1, 2, 3, 7, 64, 1000, 4099])
def test_epoch_permutation_is_a_bijection_that_changes_every_epoch(n):
    from jaxtron.data.shuffle import EpochPermutation
    perm = EpochPermutation(n, seed=5)
    epochs = [perm(np.arange(e * n, (e + 1) * n)) for e in range(3)]
    for order in epochs:
        np.testing.assert_array_equal(np.sort(order), np.arange(n))
    if n > 10:
        assert (epochs[0] != epochs[1]).any() and (epochs[0] != np.arange(n)).any()
        assert (EpochPermutation(n, seed=6)(np.arange(n)) != epochs[0]).any()
    np.testing.assert_array_equal(EpochPermutation(n, seed=5)(np.arange(n)), epochs[0])  # deterministic


# ---------------------------------------------------------------------------------------- sequence layout


def _causal_work(tokens: np.ndarray) -> int:
    """(query, key) pairs of causal attention whose query is one of ``tokens`` (token i sees i + 1 keys)."""
    return int(np.sum(tokens + 1))


@pytest.mark.parametrize("length,shards", [(16, 2), (64, 4), (64, 8), (48, 3)])
def test_the_load_balanced_layout_gives_every_sequence_shard_equal_causal_work(length, shards):
    order = sequence_order(length, shards)
    np.testing.assert_array_equal(np.sort(order), np.arange(length))  # a permutation: every token once
    work = [_causal_work(part) for part in order.reshape(shards, -1)]
    assert len(set(work)) == 1, work
    # cut in order, the last shard would do 2 x shards - 1 times the first one's work
    contiguous = [_causal_work(part) for part in sequence_order(length, shards, "contiguous").reshape(shards, -1)]
    assert contiguous[-1] > 1.5 * contiguous[0]
    np.testing.assert_array_equal(sequence_order(length, 1), np.arange(length))
    with pytest.raises(ValueError, match="cannot lay 50 tokens over 4 shards"):
        sequence_order(50, 4)


def test_the_loader_lays_a_sharded_sequence_out_balanced_and_each_token_keeps_its_position(word_store):
    source = PackedSplit(TokenStore(word_store), 16, "train", 0.1, seed=2)
    rows = source.rows(3 * 8 + np.arange(8))
    assert rows["segment_ids"].max() > 1  # rows hold several documents
    batch = {k: np.asarray(v) for k, v in global_batch(source, 3, _mesh(data=2, sequence=4), 8).items()}
    # sequence shard i holds chunks i and 7 - i of its rows' 8 chunks of 2 tokens
    np.testing.assert_array_equal(sequence_order(16, 4), [0, 1, 14, 15, 2, 3, 12, 13, 4, 5, 10, 11, 6, 7, 8, 9])
    for k, v in rows.items():
        np.testing.assert_array_equal(batch[k], v[:, sequence_order(16, 4)], err_msg=k)
    # an unsharded sequence keeps the row's order
    plain = global_batch(source, 3, _mesh(data=8), 8)
    for k, v in rows.items():
        np.testing.assert_array_equal(np.asarray(plain[k]), v, err_msg=k)


def test_the_builtin_corpus_prepares_the_standard_librarys_sources(tmp_path):
    """The main job's corpus: every .py file of the standard library, each one plain-text document."""
    from jaxtron.data.corpus import ensure_builtin, stdlib_files
    from jaxtron.data.store import TokenStore

    ensure_builtin("stdlib", str(tmp_path / "stdlib"))
    store = TokenStore(str(tmp_path / "stdlib"))
    nonempty = [f for f in stdlib_files() if os.path.getsize(f)]
    assert store.manifest["num_documents"] == len(nonempty) > 100


def test_writers_at_one_output_never_share_a_directory(tmp_path):
    """A built-in corpus prepared while another writer is open at the same path: each fills its own directory, the
    first to finish publishes, the other is refused with one sentence and leaves nothing behind."""
    from jaxtron.data.corpus import ensure_builtin
    out = str(tmp_path / "prompts")
    live = StoreWriter(out, 256)
    live.add(np.arange(5, dtype=np.uint16))
    ensure_builtin("arithmetic-prompts", out)
    published = TokenStore(out, verify=True)
    with pytest.raises(DataError, match="already exists"):
        live.finish({"kind": "byte"}, [])
    assert TokenStore(out, verify=True).manifest == published.manifest
    assert sorted(os.listdir(tmp_path)) == ["prompts"]
    ensure_builtin("arithmetic-prompts", out)  # a second run finds the store and keeps it
    assert TokenStore(out).manifest == published.manifest


def test_a_killed_writers_directory_goes_at_the_next_claim_and_a_live_ones_stays(tmp_path):
    """The lock inside a writer's directory tells a killed writer (nobody holds it) from a live one."""
    import fcntl

    from jaxtron.data.staging import WRITER_LOCK, claim_writer_dir
    out = str(tmp_path / "store")
    dead, live = tmp_path / "store.tmp-dead", tmp_path / "store.tmp-live"
    for folder in (dead, live):
        folder.mkdir()
        (folder / WRITER_LOCK).touch()
        (folder / "tokens-00000.bin").write_bytes(b"\0" * 8)
    with open(live / WRITER_LOCK) as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        tmp, lock = claim_writer_dir(out)
        assert not dead.exists() and live.is_dir() and os.path.isdir(tmp) and tmp.startswith(out + ".tmp-")
    lock.close()
