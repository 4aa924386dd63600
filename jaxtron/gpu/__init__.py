"""The GPU environment: the preset of environment variables and XLA flags (``preset.py``), each with its reason, and
the compile-only H100/H200 target (``target.py``) that XLA compiles for without a GPU."""
