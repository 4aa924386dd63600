"""Hugging Face interoperation: the safetensors format, per-family mappings, conversion and scoring."""
