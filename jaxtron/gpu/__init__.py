"""The GPU environment: the preset of environment variables and XLA flags (``preset.py``), each with its reason."""
