"""Tests run on the CPU with 8 fake devices; this must happen before jax is imported anywhere."""

import os
import sys

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
