"""Built-in offline corpora, prepared into a token store on first use.

``stdlib``: the standard library's Python source as byte tokens, for pretraining. ``stdlib-chat``: conversations
made from the same source for supervised fine-tuning: a user asks what a documented public function does, and the
assistant answers with its signature in backticks and the first sentence of its docstring, rendered with the plain
byte-level chat template (jaxtron.data.chat.PLAIN_TEMPLATE). ``stdlib-pairs``: preference pairs for DPO from the
same questions: the chosen answer is the function's own, the rejected one the same answer with two words of its
sentence swapped, in the same template.
"""

from __future__ import annotations

import ast
import json
import logging
import os
import sysconfig
import tempfile

import numpy as np

from jaxtron.config.schema import BUILTIN_CORPORA as BUILTIN
from jaxtron.data.errors import DataError
from jaxtron.data.store import MANIFEST

log = logging.getLogger(__name__)


def stdlib_files(root: str | None = None) -> list[str]:
    """Sorted UTF-8 .py files of the Python standard library, without tests and installed packages."""
    root = root or sysconfig.get_paths()["stdlib"]
    found = []
    for directory, subdirs, names in os.walk(root):
        subdirs[:] = sorted(d for d in subdirs if d not in ("site-packages", "dist-packages", "test", "tests",
                                                            "idlelib", "__pycache__"))
        for name in names:
            path = os.path.join(directory, name)
            if name.endswith(".py") and _is_utf8(path):
                found.append(path)
    return sorted(found)


def _is_utf8(path: str) -> bool:
    try:
        with open(path, "rb") as f:
            f.read().decode("utf-8")
        return True
    except (UnicodeDecodeError, OSError):
        return False




def function_questions(path: str, module: str) -> list[dict]:
    """Conversations about the documented public top-level functions of one source file."""
    with open(path, encoding="utf-8") as f:
        try:
            tree = ast.parse(f.read())
        except (SyntaxError, ValueError):
            return []
    found = []
    for node in tree.body:
        if not isinstance(node, ast.FunctionDef) or node.name.startswith("_"):
            continue
        doc = ast.get_docstring(node) or ""
        summary = " ".join(doc.strip().split("\n\n")[0].split())
        summary = summary.split(". ")[0].rstrip(".") + "."  # the first sentence
        if not 10 <= len(summary) <= 100:
            continue
        name = f"{module}.{node.name}"
        found.append({"messages": [
            {"role": "user", "content": f"What does {name} do?"},
            {"role": "assistant", "content": f"`{name}({ast.unparse(node.args)})`: {summary}"}]})
    return found


def stdlib_conversations(root: str | None = None) -> list[dict]:
    """The ``stdlib-chat`` conversations, in the sorted order of the standard library's files."""
    root = root or sysconfig.get_paths()["stdlib"]
    conversations = []
    for path in stdlib_files(root):
        parts = os.path.relpath(path, root)[:-3].split(os.sep)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        if parts and not any(p.startswith("_") for p in parts):
            conversations += function_questions(path, ".".join(parts))
    return conversations


def stdlib_pairs(root: str | None = None) -> list[dict]:
    """The ``stdlib-pairs`` records: each question with its function's answer chosen and, rejected, the same answer
    with two neighbouring words of its sentence swapped (the middle ones). Each rejected text is its own pair's
    chosen one made ungrammatical, never another pair's answer, so held-out pairs cannot be won by remembering
    the training pairs' texts; sentences of fewer than four words are left out."""
    pairs = []
    for conversation in stdlib_conversations(root):
        question, answer = (m["content"] for m in conversation["messages"])
        signature, sentence = answer.split("`: ", 1)
        words = sentence.split(" ")
        middle = len(words) // 2
        if len(words) >= 4 and words[middle - 1] != words[middle]:
            words[middle - 1], words[middle] = words[middle], words[middle - 1]
            pairs.append({"prompt": question, "chosen": answer, "rejected": f"{signature}`: {' '.join(words)}"})
    return pairs


def _prepare_records(name: str, path: str, records: list[dict], **options) -> None:
    """``records`` written as JSON lines and prepared with the plain template into ``path``."""
    from jaxtron.data.chat import PLAIN_TEMPLATE, ChatTemplate
    from jaxtron.data.prepare import prepare
    with tempfile.TemporaryDirectory() as tmp:
        jsonl = os.path.join(tmp, f"{name}.jsonl")
        with open(jsonl, "w", encoding="utf-8") as f:
            f.writelines(json.dumps(r) + "\n" for r in records)
        prepare([jsonl], "byte", path, chat=ChatTemplate(PLAIN_TEMPLATE, origin="jaxtron's plain template"), **options)


def ensure_builtin(name: str, path: str) -> None:
    """Prepares built-in corpus ``name`` into ``path`` unless a complete store is already there."""
    if os.path.isfile(os.path.join(path, MANIFEST)):
        return
    if name not in BUILTIN:
        raise DataError(f"built-in corpus '{name}' does not exist; use data.prepare={' or '.join(map(repr, BUILTIN))} "
                        "or ''.")
    if os.path.isdir(path) and os.listdir(path) or os.path.isfile(path):
        raise DataError(f"data.path '{path}' exists but holds no token store; point data.path at an empty or "
                        "missing directory for data.prepare, or remove it.")
    try:
        _prepare_builtin(name, path)
    except DataError:
        if not os.path.isfile(os.path.join(path, MANIFEST)):
            raise
        log.info("another process prepared %s into %s meanwhile; using it", name, path)


def _prepare_builtin(name: str, path: str) -> None:
    from jaxtron.data.prepare import prepare
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    if name.startswith("arithmetic-"):
        from jaxtron.data import arithmetic
        records = arithmetic.conversations() if name == "arithmetic-chat" else arithmetic.prompts()
        log.info("preparing %d sums as %s into %s (once)", len(records), name.split("-")[1], path)
        _prepare_records(name, path, records, kind="" if name == "arithmetic-chat" else "prompts")
        return
    if name in ("stdlib-chat", "stdlib-pairs"):
        records = stdlib_conversations() if name == "stdlib-chat" else stdlib_pairs()
        log.info("preparing %d %s about the standard library's functions into %s (once)", len(records),
                 "conversations" if name == "stdlib-chat" else "preference pairs", path)
        _prepare_records(name, path, records, kind="pairs" if name == "stdlib-pairs" else "")
        return
    files = stdlib_files()
    if not files:
        raise DataError("no Python source files were found in the standard library; use "
                        "--config.data.source=synthetic on this machine.")
    log.info("preparing the standard library's %d source files as byte tokens into %s (once)", len(files), path)
    prepare(files, "byte", path, text_suffixes=(".py",))  # each source file is one plain-text document


def unigram_entropy(tokens: np.ndarray | list[np.ndarray], vocab_size: int) -> float:
    """Entropy in nats of the token frequency distribution (of one array or several together): the loss of
    the best context-free model."""
    counts = np.zeros(vocab_size, np.float64)
    for part in tokens if isinstance(tokens, list) else [tokens]:
        for i in range(0, part.size, 1 << 22):  # bincount widens to int64: chunks keep that copy small
            counts += np.bincount(part[i:i + (1 << 22)], minlength=vocab_size)
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())
