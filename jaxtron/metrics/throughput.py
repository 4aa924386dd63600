"""Step time -> tokens/s, TFLOP/s per device, MFU and HFU, with the accounting stated in flops.py.

With ``execution.fp8`` the denominator is the FLOP-weighted dense peak (``hardware.flop_weighted_peak``): the FP8
matmuls at the fp8 peak, every other FLOP at the peak of ``execution.dtype``.
"""

from __future__ import annotations

from typing import Any

from jaxtron.config.schema import Config
from jaxtron.metrics import flops as flops_lib
from jaxtron.metrics import hardware


class Throughput:
    """Turns a wall-clock interval of steps into step time, tokens/s, TFLOP/s per device and MFU/HFU.

    ``attention``: the attention implementation the step runs ('xla' or 'cudnn'; it decides what the remat
    policy recomputes).
    """

    def __init__(self, cfg: Config, num_devices: int, device_kind: str, attention: str):
        m, execution, seq = cfg.model, cfg.execution, cfg.data.seq_len
        tokens = cfg.train.global_batch_size * seq
        self.tokens_per_step = tokens
        self.num_devices = num_devices
        self.model_flops = flops_lib.flops_per_token(m, seq) * tokens
        self.hardware_flops = flops_lib.hardware_flops_per_token(m, execution, seq, attention=attention) * tokens
        fp8 = flops_lib.fp8_flops_per_token(m, execution, seq) * tokens
        fp8_hardware = flops_lib.fp8_flops_per_token(m, execution, seq, hardware=True, attention=attention) * tokens
        self.fp8_share = fp8 / self.model_flops  # of the model FLOPs
        low = "fp4" if execution.fp8_recipe == "nvfp4" else "fp8"  # NVFP4's GEMMs against the FP4 peak
        self.peak, note = hardware.flop_weighted_peak(device_kind, execution.dtype, fp8, self.model_flops, low)
        self.hardware_peak, _ = hardware.flop_weighted_peak(device_kind, execution.dtype, fp8_hardware,
                                                            self.hardware_flops, low)
        self.peak_note = f"MFU against the {note}" if self.peak is not None else note

    def __call__(self, seconds: float, steps: int) -> dict[str, Any]:
        step_time = seconds / steps
        per_device = self.model_flops / step_time / self.num_devices
        return {"step_time_s": step_time, "tokens_per_sec": self.tokens_per_step / step_time,
                "tflops_per_device": per_device / 1e12, "mfu": hardware.mfu(per_device, self.peak),
                "hfu": hardware.mfu(self.hardware_flops / step_time / self.num_devices, self.hardware_peak)}
