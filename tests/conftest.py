"""Tests run on the CPU with 8 fake devices; this must happen before jax is imported anywhere."""

import ast
import functools
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

# XLA:CPU spends most of a test's time compiling, and the test programs are tiny: LLVM's optimisation passes cost
# more than they save (half the suite's CPU time), and XLA:CPU's fusion emitters compile a small train step in
# three times the time of the loop emitters (4.5 s against 1.6 s; tests/test_training.py 168 -> 87 CPU seconds).
# Every test process, subprocesses included, compiles this way; a flag the installed jaxlib does not know (it would
# abort the process) is left out, found once per test session by starting jax in a subprocess.
_COMPILE_FLAGS = ("--xla_backend_optimization_level=0", "--xla_llvm_disable_expensive_passes=true",
                  "--xla_cpu_use_fusion_emitters=false")


def _known_compile_flags() -> str:
    known = os.environ.get("JAXTRON_TEST_COMPILE_FLAGS")
    if known is None:
        from jaxtron.gpu.preset import unknown_flags  # imports no jax
        unknown = set(unknown_flags(" ".join(_COMPILE_FLAGS)))
        known = os.environ["JAXTRON_TEST_COMPILE_FLAGS"] = " ".join(f for f in _COMPILE_FLAGS if f not in unknown)
    return known


FAST_COMPILE_FLAGS = _known_compile_flags()


def cpu_xla_flags(devices: int = 8) -> str:
    """XLA_FLAGS for a test process with `devices` fake CPU devices."""
    return f"{FAST_COMPILE_FLAGS} --xla_force_host_platform_device_count={devices}"


os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + cpu_xla_flags()).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import pytest
from absl import flags

jax.config.update("jax_default_matmul_precision", "highest")
flags.FLAGS(["pytest"])  # the test process is the program: libraries' absl flags (grain's) take their defaults


def pytest_runtest_logreport(report):
    """With JAXTRON_TESTS_FAILURES_AT_ONCE=1 (set by .ci/run) a failure is printed the moment it happens, so that a
    later crash of the whole pytest process cannot take its explanation with it."""
    if report.failed and os.environ.get("JAXTRON_TESTS_FAILURES_AT_ONCE") == "1":
        os.write(2, f"\nFAILED {report.nodeid} ({report.when})\n{report.longreprtext[-6000:]}\n".encode())


UNMARKED_LIMIT_S = 30.0  # 6x the `slow` mark's 5 s: a test past it without the mark fails, whatever the machine


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Keeps an unmarked test from growing slow unnoticed: `-m "not slow"` is the quick loop (about a minute), so a
    test taking UNMARKED_LIMIT_S or more without `@pytest.mark.slow` fails, naming the mark to add."""
    outcome = yield
    report = outcome.get_result()
    if (report.when == "call" and report.passed and report.duration >= UNMARKED_LIMIT_S
            and item.get_closest_marker("slow") is None):
        report.outcome = "failed"
        report.longrepr = (f"{item.nodeid} took {report.duration:.0f} s without @pytest.mark.slow (the mark of tests "
                           "of 5 s or more); add the mark, or make the test quicker.")


@functools.cache
def shared_fixtures(path: str) -> frozenset[str]:
    """The module- and session-scoped fixtures a test module defines, read from its source (pytest keeps its own
    record of a test's fixtures private)."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), path)
    found = set()
    for node in tree.body:
        if not isinstance(node, ast.FunctionDef):
            continue
        for decorator in node.decorator_list:
            if not (isinstance(decorator, ast.Call) and ast.unparse(decorator.func) in ("pytest.fixture", "fixture")):
                continue
            options = {k.arg: k.value.value for k in decorator.keywords if isinstance(k.value, ast.Constant)}
            if options.get("scope") in ("module", "session"):
                found.add(options.get("name", node.name))
    return frozenset(found)


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the groups
def pytest_collection_modifyitems(items):
    """Tests that share a module- or session-scoped fixture of a test module (a whole training run, a converted
    model) go to one xdist worker, which computes the fixture once; spread over two workers, each would compute it.
    The costly ones are session-scoped: a module fixture is set up again whenever the worker runs another module's
    test between two of its own. (tests/test_suite.py checks that the groups hold.)"""
    for item in items:
        if item.get_closest_marker("xdist_group"):
            continue
        own = shared_fixtures(str(item.path)) if item.path.name.startswith("test_") else frozenset()
        shared = sorted(name for name in getattr(item, "fixturenames", ()) if name in own)
        if shared:
            item.add_marker(pytest.mark.xdist_group(f"{item.module.__name__}.{shared[0]}"))
