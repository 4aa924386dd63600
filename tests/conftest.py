"""Tests run on the CPU with 8 fake devices; this must happen before jax is imported anywhere."""

import os
import sys

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def pytest_runtest_logreport(report):
    """With JAXTRON_TESTS_FAILURES_AT_ONCE=1 (set by .ci/run) a failure is printed the moment it happens, so that a
    later crash of the whole pytest process cannot take its explanation with it."""
    if report.failed and os.environ.get("JAXTRON_TESTS_FAILURES_AT_ONCE") == "1":
        os.write(2, f"\nFAILED {report.nodeid} ({report.when})\n{report.longreprtext[-6000:]}\n".encode())
