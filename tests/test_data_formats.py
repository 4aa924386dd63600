"""`jaxtron prepare` from the formats users hold: each gives the store the same documents give as plain JSON lines."""

import bz2
import gzip
import json
import lzma
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from jaxtron import cli
from jaxtron.data.store import TokenStore

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

TEXTS = ["The first document.\nIt has two lines.", "héllo wörld 😀 — unicode survives", "", "short",
         None, "tabs\tand  spaces\n\n", "the last one"] + [f"filler number {i} " * (i % 5 + 1) for i in range(30)]
TITLES = [f"title {i}" for i in range(len(TEXTS))]


def _digest(manifest: dict) -> list:
    """What makes two stores the same: every shard's tokens, document offsets and loss mask."""
    return [(s["tokens_sha256"], s["docs_sha256"], s.get("mask_sha256")) for s in manifest["shards"]]


def _manifest(path) -> dict:
    return json.loads(Path(path, "manifest.json").read_text())


def _jsonl(path, records, opener=open):
    with opener(path, "wt", encoding="utf-8") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
    return str(path)


def _zst(path, records):
    import zstandard
    data = "".join(json.dumps(r) + "\n" for r in records).encode("utf-8")
    Path(path).write_bytes(zstandard.ZstdCompressor().compress(data))
    return str(path)


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    """A Hugging Face model directory: a small byte-level BPE tokenizer.json, and a tokenizer_config.json whose
    eos_token (<|eot|>) is not the one the file alone would give (<|endoftext|>), with a ChatML template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    root = tmp_path_factory.mktemp("model")
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator([t for t in TEXTS if t] * 4, trainers.BpeTrainer(
        vocab_size=320, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
        special_tokens=["<|endoftext|>", "<|eot|>", "<|im_start|>", "<|im_end|>"]))
    bpe.save(str(root / "tokenizer.json"))
    template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    (root / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|eot|>", "chat_template": template}))
    return str(root)


def _prepare(inputs: list[str], output, tokenizer, *extra) -> dict:
    args = [a for path in inputs for a in ("--input", path)]
    assert cli.run("prepare", [*args, "--tokenizer", tokenizer, "--output", str(output), *extra]) == 0
    return _manifest(output)


@pytest.fixture(scope="module")
def reference(tmp_path_factory, tokenizer_dir):
    root = tmp_path_factory.mktemp("reference")
    jsonl = _jsonl(root / "docs.jsonl", [{"text": t} for t in TEXTS])
    return _digest(_prepare([jsonl], root / "store", tokenizer_dir))


def _write_format(kind: str, root: Path) -> tuple[list[str], list[str]]:
    """The documents of TEXTS written as ``kind``: (inputs, extra flags)."""
    records = [{"text": t, "n": i} for i, t in enumerate(TEXTS)]
    table = pa.table({"text": pa.array(TEXTS, pa.string()), "n": pa.array(range(len(TEXTS)), pa.int64())})
    if kind in ("jsonl.gz", "jsonl.bz2", "jsonl.xz"):
        opener = {"gz": gzip.open, "bz2": bz2.open, "xz": lzma.open}[kind.split(".")[1]]
        return [_jsonl(root / f"docs.{kind}", records, opener)], []
    if kind == "jsonl.zst":
        return [_zst(root / "docs.jsonl.zst", records)], []
    if kind == "json_array":
        (root / "docs.json").write_text(json.dumps(records, indent=1))
        return [str(root / "docs.json")], []
    if kind == "text_files":  # one document per file, in sorted name order; null has no file, "" an empty one
        for i, t in enumerate(TEXTS):
            if t is not None:
                (root / f"doc{i:03d}.txt").write_text(t, encoding="utf-8")
        return [str(root / "*.txt")], []
    if kind == "parquet_row_groups":
        pq.write_table(table, root / "docs.parquet", row_group_size=5)
        assert pq.ParquetFile(root / "docs.parquet").num_row_groups == 8
        return [str(root / "docs.parquet")], []
    if kind == "directory":  # two Parquet parts, a dataset card and .gitattributes, as a Hub dataset's copy has
        (root / "data").mkdir()
        pq.write_table(table.slice(0, 20), root / "data" / "train-00000-of-00002.parquet")
        pq.write_table(table.slice(20), root / "data" / "train-00001-of-00002.parquet")
        (root / "README.md").write_text("---\nlicense: mit\n---\n# a card, not a document\n")
        (root / ".gitattributes").write_text("*.parquet filter=lfs\n")
        return [str(root)], []
    if kind in ("arrow_file", "arrow_stream"):
        open_writer = pa.ipc.new_file if kind == "arrow_file" else pa.ipc.new_stream
        with open_writer(str(root / "docs.arrow"), table.schema) as writer:
            for batch in table.to_batches(max_chunksize=6):
                writer.write_batch(batch)
        return [str(root / "docs.arrow")], []
    datasets = pytest.importorskip("datasets")
    if kind == "save_to_disk":
        datasets.Dataset.from_list(records).save_to_disk(str(root / "saved"), num_shards=3)
        return [str(root / "saved")], []
    if kind == "dataset_dict_split":
        both = datasets.DatasetDict({"train": datasets.Dataset.from_list(records),
                                     "test": datasets.Dataset.from_list(records[:3])})
        both.save_to_disk(str(root / "saved"))
        return [str(root / "saved")], ["--split", "train"]
    if kind == "load_dataset_json":
        return [], ["--dataset", "json", "--data-files", _jsonl(root / "docs.jsonl", records)]
    assert kind == "load_dataset_directory"
    (root / "data").mkdir()
    pq.write_table(table, root / "data" / "train-00000-of-00001.parquet")
    return [], ["--dataset", str(root)]


FORMATS = ["jsonl.gz", "jsonl.bz2", "jsonl.xz", "jsonl.zst", "json_array", "text_files", "parquet_row_groups",
           "directory", "arrow_file", "arrow_stream", "save_to_disk", "dataset_dict_split", "load_dataset_json",
           "load_dataset_directory"]


@pytest.mark.parametrize("kind", FORMATS)
def test_every_format_gives_the_store_of_the_same_documents(kind, tmp_path, tokenizer_dir, reference):
    (tmp_path / "in").mkdir()
    inputs, extra = _write_format(kind, tmp_path / "in")
    manifest = _prepare(inputs, tmp_path / "store", tokenizer_dir, *extra)
    assert _digest(manifest) == reference
    assert manifest["num_documents"] == sum(1 for t in TEXTS if t)
    assert not [name for name in os.listdir(tmp_path) if ".tmp-" in name]


def test_nested_fields_and_a_template_give_the_documents_they_name(tmp_path, tokenizer_dir, reference):
    nested = [{"meta": {"body": t, "lang": "en"}, "title": title} for t, title in zip(TEXTS, TITLES, strict=True)]
    jsonl = _jsonl(tmp_path / "nested.jsonl", nested)
    assert _digest(_prepare([jsonl], tmp_path / "a", tokenizer_dir, "--text-field", "meta.body")) == reference
    table = pa.Table.from_pylist(nested)
    pq.write_table(table, tmp_path / "nested.parquet", row_group_size=4)
    assert _digest(_prepare([str(tmp_path / "nested.parquet")], tmp_path / "b", tokenizer_dir,
                            "--text-field", "meta.body")) == reference

    joined = [{"text": f"# {title}\n\n{t or ''}"} for t, title in zip(TEXTS, TITLES, strict=True)]
    expected = _digest(_prepare([_jsonl(tmp_path / "joined.jsonl", joined)], tmp_path / "c", tokenizer_dir))
    template = "# {{ title }}\n\n{{ meta.body or '' }}"
    for source, out in [(jsonl, "d"), (str(tmp_path / "nested.parquet"), "e")]:
        assert _digest(_prepare([source], tmp_path / out, tokenizer_dir, "--template", template)) == expected
    assert expected != reference


TALK = [{"role": "user", "content": "short"}, {"role": "assistant", "content": "the last one"},
        {"role": "user", "content": "héllo wörld"}, {"role": "assistant", "content": "filler number 3"}]


def test_a_messages_column_becomes_the_sft_store_with_its_mask(tmp_path, tokenizer_dir):
    from jaxtron.data.tokenizers import load_tokenizer
    records = [{"messages": TALK[:2 + 2 * (i % 2)], "id": i} for i in range(9)]
    jsonl = _jsonl(tmp_path / "talk.jsonl", records)
    reference = _prepare([jsonl], tmp_path / "a", tokenizer_dir, "--chat")
    assert reference["loss_mask"] and reference["format"] == 3
    pq.write_table(pa.Table.from_pylist(records), tmp_path / "talk.parquet", row_group_size=2)
    from_parquet = _prepare([str(tmp_path / "talk.parquet")], tmp_path / "b", tokenizer_dir, "--chat")
    assert _digest(from_parquet) == _digest(reference)
    # the mask covers the assistant's replies and end-of-turn markers only
    store = TokenStore(str(tmp_path / "b"))
    tokens, mask = store.read(0, store.num_tokens), store.take_mask(np.arange(store.num_tokens))
    tokenizer = load_tokenizer(tokenizer_dir)
    trained = tokenizer.decode(tokens[mask == 1])
    replies = ["the last one|\n" + ("filler number 3|\n" if i % 2 else "") for i in range(9)]
    assert trained.replace("<|im_end|>", "|") == "".join(replies)
    assert tokens[-1] == tokenizer.eos_id and mask[-1] == 0


def test_a_model_directory_gives_its_tokenizer_end_of_document_and_chat_template(tmp_path, tokenizer_dir):
    from jaxtron.data.tokenizers import load_tokenizer
    jsonl = _jsonl(tmp_path / "docs.jsonl", [{"text": "short"}])
    manifest = _prepare([jsonl], tmp_path / "a", tokenizer_dir)
    lone = tmp_path / "lone"
    lone.mkdir()
    shutil.copy(os.path.join(tokenizer_dir, "tokenizer.json"), lone)  # the same file without its configuration
    alone = _prepare([jsonl], tmp_path / "b", str(lone / "tokenizer.json"))
    tokenizer = load_tokenizer(tokenizer_dir)
    assert manifest["eos_id"] == tokenizer._tok.token_to_id("<|eot|>") != alone["eos_id"]
    assert alone["eos_id"] == tokenizer._tok.token_to_id("<|endoftext|>")
    assert manifest["tokenizer"]["path"] == os.path.join(tokenizer_dir, "tokenizer.json")
    chat = _prepare([_jsonl(tmp_path / "talk.jsonl", [{"messages": TALK[:2]}])], tmp_path / "c", tokenizer_dir,
                    "--chat")
    assert chat["chat_template"]["origin"] == os.path.join(tokenizer_dir, "tokenizer_config.json")


def _tree(root) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() if p.is_file() else b"" for p in Path(root).rglob("*")}


def test_bad_inputs_are_refused_in_one_sentence_and_nothing_is_written(tmp_path, tokenizer_dir, capsys):
    datasets = pytest.importorskip("datasets")
    bad = tmp_path / "bad"
    bad.mkdir()
    table = pa.table({"body": ["some text"] * 40, "n": list(range(40))})
    pq.write_table(table, bad / "good.parquet", row_group_size=10, write_page_checksum=True)
    data = (bad / "good.parquet").read_bytes()
    (bad / "noise.parquet").write_bytes(b"not parquet at all" * 10)
    (bad / "cut.parquet").write_bytes(data[:-40])  # the footer is gone
    middle = bytearray(data)
    for i in range(100, 130):  # inside the first row group's pages; the page checksums catch it
        middle[i] ^= 0xFF
    (bad / "flipped.parquet").write_bytes(bytes(middle))
    (bad / "table.csv").write_text("text\nhello\n")
    (bad / "docs.jsonl.lz4").write_bytes(b"\x04\x22\x4d\x18")
    (bad / "cut.jsonl.gz").write_bytes(gzip.compress(b'{"text": "hello"}\n' * 1000)[:-30])
    (bad / "card").mkdir()
    (bad / "card" / "README.md").write_text("# only a card\n")
    both = datasets.DatasetDict({"train": datasets.Dataset.from_list([{"text": "a"}]),
                                 "test": datasets.Dataset.from_list([{"text": "b"}])})
    both.save_to_disk(str(bad / "dict"))
    cases = [
        ([str(bad / "noise.parquet")], [], f"'{bad / 'noise.parquet'}' is not a readable Parquet file ("),
        ([str(bad / "cut.parquet")], [], f"'{bad / 'cut.parquet'}' is not a readable Parquet file ("),
        ([str(bad / "flipped.parquet")], ["--text-field", "body"], "is not a readable Parquet file ("),
        ([str(bad / "good.parquet")], [], (f"'{bad / 'good.parquet'}' has no column 'text' for --text-field; its "
                                           "columns are: body, n.")),
        ([str(bad / "good.parquet")], ["--text-field", "body.inner"], "column 'body' is string, not a struct"),
        ([str(bad / "good.parquet")], ["--text-field", "n"], "column 'n' holds int64, not text"),
        ([str(bad / "good.parquet")], ["--template", "{{ body }} {{ title }}"], "has no column 'title' for --template"),
        ([str(bad / "table.csv")], [], f"'{bad / 'table.csv'}' has an extension jaxtron does not read"),
        ([str(bad / "docs.jsonl.lz4")], [], "has compression '.lz4', which jaxtron does not read"),
        ([str(bad / "cut.jsonl.gz")], [], f"'{bad / 'cut.jsonl.gz'}' is not valid .gz data or is cut short"),
        ([str(bad / "nothing-*.parquet")], [], "matches no files jaxtron reads"),
        ([str(bad / "card")], [], f"--input '{bad / 'card'}' matches no files jaxtron reads"),
        ([str(bad / "dict")], [], "is a DatasetDict with splits train, test; pick one with --split."),
        ([], ["--dataset", "json", "--data-files", str(bad / "nothing.jsonl")], "cannot read local data"),
        ([], ["--dataset", "parquet", "--data-files", str(bad / "good.parquet")],
         "dataset 'parquet' has no column 'text'; its columns are: body, n."),
    ]
    capsys.readouterr()
    before = _tree(tmp_path)
    for inputs, extra, message in cases:
        args = [a for path in inputs for a in ("--input", path)]
        out = tmp_path / "out"
        assert cli.run("prepare", [*args, "--tokenizer", tokenizer_dir, "--output", str(out), *extra]) == 2, message
        err = capsys.readouterr().err
        lines = [line for line in err.splitlines() if line]
        assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err, err
        assert message in lines[0], (message, lines[0])
        assert _tree(tmp_path) == before, message  # no store, no half-written directory beside it


@pytest.mark.integration
@pytest.mark.slow
def test_a_prepare_killed_at_any_moment_leaves_no_store_and_runs_again(tmp_path, tokenizer_dir):
    import signal
    import subprocess
    import sys
    import time

    words = np.array(["alpha", "beta", "héllo", "wörld", "shard", "mesh", "token", "store", "\n"])
    rng = np.random.default_rng(0)
    texts = [" ".join(words[rng.integers(0, len(words), 400)]) for _ in range(12000)]
    pq.write_table(pa.table({"text": texts}), tmp_path / "web.parquet", row_group_size=1000)
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("JAX_")}, "JAX_PLATFORMS": "cpu"}
    command = [sys.executable, "-m", "jaxtron", "prepare", "--input", "web.parquet", "--tokenizer", tokenizer_dir,
               "--output"]
    started = time.perf_counter()
    subprocess.run([*command, "whole"], cwd=tmp_path, env=env, check=True, capture_output=True, timeout=300)
    whole = time.perf_counter() - started
    expected = _digest(_manifest(tmp_path / "whole"))
    for share in (0.2, 0.5, 0.8, 0.95):
        out = tmp_path / f"killed{share}"
        proc = subprocess.Popen([*command, out.name], cwd=tmp_path, env=env, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
        time.sleep(share * whole)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
        if out.exists():  # it finished before the kill: then the store is whole
            assert _digest(_manifest(out)) == expected
            TokenStore(str(out), verify=True)
            continue
        done = subprocess.run([*command, out.name], cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=300, check=False)
        assert done.returncode == 0, done.stderr
        assert _digest(_manifest(out)) == expected
        TokenStore(str(out), verify=True)
    assert not [name for name in os.listdir(tmp_path) if ".tmp-" in name]  # the reruns removed the killed ones' parts
