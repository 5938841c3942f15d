"""Which type each tensor gets in `pykv quantize`, and llama.cpp importance matrices.

Type choice follows llama-quantize (llama.cpp src/llama-quant.cpp, llama_tensor_get_type) for the
llama architecture (one expert, not Falcon):

* plain types (q2_k ... q6_k, q8_0, q4_0 ...): every quantizable 2-D weight gets that type
  (llama-quantize --pure);
* mixes (q3_k_m, q4_k_s, q4_k_m, q5_k_m, q6_k): the base type, with attn_v / ffn_down / attn_output
  bumped per layer by the rules in MIXES, and output.weight (or a tied token_embd.weight) in Q6_K,
  or Q8_0 when its row length is not a multiple of the base type's block;
* a row length that the chosen type cannot hold falls back as llama.cpp does (FALLBACK), then F16.

The plain "q6_k" and the Q6_K mix choose the same types for llama models, so one name serves both.
llama-quantize's own "Q4_K" / "Q5_K" / "Q3_K" are aliases of its _M mixes; pykv's are plain types.
"""
from __future__ import annotations

import re
import struct
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

import gguf
from gguf import GGMLQuantizationType as QT

from pykv.tools.common import FILE_TYPES, WEIGHT_TYPES

_FT = gguf.LlamaFileType

# llama.cpp's tensor_type_fallback: a 256-block type on a row that is not a multiple of 256
FALLBACK = {QT.Q2_K: QT.Q4_0, QT.Q3_K: QT.Q4_0, QT.Q4_K: QT.Q5_0, QT.Q5_K: QT.Q5_1, QT.Q6_K: QT.Q8_0}


@dataclass(frozen=True)
class Mix:
    base: QT
    file_type: int
    # category -> ((condition, argument, type), ...): the first condition that holds picks the type.
    # conditions on (i, n) = (index of this tensor among its category in file order, their count):
    #   "lt": i < arg   "lt_n": i < n // arg   "more_bits": llama.cpp's use_more_bits(i, n)   "all": always
    rules: dict = field(default_factory=dict)
    pure: bool = False


_MORE6 = (("more_bits", 0, QT.Q6_K),)
# plain types: convert.WEIGHT_TYPES / FILE_TYPES ("q6_k" is also llama-quantize's Q6_K mix: for llama
# models the mix's output rule picks what the fallback picks); then the mixes
MIXES: dict[str, Mix] = {name: Mix(t, int(FILE_TYPES[name]), pure=True) for name, t in WEIGHT_TYPES.items()}
MIXES.update({
    "q3_k_m": Mix(QT.Q3_K, int(_FT.MOSTLY_Q3_K_M), {
        "attn_v": (("lt", 2, QT.Q5_K), ("all", 0, QT.Q4_K)),
        "ffn_down": (("lt_n", 16, QT.Q5_K), ("all", 0, QT.Q4_K)),
        "attn_output": (("all", 0, QT.Q4_K),)}),
    "q4_k_s": Mix(QT.Q4_K, int(_FT.MOSTLY_Q4_K_S), {
        "attn_v": (("lt", 4, QT.Q5_K),),
        "ffn_down": (("lt_n", 8, QT.Q5_K),)}),
    "q4_k_m": Mix(QT.Q4_K, int(_FT.MOSTLY_Q4_K_M), {"attn_v": _MORE6, "ffn_down": _MORE6}),
    "q5_k_m": Mix(QT.Q5_K, int(_FT.MOSTLY_Q5_K_M), {"attn_v": _MORE6, "ffn_down": _MORE6}),
})


def _category(name: str) -> str:
    """llama.cpp's tensor_get_category (the categories a llama model has)."""
    if name == "output.weight":
        return "output"
    if name == "token_embd.weight":
        return "token_embd"
    for c in ("attn_v", "attn_k", "attn_q", "attn_output"):
        if f"{c}.weight" in name:
            return c
    for c in ("ffn_up", "ffn_gate", "ffn_down"):
        if c in name:
            return c
    return "other"


def _holds(cond: str, arg: int, i: int, n: int) -> bool:
    if cond == "all":
        return True
    if cond == "lt":
        return i < arg
    if cond == "lt_n":
        return i < n // arg
    if cond == "more_bits":
        return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2
    raise ValueError(cond)


def block_size(t: QT) -> int:
    return gguf.GGML_QUANT_SIZES[t][0]


def fallback(t: QT, ncols: int) -> QT:
    """llama.cpp's tensor_type_fallback, then F16 when even that does not fit."""
    if ncols % block_size(t) == 0:
        return t
    t = FALLBACK.get(t, t)
    return t if ncols % block_size(t) == 0 else QT.F16


def _llama_order(name: str):
    """llama-quantize visits tensors by layer number (non-layer tensors first), then by name."""
    m = re.match(r"blk\.(\d+)\.", name)
    return (int(m.group(1)) if m else -1, name)


def plan_types(tensors, mix: Mix, n_layer: int, output_type: QT | None = None,
               token_embedding_type: QT | None = None) -> list[QT]:
    """tensors: [(name, numpy shape)] of the quantizable 2-D weights. Returns the ggml type of each
    (llama-quantize's choice), in the order given; per-layer counters run in llama-quantize's order."""
    names = [n for n, _ in tensors]
    tied = "output.weight" not in names
    count = {"attn_v": sum(_category(n) == "attn_v" for n in names), "ffn_down": n_layer}
    seen: dict[str, int] = {}
    chosen: dict[str, QT] = {}
    for name, shape in sorted(tensors, key=lambda t: _llama_order(t[0])):
        cat = _category(name)
        ncols = shape[-1]
        t = mix.base
        if cat == "token_embd" and token_embedding_type is not None:
            t = token_embedding_type
        elif cat == "output" and output_type is not None:
            t = output_type
        elif not mix.pure:
            if cat == "output" or (tied and cat == "token_embd"):
                if output_type is not None:
                    t = output_type
                elif ncols % block_size(mix.base) != 0:
                    t = QT.Q8_0
                elif mix.base != QT.Q8_0:
                    t = QT.Q6_K
            else:
                i = seen.get(cat, 0)
                seen[cat] = i + 1
                for cond, arg, tt in mix.rules.get(cat, ()):
                    if _holds(cond, arg, i, count.get(cat, n_layer)):
                        t = tt
                        break
        chosen[name] = fallback(t, ncols)
    return [chosen[n] for n in names]


# ----------------------------------------------------------------------------------------------
# importance matrix (llama-imatrix output): GGUF with <tensor>.in_sum2 / <tensor>.counts, or the
# legacy .dat layout. Weights per column = in_sum2 / counts, as llama-quantize computes them.
# ----------------------------------------------------------------------------------------------

class ImatrixError(ValueError):
    """A one-line error about an imatrix file."""


def _read_gguf_imatrix(path: Path) -> dict[str, np.ndarray]:
    try:
        r = gguf.GGUFReader(path)
    except Exception as e:  # noqa: BLE001
        raise ImatrixError(f"imatrix {path}: not a readable GGUF ({e})") from None
    f = r.fields.get("general.type")
    kind = bytes(f.parts[-1]).decode("utf-8", "replace") if f is not None else None
    if kind != "imatrix":
        raise ImatrixError(f"imatrix {path}: general.type is {kind!r}, expected 'imatrix' (not an imatrix file)")
    for key in ("imatrix.datasets", "imatrix.chunk_count", "imatrix.chunk_size"):
        if key not in r.fields:
            raise ImatrixError(f"imatrix {path}: missing metadata {key}")
    sums, counts = {}, {}
    for t in r.tensors:
        for suffix, d in ((".in_sum2", sums), (".counts", counts)):
            if t.name.endswith(suffix):
                if t.tensor_type != QT.F32:
                    raise ImatrixError(f"imatrix {path}: {t.name} is {t.tensor_type.name}, expected F32")
                d[t.name[: -len(suffix)]] = np.asarray(t.data, np.float32).reshape(-1)
    if not sums:
        raise ImatrixError(f"imatrix {path}: no <tensor>.in_sum2 entries")
    out = {}
    for name in sorted(set(sums) | set(counts)):
        if name not in sums or name not in counts:
            raise ImatrixError(f"imatrix {path}: {name} has in_sum2 without counts or counts without in_sum2")
        s, c = sums[name], counts[name]
        if c.size == 0 or s.size % c.size:
            raise ImatrixError(f"imatrix {path}: {name}: {s.size} sums do not split over {c.size} counts")
        cnt = (np.floor(np.abs(c) + np.float32(0.5)) * np.sign(c)).astype(np.float32)  # lround, as a float
        per = s.reshape(c.size, -1)
        w = np.where(cnt[:, None] > 0, per / np.where(cnt > 0, cnt, 1)[:, None], np.float32(1))
        out[name] = np.ascontiguousarray(w, np.float32).reshape(-1)
    return out


def _read_legacy_imatrix(path: Path, raw: bytes) -> dict[str, np.ndarray]:
    def bad(what):
        return ImatrixError(f"imatrix {path}: not a GGUF imatrix and not a legacy .dat imatrix ({what})")
    try:
        (n,) = struct.unpack_from("<i", raw, 0)
        if n < 1:
            raise bad("no entries")
        o, out = 4, {}
        for _ in range(n):
            (ln,) = struct.unpack_from("<i", raw, o)
            if ln < 1 or ln > 4096:
                raise bad("bad name length")
            name = raw[o + 4: o + 4 + ln].decode("utf-8")
            o += 4 + ln
            ncall, nval = struct.unpack_from("<ii", raw, o)
            o += 8
            if nval < 1 or o + 4 * nval > len(raw):
                raise bad(f"entry {name!r} truncated")
            s = np.frombuffer(raw, np.float32, nval, o).copy()
            o += 4 * nval
            out[name] = s / np.float32(ncall) if ncall > 0 else s
        return out
    except (struct.error, UnicodeDecodeError):
        raise bad("truncated") from None


def read_imatrix(path) -> dict[str, np.ndarray]:
    """{tensor name: float32 per-column weights} from a llama-imatrix file (GGUF or legacy .dat)."""
    path = Path(path)
    if not path.is_file():
        raise ImatrixError(f"imatrix file not found: {path}")
    with open(path, "rb") as f:
        magic = f.read(4)
    out = _read_gguf_imatrix(path) if magic == b"GGUF" else _read_legacy_imatrix(path, path.read_bytes())
    for name, w in out.items():
        if not np.all(np.isfinite(w)):
            raise ImatrixError(f"imatrix {path}: {name} has non-finite values")
    return out


def imatrix_for(imatrix: dict[str, np.ndarray] | None, name: str, ncols: int) -> np.ndarray | None:
    """The weights for one tensor (None when absent), checked against its row length as llama-quantize
    does (a token_embd mismatch is skipped, any other is an error)."""
    if not imatrix or name not in imatrix:
        return None
    w = imatrix[name]
    if w.size != ncols:
        if name == "token_embd.weight":
            return None
        raise ImatrixError(f"imatrix has {w.size} values for {name}, the tensor has {ncols} columns")
    return w
