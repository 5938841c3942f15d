"""Model-file tools: HF -> GGUF convert, GGUF requantize, GGUF -> HF export, info.

The GGUF files follow llama.cpp's ``convert_hf_to_gguf.py`` conventions for the
``llama`` architecture: same metadata keys, same tensor names, and the same
row permutation of the Q/K projections (HF "rotate-half" RoPE layout ->
llama.cpp's interleaved-pair layout), so llama.cpp and pykv load them alike.
"""
from __future__ import annotations
import glob
import os
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable
import numpy as np
import gguf
from gguf import GGMLQuantizationType as QT
from gguf import GGUFValueType as VT
from pykv.files.formats import KV_FORMATS


class ConvertError(Exception):
    """A user-facing error; the message is one line."""


# ----------------------------------------------------------------------------
# types
# ----------------------------------------------------------------------------

WEIGHT_TYPES: dict[str, QT] = {
    "f32": QT.F32, "f16": QT.F16, "bf16": QT.BF16,
    "q8_0": QT.Q8_0, "q4_0": QT.Q4_0, "q4_1": QT.Q4_1, "q5_0": QT.Q5_0, "q5_1": QT.Q5_1,
    "q2_k": QT.Q2_K, "q3_k": QT.Q3_K, "q4_k": QT.Q4_K, "q5_k": QT.Q5_K, "q6_k": QT.Q6_K,
}
QUANT_TYPES = ("q8_0", "q4_0", "q4_1", "q5_0", "q5_1")     # 32-blocks through kernels.kvquant
K_QUANT_TYPES = ("q2_k", "q3_k", "q4_k", "q5_k", "q6_k")   # 256-blocks through kernels.quantize_k
FILE_TYPES: dict[str, int] = {
    "f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
    "bf16": gguf.LlamaFileType.MOSTLY_BF16, "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
    "q4_0": gguf.LlamaFileType.MOSTLY_Q4_0, "q4_1": gguf.LlamaFileType.MOSTLY_Q4_1,
    "q5_0": gguf.LlamaFileType.MOSTLY_Q5_0, "q5_1": gguf.LlamaFileType.MOSTLY_Q5_1,
    "q2_k": gguf.LlamaFileType.MOSTLY_Q2_K, "q3_k": gguf.LlamaFileType.MOSTLY_Q3_K_S,
    "q4_k": gguf.LlamaFileType.MOSTLY_Q4_K_S, "q5_k": gguf.LlamaFileType.MOSTLY_Q5_K_S,
    "q6_k": gguf.LlamaFileType.MOSTLY_Q6_K,
}
SUPPORTED_ARCHS = ("LlamaForCausalLM", "MistralForCausalLM")
# KV cache types reported by `info`: every type `pykv plan` and -ctk / -ctv take
KV_INFO_TYPES = tuple(KV_FORMATS)


def _type_name(t: QT) -> str:
    return t.name.lower()


def parse_type(name: str, what: str = "type") -> str:
    n = str(name).strip().lower()
    if n not in WEIGHT_TYPES:
        raise ConvertError(f"unsupported {what} {name!r} (choose from {', '.join(WEIGHT_TYPES)})")
    return n


def _row_bytes(qt: QT, n: int) -> int:
    bs, ts = gguf.GGML_QUANT_SIZES[qt]
    return n // bs * ts


def _can_use(qt: QT, ncols: int) -> bool:
    return ncols % gguf.GGML_QUANT_SIZES[qt][0] == 0


# ----------------------------------------------------------------------------
# encoding float32 rows into a GGML type
# ----------------------------------------------------------------------------

_numba_quant: Any = None  # (quantize_rows, {name: code}) once resolved; False if unavailable


def _numba_quantizer():
    global _numba_quant
    if _numba_quant is None:
        try:
            from pykv.files.formats import KV_FORMATS  # type: ignore
            from pykv.kernels.kvquant import quantize_rows  # type: ignore
            codes = {}
            for name in QUANT_TYPES:
                fmt = KV_FORMATS.get(name) or KV_FORMATS.get(name.upper())
                if fmt is not None:
                    codes[name] = fmt.code
            _numba_quant = (quantize_rows, codes)
        except Exception:  # noqa: BLE001 - the Numba kernels are optional
            _numba_quant = False
    return _numba_quant


def quantize_backend(name: str) -> str:
    """'numba' when the Numba kernel handles type ``name``, else 'gguf.quants'."""
    nq = _numba_quantizer()
    return "numba" if nq and name in nq[1] else "gguf.quants"


def encode(x: np.ndarray, qt: QT, backend: str | None = None, qw: np.ndarray | None = None) -> np.ndarray:
    """Encode a float32 2-D array as GGML type ``qt``.

    Returns float32/float16 arrays for F32/F16, otherwise uint8 rows of the
    type's byte size (layout identical to gguf.quants.quantize / llama.cpp's quantizers).
    qw: float32[cols] importance weights (an imatrix row) for the K types and q4_0/q4_1/q5_0/q5_1,
    used as llama-quantize uses them."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    if qt == QT.F32:
        return x
    if qt == QT.F16:
        return x.astype(np.float16)
    if qt == QT.BF16:
        return gguf.quants.quantize(x, QT.BF16)
    if not x.flags.writeable:   # a read-only array (a GGUF memmap) is another Numba type: one compiled
        x = x.copy()            # quantizer, not two (each a long compile)
    name = _type_name(qt)
    from pykv.kernels import quantize_k as K
    imat = qw is not None and int(qt) in K.LEGACY_BLOCK_BYTES
    if int(qt) in K.BLOCK_BYTES or imat:
        x2 = x.reshape(-1, x.shape[-1])
        dst = np.empty((x2.shape[0], _row_bytes(qt, x2.shape[1])), dtype=np.uint8)
        w = np.zeros(0, np.float32) if qw is None else np.ascontiguousarray(qw, np.float32)
        (K.quantize_rows_legacy_imat if imat else K.quantize_rows_k)(int(qt), x2, w, dst)
        return dst.reshape(*x.shape[:-1], dst.shape[-1])
    nq = _numba_quantizer()
    use_numba = backend != "gguf.quants" and nq and name in nq[1]
    if backend == "numba" and not use_numba:
        raise ConvertError(f"Numba quantizer not available for {name}")
    if use_numba:
        quantize_rows, codes = nq
        x2 = x.reshape(-1, x.shape[-1])
        dst = np.empty((x2.shape[0], _row_bytes(qt, x2.shape[1])), dtype=np.uint8)
        quantize_rows(codes[name], x2, dst)
        return dst.reshape(*x.shape[:-1], dst.shape[-1])
    return gguf.quants.quantize(x, qt)


def decode(data: np.ndarray, qt: QT) -> np.ndarray:
    """Dequantize tensor data as stored by GGUFReader into float32."""
    if qt == QT.F32:
        return np.asarray(data, dtype=np.float32)
    return np.asarray(gguf.quants.dequantize(data, qt), dtype=np.float32)


# ----------------------------------------------------------------------------
# Q/K permutation (HF rotate-half <-> llama.cpp interleaved pairs)
# ----------------------------------------------------------------------------

def permute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp converter's permutation of q_proj/k_proj rows (and biases).

    Within each head, HF keeps the two RoPE halves [0:d/2] and [d/2:d]; the
    GGUF layout interleaves them: row 2i <- i, row 2i+1 <- d/2 + i."""
    shp = w.shape
    return w.reshape(n_head, 2, shp[0] // n_head // 2, *shp[1:]).swapaxes(1, 2).reshape(shp)


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    shp = w.shape
    return w.reshape(n_head, shp[0] // n_head // 2, 2, *shp[1:]).swapaxes(1, 2).reshape(shp)


# ----------------------------------------------------------------------------
# tensor names
# ----------------------------------------------------------------------------

_LAYER_MAP = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.bias": "attn_output.bias",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "mlp.gate_proj.bias": "ffn_gate.bias",
    "mlp.up_proj.bias": "ffn_up.bias",
    "mlp.down_proj.bias": "ffn_down.bias",
}
_LAYER_REQUIRED = ("input_layernorm.weight", "self_attn.q_proj.weight", "self_attn.k_proj.weight",
                   "self_attn.v_proj.weight", "self_attn.o_proj.weight", "post_attention_layernorm.weight",
                   "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")
_GLOBAL_MAP = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
_REV_LAYER = {v: k for k, v in _LAYER_MAP.items()}
_REV_GLOBAL = {v: k for k, v in _GLOBAL_MAP.items()}
_IGNORED = re.compile(r".*(rotary_emb\.inv_freq|attention\.masked_bias|attention\.bias)$")


def hf_to_gguf_name(name: str) -> str | None:
    if name in _GLOBAL_MAP:
        return _GLOBAL_MAP[name]
    m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", name)
    if m and m.group(2) in _LAYER_MAP:
        return f"blk.{m.group(1)}.{_LAYER_MAP[m.group(2)]}"
    return None


def gguf_to_hf_name(name: str) -> str | None:
    if name in _REV_GLOBAL:
        return _REV_GLOBAL[name]
    m = re.fullmatch(r"blk\.(\d+)\.(.+)", name)
    if m and m.group(2) in _REV_LAYER:
        return f"model.layers.{m.group(1)}.{_REV_LAYER[m.group(2)]}"
    return None


def _keeps_f32(gname: str, ndim: int) -> bool:
    return ndim <= 1 or gname.endswith("_norm.weight") or gname == "rope_freqs.weight"


# ----------------------------------------------------------------------------
# safe output
# ----------------------------------------------------------------------------

def _check_out(path: Path, force: bool, inputs=()) -> None:
    """An output may be written: not a folder, its folder exists, not replaced without --force, and not
    one of the inputs (same path or same inode: a hard link counts)."""
    if path.is_dir():
        raise ConvertError(f"output is a directory: {path}")
    for src in inputs:
        if _same_file(path, Path(src)):
            raise ConvertError(f"output {path} is the input {src}: write to another file")
    if path.exists() and not force:
        raise ConvertError(f"output exists: {path} (use --force)")
    if not path.parent.is_dir():
        raise ConvertError(f"output folder does not exist: {path.parent}")
    _remove_stale_tmp(path)


def _same_file(a: Path, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:              # one of them does not exist
        return False


def _tmp_path(path: Path) -> Path:
    return path.with_name(f".{path.name}.tmp-{os.getpid()}")


def _remove_stale_tmp(path: Path) -> None:
    """Temp files of writers that were killed (their pid is gone) next to this output."""
    for p in path.parent.glob(f".{glob.escape(path.name)}.tmp-*"):
        pid = p.name.rsplit("-", 1)[-1]
        if pid.isdigit() and int(pid) != os.getpid() and not os.path.exists(f"/proc/{pid}"):
            try:
                p.unlink()
            except OSError:
                pass


def _test_pause() -> None:
    """PYKV_TEST_WRITE_PAUSE=seconds: a writer sleeps midway, so a test can kill it there (tests only)."""
    s = os.environ.get("PYKV_TEST_WRITE_PAUSE")
    if s:
        time.sleep(float(s))


def _want_progress(progress: bool | None) -> bool:
    if progress is None:
        try:
            return sys.stderr.isatty()
        except Exception:  # noqa: BLE001
            return False
    return bool(progress)


class _Bar:
    def __init__(self, enabled: bool, total: int, desc: str):
        self.bar = None
        if enabled:
            from tqdm import tqdm
            self.bar = tqdm(total=total, desc=desc, unit="B", unit_scale=True, file=sys.stderr, leave=False)

    def update(self, n: int, name: str = "") -> None:
        if self.bar is not None:
            if name:
                self.bar.set_postfix_str(name, refresh=False)
            self.bar.update(n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


@dataclass
class _PlannedTensor:
    name: str
    shape: tuple[int, ...]     # numpy order (rows, cols)
    qtype: QT
    produce: Callable[[], np.ndarray]   # returns the encoded array

    @property
    def nbytes(self) -> int:
        n_el = int(np.prod(self.shape)) if self.shape else 1
        bs, ts = gguf.GGML_QUANT_SIZES[self.qtype]
        return n_el // bs * ts


def _write_gguf(out_path: Path, writer_setup: Callable[[gguf.GGUFWriter], None], arch: str,
                tensors: list[_PlannedTensor], force: bool, progress: bool | None, desc: str) -> Path:
    """Stream tensors into a temporary GGUF, verify it, then os.replace it into place."""
    _check_out(out_path, force)
    tmp = _tmp_path(out_path)
    w = gguf.GGUFWriter(tmp, arch)
    try:
        writer_setup(w)
        for t in tensors:
            w.add_tensor_info(t.name, t.shape, np.dtype(np.float32), t.nbytes, raw_dtype=t.qtype)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        bar = _Bar(_want_progress(progress), sum(t.nbytes for t in tensors), desc)
        try:
            for t in tensors:
                arr = t.produce()
                if arr.nbytes != t.nbytes:
                    raise ConvertError(f"internal error: {t.name}: {arr.nbytes} bytes, expected {t.nbytes}")
                w.write_tensor_data(arr)
                bar.update(t.nbytes, t.name)
                if t is tensors[0]:
                    _test_pause()
        finally:
            bar.close()
        w.close()
        _verify_gguf(tmp, tensors)
        os.replace(tmp, out_path)
    except BaseException:
        w.close()
        try:
            tmp.unlink()
        except FileNotFoundError:
            pass
        raise
    return out_path


def _verify_gguf(path: Path, tensors: list[_PlannedTensor]) -> None:
    try:
        r = gguf.GGUFReader(path)
    except Exception as e:  # noqa: BLE001
        raise ConvertError(f"written file does not read back: {e}") from None
    if len(r.tensors) != len(tensors):
        raise ConvertError(f"written file has {len(r.tensors)} tensors, expected {len(tensors)}")
    for rt, t in zip(r.tensors, tensors):
        shape = tuple(int(x) for x in reversed(rt.shape.tolist()))
        if rt.name != t.name or rt.tensor_type != t.qtype or int(rt.n_bytes) != t.nbytes or shape != tuple(t.shape):
            raise ConvertError(f"written file check failed at tensor {t.name}")


# ----------------------------------------------------------------------------
# GGUF reading helpers
# ----------------------------------------------------------------------------

def _open_gguf(path) -> gguf.GGUFReader:
    """gguf-py's reader over a file pykv's own parser accepted first (bounds-checked header, tensor
    data inside the file, in order: a hostile file gets a one-line PykvError, not gguf-py's exception)."""
    from pykv.files.gguf_io import GGUFFile
    GGUFFile(path)
    try:
        return gguf.GGUFReader(path)
    except Exception as e:  # noqa: BLE001
        raise ConvertError(f"cannot read {path}: {e}") from None


def _field_value(f) -> Any:
    """Python value of a GGUF metadata field (strings as str; undecodable as bytes)."""
    t = f.types[0]
    if t == VT.ARRAY:
        st = f.types[-1]
        if st == VT.STRING:
            out = []
            for i in f.data:
                b = bytes(f.parts[i])
                try:
                    out.append(b.decode("utf-8"))
                except UnicodeDecodeError:
                    out.append(b)
            return out
        return [f.parts[i].tolist()[0] for i in f.data]
    if t == VT.STRING:
        b = bytes(f.parts[-1])
        try:
            return b.decode("utf-8")
        except UnicodeDecodeError:
            return b
    return f.parts[-1].tolist()[0]


def gguf_metadata(r: gguf.GGUFReader) -> dict[str, Any]:
    return {k: _field_value(f) for k, f in r.fields.items() if not k.startswith("GGUF.")}


def _copy_field(w: gguf.GGUFWriter, key: str, f) -> None:
    t = f.types[0]
    if t == VT.ARRAY:
        if len(f.types) > 2:
            return  # nested arrays: not used by llama models
        st = f.types[-1]
        if not len(f.data):
            return
        if st == VT.STRING:
            vals = [bytes(f.parts[i]) for i in f.data]
        else:
            vals = [f.parts[i].tolist()[0] for i in f.data]
        w.add_key_value(key, vals, VT.ARRAY, sub_type=st)
    elif t == VT.STRING:
        w.add_key_value(key, bytes(f.parts[-1]), VT.STRING)
    else:
        w.add_key_value(key, f.parts[-1].tolist()[0], t)


def _tensor_shape(rt) -> tuple[int, ...]:
    """numpy-order shape (rows, cols) of a reader tensor."""
    return tuple(int(x) for x in reversed(rt.shape.tolist()))


def _tensor_f32(rt) -> np.ndarray:
    return decode(rt.data, rt.tensor_type).reshape(_tensor_shape(rt))
