"""The package's imports: no circle between modules, and none running back up the layers of docs/layout.md.

Every ``import`` statement counts, the ones inside functions too (a lazy import is still a dependency), except those
under ``if __name__ == "__main__":``: that block runs only when the module is the program (``python -m ...``), so it
is an entry point above the whole package, as the `jaxtron` command is, not a dependency of the module.
"""

from __future__ import annotations

import ast
import os

from conftest import REPO

PACKAGE = os.path.join(REPO, "jaxtron")

# The data flow as layers of subpackages, lowest first: a subpackage imports from its own layer's members only
# itself, and otherwise only lower layers. The modules at the package top (the command line) come last.
LAYERS = (
    ("common",),
    ("config",),
    ("gpu", "parallel", "families"),
    ("ops", "data", "checkpoint", "metrics"),
    ("models",),
    ("training",),
    ("interop", "planning"),
    ("inference",),
)


def modules() -> dict[str, str]:
    """Dotted module name -> file, for every module of the package."""
    found = {}
    for folder, _, files in os.walk(PACKAGE):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                dotted = os.path.relpath(path[:-3], REPO).replace(os.sep, ".")
                found[dotted.removesuffix(".__init__")] = path
    return found


def is_main_guard(node: ast.stmt) -> bool:
    """Whether ``node`` is ``if __name__ == "__main__":``."""
    return (isinstance(node, ast.If) and isinstance(node.test, ast.Compare) and isinstance(node.test.left, ast.Name)
            and node.test.left.id == "__name__" and isinstance(node.test.comparators[0], ast.Constant)
            and node.test.comparators[0].value == "__main__")


def library_nodes(tree: ast.Module):
    """Every node of a module but those of its ``if __name__ == "__main__":`` blocks."""
    for statement in tree.body:
        if not is_main_guard(statement):
            yield from ast.walk(statement)


def import_graph() -> dict[str, set[str]]:
    """Module -> the package's modules it imports (``from a import b`` counts a.b when b is a module, else a)."""
    found = modules()
    graph = {}
    for module, path in found.items():
        package = module if path.endswith("__init__.py") else module.rpartition(".")[0]
        targets = set()
        with open(path) as f:
            tree = ast.parse(f.read(), path)
        for node in library_nodes(tree):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")
                    base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
                names = [f"{base}.{a.name}" for a in node.names]
            else:
                continue
            for name in names:  # each to the most specific module it names or belongs to
                while name and name not in found:
                    name = name.rpartition(".")[0]
                if name:
                    targets.add(name)
        graph[module] = targets - {module}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iteratively)."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []
    for root, targets in graph.items():
        if root in index:
            continue
        work = [(root, iter(sorted(targets)))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    out.append(sorted(component))
    return out


def layer(module: str) -> int:
    """The layer of a module's subpackage; the package top (the command line) is above them all."""
    parts = module.split(".")
    if len(parts) > 2 or (len(parts) == 2 and os.path.isdir(os.path.join(PACKAGE, parts[1]))):
        for i, members in enumerate(LAYERS):
            if parts[1] in members:
                return i
        raise AssertionError(f"subpackage jaxtron.{parts[1]} has no layer in tests/test_imports.py: add it")
    return len(LAYERS)


def test_the_graph_finds_imports_of_every_form_and_a_circle():
    graph = import_graph()
    assert "jaxtron.ops.sequence" in graph["jaxtron.ops.blockwise"]  # from jaxtron.ops.sequence import ...
    assert "jaxtron.ops.cudnn" in graph["jaxtron.ops.attention"]  # from jaxtron.ops import cudnn
    assert "jaxtron.config.schema" in graph["jaxtron.training.loop"]
    assert "jaxtron.data.errors" in graph["jaxtron.data.store"] and "jaxtron.cli" not in graph["jaxtron.data.store"]
    guards = ast.parse('if __name__ == "__main__":\n    pass\nif x == "__main__":\n    pass').body
    assert [is_main_guard(n) for n in guards] == [True, False]
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_one_front_door():
    """The package's entry points are `jaxtron <command>` (jaxtron/cli.py) and `python -m jaxtron` only: no other
    module at the package top, and no other ``if __name__ == "__main__":`` block under jaxtron/."""
    top = sorted(m for m, path in modules().items() if m.count(".") == 1 and not path.endswith("__init__.py"))
    assert top == ["jaxtron.__main__", "jaxtron.api", "jaxtron.cli"]
    guarded = []
    for module, path in modules().items():
        with open(path) as f:
            if any(is_main_guard(n) for n in ast.parse(f.read(), path).body):
                guarded.append(module)
    assert guarded == ["jaxtron.__main__"]


def test_values_set_while_tracing_are_one_kind_in_one_module():
    """Every value a ``with`` block sets for tracing is a ``TraceState`` of jaxtron/common/trace_state.py (its
    docstring lists them, with who sets and who reads each): no other module holds a context variable."""
    from jaxtron.common import trace_state

    users = sorted(m for m in import_graph_of_stdlib("contextvars"))
    assert users == ["jaxtron.common.trace_state"]
    states = [n for n, v in vars(trace_state).items() if isinstance(v, trace_state.TraceState)]
    assert states and all(f"``{n}``" in trace_state.__doc__ for n in states)


def import_graph_of_stdlib(name: str) -> list[str]:
    """The package's modules that import the standard library's module ``name``."""
    found = []
    for module, path in modules().items():
        with open(path) as f:
            tree = ast.parse(f.read(), path)
        for node in ast.walk(tree):
            if (isinstance(node, ast.Import) and any(a.name == name for a in node.names)) or \
                    (isinstance(node, ast.ImportFrom) and node.module == name):
                found.append(module)
                break
    return found


MAX_FILE_LINES, MAX_FUNCTION_LINES = 400, 80


def test_no_file_or_function_outgrows_a_reading():
    """No module of the package over 400 lines, no function over 80: past that a newcomer reads a file in parts."""
    long_files, long_functions = [], []
    for module, path in modules().items():
        with open(path) as f:
            text = f.read()
        if text.count("\n") > MAX_FILE_LINES:
            long_files.append(module)
        for node in ast.walk(ast.parse(text, path)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and \
                    node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES:
                long_functions.append(f"{module}.{node.name}")
    assert long_files == [] and long_functions == []


def test_no_module_imports_itself_back_through_others():
    assert circles(import_graph()) == []


def test_no_import_runs_back_up_the_data_flow():
    graph = import_graph()
    upward = []
    for module, targets in sorted(graph.items()):
        for target in sorted(targets):
            same_package = module.split(".")[:2] == target.split(".")[:2]
            # the package top is one layer: its modules (the command line, the Python API) may import each other
            same_package |= layer(module) == layer(target) == len(LAYERS)
            if not same_package and layer(target) >= layer(module):
                upward.append(f"{module} -> {target}")
    assert upward == []


def test_the_layout_page_lists_these_layers():
    """docs/layout.md's table of layers is the one this file checks the imports against."""
    import re
    from pathlib import Path

    page = Path(os.path.dirname(PACKAGE), "docs", "layout.md").read_text()
    rows = re.findall(r"^\| (\d+) \| (`.*`) \|$", page, flags=re.MULTILINE)
    assert [tuple(re.findall(r"`(\w+)`", packages)) for _, packages in rows] == [tuple(m) for m in LAYERS]
