"""Hugging Face checkpoint I/O without torch/transformers.

* safetensors read (lazy, memory-mapped; f32/f16/bf16/...: the library's numpy API refuses bfloat16,
  the dtype LLaMA checkpoints ship in) and write (through the safetensors library)
* config.json / tokenizer.json / tokenizer_config.json helpers
* a minimal protobuf codec for SentencePiece ``tokenizer.model`` files
  (written by ``pykv export``; the ``protobuf`` package is not needed)
"""
from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import numpy as np

from pykv.files.tokenizer import build_spm_model  # noqa: F401  (export_hf writes tokenizer.model with it)

# ----------------------------------------------------------------------------
# safetensors
# ----------------------------------------------------------------------------

_ST_DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8,
    "U8": np.uint8, "BOOL": np.bool_,
    "BF16": np.uint16,  # decoded to float32 by read_tensor
}
_NP_TO_ST = {np.dtype(np.float64): "F64", np.dtype(np.float32): "F32", np.dtype(np.float16): "F16",
             np.dtype(np.int64): "I64", np.dtype(np.int32): "I32", np.dtype(np.int16): "I16",
             np.dtype(np.int8): "I8", np.dtype(np.uint8): "U8", np.dtype(np.bool_): "BOOL"}


class SafetensorsError(Exception):
    pass


def bf16_to_f32(u16: np.ndarray) -> np.ndarray:
    return (np.asarray(u16, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def f32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """Round-to-nearest-even float32 -> bfloat16 bit pattern (uint16)."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    nan = np.isnan(np.ascontiguousarray(x, dtype=np.float32))
    r = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    r[nan] = 0x7FC0
    return r


def read_safetensors_header(path: Path) -> tuple[dict[str, Any], int]:
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise SafetensorsError(f"not a safetensors file: {path}")
        (n,) = struct.unpack("<Q", raw)
        if n > 100 * 1024 * 1024:
            raise SafetensorsError(f"bad safetensors header size in {path}")
        header = json.loads(f.read(n))
    return header, 8 + n


class SafetensorsFile:
    """Lazily reads tensors of one .safetensors file through a memory map."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.header, self.data_start = read_safetensors_header(self.path)
        self.metadata = self.header.pop("__metadata__", None) or {}
        self._mm: np.memmap | None = None

    def keys(self) -> list[str]:
        return list(self.header)

    def dtype(self, name: str) -> str:
        return self.header[name]["dtype"]

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.header[name]["shape"])

    def get(self, name: str, decode_bf16: bool = True) -> np.ndarray:
        info = self.header[name]
        st = info["dtype"]
        if st not in _ST_DTYPES:
            raise SafetensorsError(f"{self.path.name}: tensor {name}: unsupported dtype {st}")
        if self._mm is None:
            self._mm = np.memmap(self.path, dtype=np.uint8, mode="r")
        b, e = info["data_offsets"]
        raw = self._mm[self.data_start + b: self.data_start + e]
        arr = raw.view(_ST_DTYPES[st]).reshape(info["shape"])
        if st == "BF16" and decode_bf16:
            arr = bf16_to_f32(arr)
        return arr


_ST_NAMES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64",
             "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool"}


def write_safetensors(path: str | Path, tensors: dict[str, np.ndarray],
                      metadata: dict[str, str] | None = None,
                      dtypes: dict[str, str] | None = None) -> None:
    """Write a safetensors file through the safetensors library (its low-level serialize_file: the numpy
    API has no bfloat16). ``dtypes`` may name "BF16" for uint16 arrays holding bfloat16 bit patterns."""
    try:
        import safetensors
    except ImportError:
        raise SafetensorsError("writing safetensors needs the safetensors package: pip install safetensors") from None
    spec = getattr(safetensors, "TensorSpec", None)     # 0.6+: zero-copy specs; before: dicts with bytes
    flat, keep = {}, []
    for name, arr in tensors.items():
        arr = np.asarray(arr)
        arr = np.ascontiguousarray(arr, dtype=arr.dtype.newbyteorder("<"))     # safetensors is little-endian
        st = (dtypes or {}).get(name) or _NP_TO_ST.get(arr.dtype)
        if st is None or st not in _ST_NAMES:
            raise SafetensorsError(f"cannot store dtype {arr.dtype} for {name}")
        keep.append(arr)
        if spec is not None:
            flat[name] = spec(dtype=_ST_NAMES[st], shape=arr.shape, data_ptr=arr.ctypes.data, data_len=arr.nbytes)
        else:
            flat[name] = {"dtype": _ST_NAMES[st], "shape": list(arr.shape), "data": arr.tobytes()}
    safetensors.serialize_file(flat, str(path), metadata=dict(metadata or {"format": "pt"}))   # keep: alive until here


class HFCheckpoint:
    """All tensors of a HF checkpoint folder (single file or sharded)."""

    def __init__(self, hf_dir: str | Path):
        self.dir = Path(hf_dir)
        index = self.dir / "model.safetensors.index.json"
        files: list[Path]
        if index.is_file():
            wm = json.loads(index.read_text(encoding="utf-8")).get("weight_map", {})
            files = sorted({self.dir / v for v in wm.values()})
        elif (self.dir / "model.safetensors").is_file():
            files = [self.dir / "model.safetensors"]
        else:
            files = sorted(self.dir.glob("*.safetensors"))
        if not files:
            raise SafetensorsError(f"no *.safetensors files in {self.dir}")
        self.files = {}
        self.where: dict[str, SafetensorsFile] = {}
        for p in files:
            if not p.is_file():
                raise SafetensorsError(f"missing shard: {p}")
            sf = SafetensorsFile(p)
            self.files[p] = sf
            for k in sf.keys():
                self.where[k] = sf

    def names(self) -> list[str]:
        return list(self.where)

    def __contains__(self, name: str) -> bool:
        return name in self.where

    def shape(self, name: str) -> tuple[int, ...]:
        return self.where[name].shape(name)

    def dtype(self, name: str) -> str:
        return self.where[name].dtype(name)

    def get(self, name: str) -> np.ndarray:
        return self.where[name].get(name)


# ----------------------------------------------------------------------------
# json helpers
# ----------------------------------------------------------------------------

def read_json(path: Path) -> Any:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def write_json(path: Path, obj: Any) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, ensure_ascii=False)
        f.write("\n")


# ----------------------------------------------------------------------------
# BPE tokenizer.json: pre-tokenizer <-> llama.cpp "tokenizer.ggml.pre" name
# ----------------------------------------------------------------------------

LLAMA3_REGEX = ("(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*"
                "|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+")


def _flatten_pre(pre: Any) -> list[dict]:
    if not pre:
        return []
    if pre.get("type") == "Sequence":
        out = []
        for p in pre.get("pretokenizers", []):
            out.extend(_flatten_pre(p))
        return out
    return [pre]


def detect_bpe_pre(tok_json: dict) -> str | None:
    """Map a tokenizer.json pre-tokenizer to llama.cpp's pre-tokenizer name.

    Returns None when the structure is not one we recognise."""
    steps = _flatten_pre(tok_json.get("pre_tokenizer"))
    kinds = [s.get("type") for s in steps]
    if kinds == ["ByteLevel"] and steps[0].get("use_regex", True):
        return "gpt-2"
    if (kinds == ["Digits", "ByteLevel"] and steps[0].get("individual_digits")
            and steps[1].get("use_regex", True)):
        return "smollm"
    if kinds == ["Split", "ByteLevel"] and not steps[1].get("use_regex", True):
        pat = steps[0].get("pattern", {})
        rx = pat.get("Regex") if isinstance(pat, dict) else None
        if rx and "\\p{N}{1,3}" in rx and "(?i:'s|'t" in rx:
            return "llama-bpe"
    return None


def pre_tokenizer_for(pre: str) -> dict:
    """tokenizer.json pre_tokenizer for a llama.cpp pre-tokenizer name."""
    bl = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    if pre in ("smollm", "starcoder", "refact", "codeshell"):
        return {"type": "Sequence", "pretokenizers": [
            {"type": "Digits", "individual_digits": True}, bl]}
    if pre in ("llama-bpe", "llama3"):
        return {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": LLAMA3_REGEX}, "behavior": "Isolated", "invert": False},
            dict(bl, use_regex=False)]}
    return bl


# ----------------------------------------------------------------------------
# SentencePiece model protobuf (subset) reader; the writer is tokenizer.build_spm_model
# ----------------------------------------------------------------------------
# ModelProto: 1 pieces (repeated SentencePiece), 2 trainer_spec, 3 normalizer_spec
# SentencePiece: 1 piece (string), 2 score (float), 3 type (enum; same values as GGUF token types)
# TrainerSpec: 3 model_type (1 unigram, 2 bpe), 4 vocab_size, 35 byte_fallback,
#              40 unk_id, 41 bos_id, 42 eos_id, 43 pad_id
# NormalizerSpec: 1 name, 3 add_dummy_prefix, 4 remove_extra_whitespaces, 5 escape_whitespaces

def pb_decode(buf: bytes) -> list[tuple[int, int, Any]]:
    """Decode one protobuf message level into (field, wiretype, value) triples."""
    out = []
    i = 0
    n = len(buf)

    def rv(i):
        r = s = 0
        while True:
            b = buf[i]
            i += 1
            r |= (b & 0x7F) << s
            s += 7
            if not b & 0x80:
                return r, i

    while i < n:
        k, i = rv(i)
        f, wt = k >> 3, k & 7
        if wt == 0:
            v, i = rv(i)
        elif wt == 1:
            v = buf[i:i + 8]
            i += 8
        elif wt == 2:
            ln, i = rv(i)
            v = buf[i:i + ln]
            i += ln
        elif wt == 5:
            v = buf[i:i + 4]
            i += 4
        else:
            raise ValueError(f"unsupported protobuf wire type {wt}")
        out.append((f, wt, v))
    return out


def spm_model_info(path: Path) -> dict:
    """A few fields of a tokenizer.model (trainer spec / normalizer spec)."""
    info: dict[str, Any] = {}
    for f, wt, v in pb_decode(Path(path).read_bytes()):
        if f == 2 and wt == 2:
            for f2, _, v2 in pb_decode(v):
                if f2 == 3:
                    info["model_type"] = v2
        elif f == 3 and wt == 2:
            for f2, _, v2 in pb_decode(v):
                if f2 == 1:
                    info["normalizer"] = bytes(v2).decode("utf-8", "replace")
                elif f2 == 3:
                    info["add_dummy_prefix"] = bool(v2)
    return info
