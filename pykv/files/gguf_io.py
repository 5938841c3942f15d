"""Open and validate GGUF files (memory-mapped; the weights are never copied whole)."""
from __future__ import annotations

import mmap
import os
import stat
import struct
from dataclasses import dataclass

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf.constants import GGML_QUANT_SIZES

from pykv.files.config import Config, ModelFileError, PykvError
from pykv.files.validate import WEIGHT_TYPES, validate

# the 2-D weight types pykv runs (kernels.matmul.SUPPORTED_TYPES: tests/test_matmul checks they agree)
GGUF_MAGIC = b"GGUF"


@dataclass
class TensorInfo:
    name: str
    ggml_type: int
    shape: tuple          # ggml order: (ne0 = row length, ne1 = rows)
    data: np.ndarray      # memmap view: uint8 (rows, row_bytes) for block types, float (rows, ne0) for float types
    offset: int = 0       # byte offset of the data in the file
    nbytes: int = 0


_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_NP = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?", 10: "<u8", 11: "<i8", 12: "<f8"}
_STRING, _ARRAY = 8, 9
_ITEM_NP = {T.F32: np.float32, T.F16: np.float16, T.F64: np.float64, T.I8: np.int8, T.I16: np.int16,
            T.I32: np.int32, T.I64: np.int64}
MAX_DIMS = 4


class _Corrupt(Exception):
    pass


class _NotGGUF(_Corrupt):
    pass


_U64 = struct.Struct("<Q")


class _Header:
    """Sequential little-endian reader over the mapped file; every read is bounds-checked."""

    def __init__(self, mm):
        self.mm, self.n, self.off = mm, len(mm), 0

    def need(self, k: int) -> None:
        if k < 0 or self.off + k > self.n:
            raise _Corrupt(f"header runs past the end of the file (offset {self.off}, need {k} bytes)")

    def scalar(self, fmt: str):
        k = struct.calcsize(fmt)
        self.need(k)
        v = struct.unpack_from(fmt, self.mm, self.off)[0]
        self.off += k
        return v

    def string(self) -> str:
        k = self.scalar("<Q")
        self.need(k)
        b = self.mm[self.off:self.off + k]
        self.off += k
        try:
            return b.decode("utf-8")
        except UnicodeDecodeError:
            raise _Corrupt(f"string at offset {self.off - k} is not UTF-8") from None

    def strings(self, n: int) -> list:
        """n strings in a row (a vocabulary: 49k tokens and 48k merges in SmolLM2): string()'s checks in one
        loop with local names (the vocabulary dominates the header's parse time)."""
        mm, end, off, out = self.mm, self.n, self.off, []
        length = _U64.unpack_from
        for _ in range(n):
            if off + 8 > end:
                self.off = off
                self.need(8)
            k = length(mm, off)[0]
            off += 8
            if off + k > end:
                self.off = off
                self.need(k)
            try:
                out.append(mm[off:off + k].decode("utf-8"))
            except UnicodeDecodeError:
                raise _Corrupt(f"string at offset {off} is not UTF-8") from None
            off += k
        self.off = off
        return out

    def value(self, vt: int, depth: int = 0):
        if vt in _SCALAR:
            return self.scalar(_SCALAR[vt])
        if vt == _STRING:
            return self.string()
        if vt == _ARRAY and depth < 2:
            it, n = self.scalar("<I"), self.scalar("<Q")
            if it in _NP:
                size = np.dtype(_NP[it]).itemsize
                self.need(n * size)
                v = np.frombuffer(self.mm, _NP[it], n, self.off).tolist()
                self.off += n * size
                return v
            self.need(n * (8 if it == _STRING else 12))      # each item takes at least that much
            if it == _STRING:
                return self.strings(n)
            return [self.value(it, depth + 1) for _ in range(n)]
        raise _Corrupt(f"unknown metadata value type {vt}")


def _parse(path: str):
    """(metadata dict, [(name, ggml_type, ggml-order shape, data offset, bytes)], data view) of a GGUF
    v2/v3 little-endian file.  A direct parser: gguf.GGUFReader builds numpy views of every field, which
    dominated a warm start on a model with a large vocabulary."""
    with open(path, "rb") as f:
        magic = f.read(4)
        if magic != GGUF_MAGIC:
            raise _NotGGUF(f"bad magic {magic!r}")
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    h = _Header(mm)
    if h.n < 24:
        raise _Corrupt("too short for a GGUF header")
    h.off = 4
    version = h.scalar("<I")
    if version not in (2, 3):
        if version & 0xFFFF == 0:
            raise _Corrupt("big-endian GGUF files are not supported")
        raise _Corrupt(f"GGUF version {version} is not supported (2 and 3 are)")
    n_tensors, n_kv = h.scalar("<Q"), h.scalar("<Q")
    if n_kv * 12 > h.n or n_tensors * 24 > h.n:
        raise _Corrupt(f"implausible counts: {n_tensors} tensors, {n_kv} metadata keys")
    meta = {"GGUF.version": version, "GGUF.tensor_count": n_tensors, "GGUF.kv_count": n_kv}
    for _ in range(n_kv):
        key = h.string()
        meta[key] = h.value(h.scalar("<I"))
    infos = []
    for _ in range(n_tensors):
        name = h.string()
        nd = h.scalar("<I")
        if not 1 <= nd <= MAX_DIMS:
            raise _Corrupt(f"tensor {name} has {nd} dimensions")
        h.need(8 * nd)
        shape = tuple(int(x) for x in np.frombuffer(mm, "<u8", nd, h.off))
        h.off += 8 * nd
        gt, off = h.scalar("<I"), h.scalar("<Q")
        try:
            gt = T(gt)
        except ValueError:
            raise _Corrupt(f"tensor {name} has unknown type {gt}") from None
        bs, bb = GGML_QUANT_SIZES[gt]
        n_el = 1
        for x in shape:
            n_el *= x
        infos.append((name, gt, shape, off, -(-n_el // bs) * bb))
    align = meta.get("general.alignment", 32)
    if not isinstance(align, int) or align <= 0 or align & (align - 1):
        raise _Corrupt(f"bad general.alignment {align!r}")
    start = -(-h.off // align) * align
    return meta, [(n, gt, sh, start + off, nb) for n, gt, sh, off, nb in infos], mm, start, align


class GGUFFile:
    """A validated GGUF file: metadata dict + tensor table (views into one read-only mapping)."""

    def __init__(self, path: str | os.PathLike):
        path = os.fspath(path)
        if not os.path.exists(path):
            raise PykvError(f"model file not found: {path}")
        if os.path.isdir(path):
            raise PykvError(f"model path is a directory, not a GGUF file: {path}")
        if not stat.S_ISREG(os.stat(path).st_mode):      # a FIFO would block, a device never ends
            raise PykvError(f"model path is not a regular file: {path}")
        try:
            self.metadata, infos, mm, start, align = _parse(path)
        except _NotGGUF as e:
            raise ModelFileError(f"not a GGUF file ({e}): {path}") from None
        except _Corrupt as e:
            raise ModelFileError(f"corrupt or truncated GGUF file {path}: {e}") from None
        except OSError as e:
            raise PykvError(f"cannot read {path}: {e.strerror}") from None
        self.path = path
        self.file_size = len(mm)
        self.tensors: dict[str, TensorInfo] = {}
        expect = start           # llama.cpp's rule: tensor data in table order, each padded to the alignment
        for name, gt, shape, off, nbytes in infos:
            if name in self.tensors:
                raise ModelFileError(f"corrupt GGUF file {path}: duplicate tensor {name}")
            if off != expect:
                raise ModelFileError(f"corrupt GGUF file {path}: tensor {name} has data offset {off - start}, "
                                f"expected {expect - start}")
            expect += -(-nbytes // align) * align
            if off + nbytes > self.file_size:
                raise ModelFileError(f"truncated GGUF file {path}: tensor {name} data lies outside the file")
            dims = tuple(reversed(shape))
            if gt in _ITEM_NP:
                data = np.frombuffer(mm, _ITEM_NP[gt], nbytes // GGML_QUANT_SIZES[gt][1], off).reshape(dims)
            elif shape[0] % GGML_QUANT_SIZES[gt][0] == 0:
                bs, bb = GGML_QUANT_SIZES[gt]
                data = np.frombuffer(mm, np.uint8, nbytes, off).reshape(dims[:-1] + (shape[0] // bs * bb,))
            else:                        # rows are not whole blocks: flat bytes (no kernel accepts it)
                data = np.frombuffer(mm, np.uint8, nbytes, off)
            self.tensors[name] = TensorInfo(name, int(gt), shape, data, off, nbytes)
        self._mm = mm

    def release(self, name: str) -> None:
        """Drop this process's pages of a tensor's bytes (madvise MADV_DONTNEED on the read-only mapping):
        for a weight repacked at load, whose kernels read the copy.  The bytes stay readable; a later read
        faults them in again from the page cache.  Without it a repacked model holds both copies."""
        ti = self.tensors.get(name)
        advice = getattr(mmap, "MADV_DONTNEED", None)
        if ti is None or advice is None or not ti.nbytes:
            return
        page = mmap.PAGESIZE
        lo = -(-ti.offset // page) * page
        hi = (ti.offset + ti.nbytes) // page * page
        if hi > lo:
            try:
                self._mm.madvise(advice, lo, hi - lo)
            except (OSError, ValueError):
                pass

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


def open_model(path) -> tuple[GGUFFile, Config]:
    """Open and validate a model file (pykv.files.validate: metadata, tokenizer tables, tensors) before any
    kernel sees it."""
    gf = GGUFFile(path)
    return gf, validate(gf)
