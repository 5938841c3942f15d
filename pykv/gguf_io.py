"""Open and validate GGUF files (memory-mapped; the weights are never copied whole)."""
from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf import GGUFReader

from .config import Config, PykvError

# Weight types the matmul kernels execute.
WEIGHT_TYPES = {T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q4_K, T.Q5_K, T.Q6_K}
GGUF_MAGIC = b"GGUF"


@dataclass
class TensorInfo:
    name: str
    ggml_type: int
    shape: tuple          # ggml order: (ne0 = row length, ne1 = rows)
    data: np.ndarray      # memmap view: uint8 (rows, row_bytes) for block types, float (rows, ne0) for float types


class GGUFFile:
    """A validated GGUF file: metadata dict + tensor table (memmap views)."""

    def __init__(self, path: str | os.PathLike):
        path = os.fspath(path)
        if not os.path.exists(path):
            raise PykvError(f"model file not found: {path}")
        if os.path.isdir(path):
            raise PykvError(f"model path is a directory, not a GGUF file: {path}")
        with open(path, "rb") as f:
            magic = f.read(4)
        if magic != GGUF_MAGIC:
            raise PykvError(f"not a GGUF file (bad magic {magic!r}): {path}")
        try:
            reader = GGUFReader(path, "r")
        except Exception as e:  # gguf raises many kinds on corrupt/truncated input
            msg = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise PykvError(f"corrupt or truncated GGUF file {path}: {msg}") from None
        self.path = path
        self.reader = reader
        self.file_size = os.path.getsize(path)
        try:
            self.metadata = {k: f.contents() for k, f in reader.fields.items()}
        except Exception as e:
            raise PykvError(f"corrupt GGUF metadata in {path}: {e}") from None
        self.tensors: dict[str, TensorInfo] = {}
        for t in reader.tensors:
            end = int(t.data_offset) + int(t.n_bytes)
            if t.data_offset < 0 or end > self.file_size or t.data.nbytes != t.n_bytes:
                raise PykvError(f"truncated GGUF file {path}: tensor {t.name} data lies outside the file")
            shape = tuple(int(x) for x in t.shape)
            self.tensors[t.name] = TensorInfo(t.name, int(t.tensor_type), shape, t.data)

    def tensor(self, name: str, shape: tuple, types=None) -> TensorInfo:
        """Fetch a tensor, checking presence, ggml-order shape and type."""
        ti = self.tensors.get(name)
        if ti is None:
            raise PykvError(f"GGUF file is missing tensor {name}")
        if ti.shape != tuple(shape):
            raise PykvError(f"tensor {name} has shape {list(ti.shape)}, expected {list(shape)}")
        if types is not None and ti.ggml_type not in types:
            raise PykvError(f"tensor {name} has unsupported type {T(ti.ggml_type).name}")
        return ti


def type_name(ggml_type: int) -> str:
    try:
        return T(ggml_type).name
    except ValueError:
        return f"type{ggml_type}"


def open_model(path) -> tuple[GGUFFile, Config]:
    gf = GGUFFile(path)
    cfg = Config.from_metadata(gf.metadata)
    return gf, cfg
