"""MXFP4 (gpt-oss's published expert weights): the dequantizer against one written from the OCP MX specification
bit by bit, and a whole MXFP4 checkpoint imported to exactly the parameters of its dequantized twin."""

import json
import os

import numpy as np
import pytest
from conftest import REPO

from jaxtron.families import mxfp4
from jaxtron.interop import convert
from jaxtron.interop.hf import safetensors as st


def _spec_value(code: int, scale: int) -> float:
    """One element from the OCP Microscaling Formats (MX) v1.0 spec: E2M1 is 1 sign, 2 exponent (bias 1) and 1
    mantissa bit, subnormal at exponent 0; E8M0 is an unsigned exponent of bias 127."""
    sign = -1.0 if code & 0b1000 else 1.0
    exponent, mantissa = (code >> 1) & 0b11, code & 0b1
    magnitude = mantissa * 0.5 if exponent == 0 else 2.0 ** (exponent - 1) * (1.0 + mantissa / 2)
    return sign * magnitude * 2.0 ** (scale - 127)


def _reference(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    out = np.zeros((*blocks.shape[:-2], blocks.shape[-2] * 32), np.float64)
    for index in np.ndindex(*blocks.shape[:-1]):
        for byte in range(16):
            for half, code in enumerate((blocks[index][byte] & 0xF, blocks[index][byte] >> 4)):  # low nibble first
                out[(*index[:-1], index[-1] * 32 + 2 * byte + half)] = _spec_value(int(code), int(scales[index]))
    return out


def test_dequantize_equals_the_specification_bit_by_bit():
    rng = np.random.default_rng(0)
    blocks = rng.integers(0, 256, size=(3, 5, 2, 16), dtype=np.uint8)
    scales = rng.integers(100, 150, size=(3, 5, 2), dtype=np.uint8)
    got = mxfp4.dequantize(blocks, scales)
    assert got.dtype == np.float32 and got.shape == (3, 5, 64)
    np.testing.assert_array_equal(got, _reference(blocks, scales))
    assert set(np.unique(np.abs(got[0, 0, :32]) / 2.0 ** (int(scales[0, 0, 0]) - 127))) <= set(np.abs(mxfp4.E2M1))
    with pytest.raises(ValueError, match="do not pair up"):
        mxfp4.dequantize(blocks, scales[..., :1])


def _write(directory, config, tensors):
    os.makedirs(directory)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config, f)
    st.write(os.path.join(directory, st.SINGLE), [(n, v.shape, v.dtype) for n, v in tensors.items()],
             tensors.__getitem__)


@pytest.mark.slow
def test_an_mxfp4_checkpoint_imports_to_the_parameters_of_its_dequantized_twin(tmp_path):
    """gpt-oss with expert widths of 32 (one block): the MXFP4 checkpoint's experts dequantized on import, and every
    parameter equal to the import of the same model written plainly (dequantized by the reference)."""
    with open(os.path.join(REPO, "tests", "fixtures", "hf", "gpt_oss", "config.json")) as f:
        config = {**json.load(f), "intermediate_size": 32}
    e, d, f, layers = config["num_local_experts"], config["hidden_size"], 32, config["num_hidden_layers"]
    rng = np.random.default_rng(1)
    plain, quantized = {}, {}
    fixture = st.ModelFiles(os.path.join(REPO, "tests", "fixtures", "hf", "gpt_oss"))
    for name in fixture.names():
        if ".experts." not in name or name.endswith("_bias"):
            value = fixture.read(name)
            if name.endswith("gate_up_proj_bias"):
                value = rng.normal(size=(e, 2 * f)).astype(np.float32)
            plain[name] = quantized[name] = value
    for i in range(layers):
        for matrix, rows, cols in (("gate_up_proj", 2 * f, d), ("down_proj", d, f)):
            name = f"model.layers.{i}.mlp.experts.{matrix}"
            blocks = rng.integers(0, 256, size=(e, rows, cols // 32, 16), dtype=np.uint8)
            scales = rng.integers(120, 130, size=(e, rows, cols // 32), dtype=np.uint8)
            quantized[name + "_blocks"], quantized[name + "_scales"] = blocks, scales
            plain[name] = np.swapaxes(_reference(blocks, scales), 1, 2).astype(np.float32)  # [E, in, out]
    _write(tmp_path / "plain", config, plain)
    _write(tmp_path / "mxfp4", {**config, "quantization_config": {"quant_method": "mxfp4"}}, quantized)
    for name in ("plain", "mxfp4"):
        convert.from_hf(str(tmp_path / name), str(tmp_path / f"{name}_out"))
    a, b = (convert.load(str(tmp_path / f"{name}_out"))[1] for name in ("plain", "mxfp4"))
    assert sorted(a) == sorted(b) and "moe_layers.mlp.wi_gate" in a
    for key in a:
        np.testing.assert_array_equal(np.asarray(a[key]), np.asarray(b[key]), err_msg=key)
    gate_up = plain["model.layers.1.mlp.experts.gate_up_proj"]
    np.testing.assert_array_equal(np.asarray(b["moe_layers.mlp.wi_up"])[1], gate_up[..., 1::2])
