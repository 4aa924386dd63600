"""The test suite's own arrangement: what keeps it within its time budget on 2 cores."""

import ast
import glob
import os
import re
from pathlib import Path

import pytest


@pytest.fixture(scope="module")
def shared_run():
    return object()  # stands for a training run that several tests read


def test_tests_sharing_a_run_are_sent_to_one_worker(shared_run, request):
    """Under pytest-xdist's --dist loadgroup (setup.cfg), a test that reads a test module's shared fixture carries the
    group tests/conftest.py gave it in its id, which is what sends the group to one worker. With a pytest that
    pytest-xdist cannot rename tests under (9.2 with xdist 3.8), the groups split silently and every worker computes
    the shared runs again."""
    if not getattr(request.config.option, "loadgroup", False):
        pytest.skip("the suite runs without pytest-xdist's --dist loadgroup")
    assert request.node.nodeid.endswith("@test_suite.shared_run"), request.node.nodeid


# what starts another process in a test's own code (helpers that do so are named here too)
STARTS_A_PROCESS = re.compile(r"\bsubprocess\.|\bPopen\(|\blearning_run\(|\bon_target_in_subprocess\(|\binject\(|"
                              r"\bsignal\.SIG")


def _marked(decorators, name: str) -> bool:
    return any(name in ast.unparse(d) for d in decorators)


def test_every_test_that_starts_a_process_is_in_the_integration_tier():
    """The README's test command leaves out `-m integration`: the tests that cross a process boundary, which .ci/run
    runs after it. A test that starts a process without the mark would slip into the README's tier unnoticed; one
    that belongs there says so (``first_tier``)."""
    unmarked = []
    for path in sorted(glob.glob(os.path.join(os.path.dirname(__file__), "test_*.py"))):
        source = Path(path).read_text()
        tree = ast.parse(source)
        whole_module = any(isinstance(n, ast.Assign) and any(getattr(t, "id", "") == "pytestmark" for t in n.targets)
                           and "integration" in ast.unparse(n.value) for n in tree.body)
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and node.name.startswith("test_") and not whole_module \
                    and STARTS_A_PROCESS.search(ast.get_source_segment(source, node)) \
                    and not _marked(node.decorator_list, "integration") \
                    and not _marked(node.decorator_list, "first_tier"):
                unmarked.append(f"{os.path.basename(path)}::{node.name}")
    assert unmarked == []


def test_the_readme_runs_the_first_tier_and_ci_both():
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    readme, ci = Path(repo, "README.md").read_text(), Path(repo, ".ci", "run").read_text()
    first = 'python -m pytest -q -m "not integration and not extended"'
    assert f'python -m pip install -e ".[test]" && {first}' in readme and first in ci
    assert 'python -m pytest -q -m "integration or extended"' in ci


def test_an_unmarked_test_that_grew_slow_fails_and_a_marked_one_passes():
    from types import SimpleNamespace

    import conftest

    def report_of(duration: float, marked: bool):
        report = SimpleNamespace(when="call", passed=True, duration=duration, outcome="passed", longrepr=None)
        item = SimpleNamespace(nodeid="tests/test_x.py::test_y",
                               get_closest_marker=lambda name: object() if marked and name == "slow" else None)
        hook = conftest.pytest_runtest_makereport(item, None)
        next(hook)
        with pytest.raises(StopIteration):
            hook.send(SimpleNamespace(get_result=lambda: report))
        return report

    assert report_of(conftest.UNMARKED_LIMIT_S + 1, marked=False).outcome == "failed"
    assert "without @pytest.mark.slow" in report_of(conftest.UNMARKED_LIMIT_S + 1, marked=False).longrepr
    assert report_of(conftest.UNMARKED_LIMIT_S + 1, marked=True).outcome == "passed"
    assert report_of(1.0, marked=False).outcome == "passed"
