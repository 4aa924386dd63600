"""Step time -> tokens/s, TFLOP/s per device, MFU and HFU, with the accounting stated in flops.py."""

from __future__ import annotations

from typing import Any

from jaxtron.config import Config
from jaxtron.metrics import flops as flops_lib
from jaxtron.metrics import hardware


class Throughput:
    """Turns a wall-clock interval of steps into step time, tokens/s, TFLOP/s per device and MFU/HFU."""

    def __init__(self, cfg: Config, num_devices: int, device_kind: str):
        tokens = cfg.train.global_batch_size * cfg.data.seq_len
        self.tokens_per_step = tokens
        self.model_flops = flops_lib.flops_per_token(cfg.model, cfg.data.seq_len) * tokens
        self.hardware_flops = flops_lib.hardware_flops_per_token(cfg.model, cfg.data.seq_len) * tokens
        self.num_devices = num_devices
        self.peak, self.peak_note = hardware.peak_flops(device_kind, cfg.model.dtype)

    def __call__(self, seconds: float, steps: int) -> dict[str, Any]:
        step_time = seconds / steps
        per_device = self.model_flops / step_time / self.num_devices
        return {"step_time_s": step_time, "tokens_per_sec": self.tokens_per_step / step_time,
                "tflops_per_device": per_device / 1e12, "mfu": hardware.mfu(per_device, self.peak),
                "hfu": hardware.mfu(self.hardware_flops / step_time / self.num_devices, self.peak)}
