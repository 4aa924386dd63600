"""Safetensors files: read through the ``safetensors`` library one tensor at a time (never pickle, never the
whole file), written by a streaming writer of our own because the library's writers take every tensor of a file
in memory at once.

A file is an 8-byte little-endian header length N, N bytes of JSON ({name: {"dtype", "shape",
"data_offsets": [begin, end]}, optional "__metadata__": {str: str}}), then the tensors' bytes,
little-endian and C-ordered, at those offsets. A sharded model adds ``model.safetensors.index.json``,
whose "weight_map" names the file of every tensor.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Callable, Iterable, Mapping

import ml_dtypes
import numpy as np
from safetensors import SafetensorError, safe_open

from jaxtron.families.family import FormatError

SAFETENSORS_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
          "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_}
NAMES = {np.dtype(v): k for k, v in SAFETENSORS_DTYPES.items()}
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


class SafetensorsFile:
    """The header of one file (checked whole by the library when opened); ``read(name)`` loads one tensor."""

    def __init__(self, path: str):
        self.path = path
        self.tensors: dict[str, tuple[np.dtype, tuple[int, ...]]] = {}
        try:
            with safe_open(path, framework="numpy") as f:
                self.metadata = f.metadata() or {}
                for name in f.keys():  # noqa: SIM118 - a safe_open handle is not iterable
                    view = f.get_slice(name)
                    code, shape = view.get_dtype(), tuple(view.get_shape())
                    if code not in SAFETENSORS_DTYPES:
                        raise FormatError(f"tensor '{name}' in '{path}' is of dtype {code}; supported dtypes are "
                                          f"{', '.join(SAFETENSORS_DTYPES)}.")
                    self.tensors[name] = (np.dtype(SAFETENSORS_DTYPES[code]), shape)
        except (SafetensorError, OSError) as e:
            raise FormatError(f"'{path}' is not a readable safetensors file; it is truncated or corrupt "
                              f"({str(e).strip()}).") from None

    def read(self, name: str) -> np.ndarray:
        try:
            with safe_open(self.path, framework="numpy") as f:
                return f.get_tensor(name)
        except (SafetensorError, OSError) as e:
            raise FormatError(f"tensor '{name}' in '{self.path}' cannot be read ({str(e).strip()}).") from None


class ModelFiles:
    """The safetensors tensors of a model directory (one file, or several with an index), by name."""

    def __init__(self, directory: str):
        index = os.path.join(directory, INDEX)
        if os.path.exists(index):
            try:
                with open(index) as f:
                    weight_map = json.load(f)["weight_map"]
            except (OSError, ValueError, KeyError, TypeError) as e:
                raise FormatError(f"'{index}' is not a readable safetensors index ({type(e).__name__}: {e}).") from None
            names = sorted(set(weight_map.values()))
        elif os.path.exists(os.path.join(directory, SINGLE)):
            names, weight_map = [SINGLE], None
        else:
            found = sorted(n for n in os.listdir(directory) if n.endswith((".bin", ".pt", ".pth", ".ckpt")))
            hint = f" (found {', '.join(found[:3])}: pickle files, which are never loaded)" if found else ""
            raise FormatError(f"'{directory}' holds neither {SINGLE} nor {INDEX}{hint}; convert the weights to "
                              "safetensors first.")
        self.files = {n: SafetensorsFile(os.path.join(directory, n)) for n in names}
        self.where: dict[str, SafetensorsFile] = {}
        for file in self.files.values():
            for name in file.tensors:
                self.where[name] = file
        if weight_map is not None:
            missing = [n for n, file in weight_map.items() if n not in self.files[file].tensors]
            if missing:
                raise FormatError(f"tensor '{missing[0]}' is listed in '{index}' but missing from its file "
                                  f"'{weight_map[missing[0]]}'; the download is incomplete.")

    def __contains__(self, name: str) -> bool:
        return name in self.where

    def names(self) -> list[str]:
        return sorted(self.where)

    def shape(self, name: str) -> tuple[int, ...]:
        return self.where[name].tensors[name][1]

    def read(self, name: str) -> np.ndarray:
        return self.where[name].read(name)


def write(path: str, entries: Iterable[tuple[str, tuple[int, ...], np.dtype]], produce: Callable[[str], np.ndarray],
          metadata: Mapping[str, str] | None = None) -> None:
    """Writes one file: the header from ``entries`` (name, shape, dtype), then each tensor from ``produce(name)``,
    one at a time. The file appears under ``path`` only once complete."""
    header, offset, order = {}, 0, []
    for name, shape, dtype in entries:
        dtype = np.dtype(dtype)
        size = math.prod(shape) * dtype.itemsize
        header[name] = {"dtype": NAMES[dtype], "shape": list(shape), "data_offsets": [offset, offset + size]}
        order.append((name, tuple(shape), dtype))
        offset += size
    if metadata:
        header["__metadata__"] = dict(metadata)
    text = json.dumps(header, separators=(",", ":")).encode("utf-8")
    text += b" " * (-len(text) % 8)  # tensors start 8-byte aligned
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for name, shape, dtype in order:
            array = np.ascontiguousarray(produce(name), dtype=dtype)
            if array.shape != shape:
                raise ValueError(f"tensor '{name}' has shape {array.shape}, not the {shape} of its header")
            f.write(array.astype(dtype.newbyteorder("<"), copy=False).tobytes())
    os.replace(tmp, path)
