"""docs/layout.md is the map of the package: every module of jaxtron/ is on it, and the path it names from
`python train.py` to the compiled step is the one the code takes."""

import ast
import inspect
import os
import re

from conftest import REPO

PACKAGE = os.path.join(REPO, "jaxtron")


def _map_block() -> list[str]:
    with open(os.path.join(REPO, "docs", "layout.md")) as f:
        text = f.read()
    start = text.index("```\ntrain.py")
    return text[start + 4:text.index("```", start + 4)].splitlines()


def mapped_modules() -> set[str]:
    """The modules the map names, as paths under jaxtron/: a package at column 2, its files at column 16."""
    found, package = set(), None
    for line in _map_block():
        if line.startswith("jaxtron/"):
            package = ""
            continue
        if package is None or not line.startswith("  "):
            continue
        head = re.match(r"^  (\w[\w/]*/)(\s|$)", line)
        if head:
            package, column = head[1], line[16:]
        elif re.match(r"^  \w+\.py\s", line):
            package, column = "", line[2:]
        else:
            column = line[16:] if line[16:17] != " " else ""
        first = re.split(r"\s{2,}", column.strip())[0] if column.strip() else ""
        found.update(package + name for name in re.findall(r"[\w/]+\.py", first))
    return found


def package_modules() -> set[str]:
    out = set()
    for folder, _, files in os.walk(PACKAGE):
        for name in files:
            if name.endswith(".py") and (name != "__init__.py" or folder == PACKAGE):
                out.add(os.path.relpath(os.path.join(folder, name), PACKAGE))
    return out


def test_every_module_is_on_the_map_and_the_map_names_no_module_that_is_gone():
    mapped, present = mapped_modules(), package_modules()
    assert not present - mapped, f"modules missing from docs/layout.md: {sorted(present - mapped)}"
    gone = {m for m in mapped - present if not m.endswith("__init__.py")}
    assert not gone, f"docs/layout.md names modules that do not exist: {sorted(gone)}"


def test_the_map_check_fails_for_a_module_left_out(monkeypatch):
    block = [line for line in _map_block() if "workdir_lock.py" not in line]
    monkeypatch.setattr(__import__(__name__), "_map_block", lambda: block)
    assert "training/workdir_lock.py" in package_modules() - mapped_modules()


def test_the_path_from_train_py_to_the_compiled_step_is_the_six_functions_of_the_map():
    from jaxtron import api, cli
    from jaxtron.training import loop, step

    with open(os.path.join(REPO, "train.py")) as f:
        assert 'run("train", argv)' in f.read()
    assert cli.COMMANDS["train"].target == "jaxtron.cli:train"
    assert "getattr(importlib.import_module(module), function)(args)" in inspect.getsource(cli.run)
    assert "api.train(cfg, workdir)" in inspect.getsource(cli.train)
    assert "Trainer(cfg, workdir," in inspect.getsource(api.train) and ".run()" in inspect.getsource(api.train)
    assert "compile_train_step(" in inspect.getsource(loop.Trainer.run)
    assert "partial(train_step," in inspect.getsource(step.compile_train_step)
    with open(os.path.join(REPO, "docs", "layout.md")) as f:
        text = f.read()
    listed = re.findall(r"^\d\. `([\w.]+)`", text[text.index("## From `python train.py`"):], re.MULTILINE)
    assert listed == ["jaxtron.cli.run", "jaxtron.cli.train", "jaxtron.api.train", "jaxtron.training.loop.Trainer.run",
                      "jaxtron.training.step.compile_train_step", "jaxtron.training.step.train_step"]


def _defined_names(path: str) -> set[str]:
    """The names a module defines: functions, classes, arguments, assigned names and attributes, its own name."""
    with open(path) as f:
        tree = ast.parse(f.read())
    out = {os.path.splitext(os.path.basename(path))[0]}
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(node.name)
        elif isinstance(node, ast.arg):
            out.add(node.arg)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            out.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            out.add(node.attr)
    return out


def test_every_name_with_a_crowded_word_is_on_the_word_list():
    """A name holding 'constrain' or 'group' means what docs/layout.md's word list says; a new one is added there
    with its meaning, or renamed."""
    with open(os.path.join(REPO, "docs", "layout.md")) as f:
        text = f.read()
    words = text[text.index("## Words with one meaning"):]
    listed = set(re.findall(r"`(?:\w+\.)?(\w+)", words))
    defined = {}
    for folder, _, files in os.walk(PACKAGE):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                for n in _defined_names(path):
                    if "constrain" in n.lower() or "group" in n.lower():
                        defined.setdefault(n, os.path.relpath(path, REPO))
    missing = {n: where for n, where in defined.items() if n not in listed}
    assert not missing, f"names not on docs/layout.md's word list: {missing}"
    assert {"constrain", "constrain_variables", "replica_axes"} <= listed
