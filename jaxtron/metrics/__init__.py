"""FLOP counting, hardware peaks and MFU, and metric sinks (JSONL, TensorBoard, console)."""
