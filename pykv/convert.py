"""Model-file tools: HF -> GGUF convert, GGUF requantize, GGUF -> HF export, info.

The GGUF files follow llama.cpp's ``convert_hf_to_gguf.py`` conventions for the
``llama`` architecture: same metadata keys, same tensor names, and the same
row permutation of the Q/K projections (HF "rotate-half" RoPE layout ->
llama.cpp's interleaved-pair layout), so llama.cpp and pykv load them alike.
"""
from __future__ import annotations

import glob
import math
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

from pykv import hf
from pykv.formats import KV_FORMATS, bytes_per_token


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
            from pykv.formats import KV_FORMATS  # type: ignore
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
# tokenizer -> GGUF metadata (llama.cpp converter conventions)
# ----------------------------------------------------------------------------

_TT = gguf.TokenType


def _looks_special(tok: str) -> bool:
    if tok.startswith("<|") and tok.endswith("|>"):
        return True
    return tok in ("<s>", "</s>", "<pad>", "<unk>", "<mask>", "<cls>", "<sep>", "<eos>", "<bos>")


def _vocab_spm(hf_dir: Path, vocab_size: int | None):
    from sentencepiece import SentencePieceProcessor

    sp = SentencePieceProcessor()
    sp.LoadFromFile(str(hf_dir / "tokenizer.model"))
    n = vocab_size or sp.vocab_size()
    tokens = [f"[PAD{i}]".encode() for i in range(n)]
    scores = [-10000.0] * n
    types = [int(_TT.UNUSED)] * n
    for i in range(min(sp.vocab_size(), n)):
        t = _TT.NORMAL
        if sp.IsUnknown(i):
            t = _TT.UNKNOWN
        elif sp.IsControl(i):
            t = _TT.CONTROL
        elif sp.IsUnused(i):
            t = _TT.UNUSED
        elif sp.IsByte(i):
            t = _TT.BYTE
        tokens[i] = sp.IdToPiece(i).encode("utf-8")
        scores[i] = float(sp.GetScore(i))
        types[i] = int(t)
    added = hf_dir / "added_tokens.json"
    if added.is_file():
        for text, tid in hf.read_json(added).items():
            if 0 <= tid < n:
                tokens[tid], scores[tid], types[tid] = text.encode("utf-8"), -1000.0, int(_TT.USER_DEFINED)
    tc = hf_dir / "tokenizer_config.json"
    if tc.is_file():
        for sid, data in (hf.read_json(tc).get("added_tokens_decoder") or {}).items():
            tid = int(sid)
            if not 0 <= tid < n:
                continue
            text = data["content"]
            if data.get("special") or _looks_special(text):
                types[tid] = int(_TT.CONTROL)
            else:
                text = text.replace("\u2581", " ")
                types[tid] = int(_TT.USER_DEFINED)
            scores[tid] = -1000.0
            tokens[tid] = text.encode("utf-8")
    return tokens, scores, types


def _vocab_bpe(tok_json: dict, vocab_size: int | None):
    model = tok_json.get("model") or {}
    vocab: dict[str, int] = model.get("vocab") or {}
    added = tok_json.get("added_tokens") or []
    rev: dict[int, str] = {i: t for t, i in vocab.items()}
    added_special: dict[int, bool] = {}
    for a in added:
        rev[int(a["id"])] = a["content"]
        added_special[int(a["id"])] = bool(a.get("special"))
    n = vocab_size or (max(rev) + 1 if rev else 0)
    if rev and max(rev) >= n:
        raise ConvertError(f"tokenizer has token id {max(rev)} but vocab_size is {n}")
    tokens, types = [], []
    for i in range(n):
        if i not in rev:
            tokens.append(f"[PAD{i}]")
            types.append(int(_TT.UNUSED))
        elif i in added_special:
            tokens.append(rev[i])
            special = added_special[i] or _looks_special(rev[i])
            types.append(int(_TT.CONTROL if special else _TT.USER_DEFINED))
        else:
            tokens.append(rev[i])
            types.append(int(_TT.NORMAL))
    return tokens, types


def _add_vocab(w: gguf.GGUFWriter, hf_dir: Path, cfg: dict) -> None:
    vocab_size = cfg.get("vocab_size")
    tj_path = hf_dir / "tokenizer.json"
    if (hf_dir / "tokenizer.model").is_file():
        tokens, scores, types = _vocab_spm(hf_dir, vocab_size)
        w.add_tokenizer_model("llama")
        w.add_tokenizer_pre("default")
        w.add_token_list(tokens)
        w.add_token_scores(scores)
        w.add_token_types(types)
        gguf.SpecialVocab(hf_dir, n_vocab=len(tokens)).add_to_gguf(w, quiet=True)
    elif tj_path.is_file():
        tj = hf.read_json(tj_path)
        mtype = (tj.get("model") or {}).get("type")
        if mtype != "BPE":
            raise ConvertError(f"unsupported tokenizer.json model type {mtype!r} (only BPE)")
        steps = [s.get("type") for s in hf._flatten_pre(tj.get("pre_tokenizer"))]
        if "ByteLevel" not in steps:
            raise ConvertError("unsupported tokenizer.json: BPE without ByteLevel pre-tokenizer "
                               "(SentencePiece-style tokenizers need tokenizer.model)")
        pre = hf.detect_bpe_pre(tj)
        if pre is None:
            print(f"warning: unrecognized BPE pre-tokenizer {steps}; writing tokenizer.ggml.pre=default",
                  file=sys.stderr)
            pre = "default"
        tokens, types = _vocab_bpe(tj, vocab_size)
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre(pre)
        w.add_token_list(tokens)
        w.add_token_types(types)
        sv = gguf.SpecialVocab(hf_dir, load_merges=True)
        if not sv.merges:
            raise ConvertError("tokenizer.json has no BPE merges")
        pp = tj.get("post_processor") or {}
        if any(p.get("type") == "ByteLevel" for p in pp.get("processors", [pp])):
            # a ByteLevel post-processor adds no BOS/EOS: newer gguf-py (llama.cpp's converter) says so
            sv.add_special_token.setdefault("bos", False)
            sv.add_special_token.setdefault("eos", False)
        sv.add_to_gguf(w, quiet=True)
    else:
        raise ConvertError(f"no tokenizer.json or tokenizer.model in {hf_dir}")
    tc = hf_dir / "tokenizer_config.json"
    if tc.is_file():
        tcj = hf.read_json(tc)
        if "add_prefix_space" in tcj and isinstance(tcj["add_prefix_space"], bool):
            w.add_add_space_prefix(tcj["add_prefix_space"])
    if vocab_size == 49152 and not any(gguf.Keys.Tokenizer.ADD_BOS in kv for kv in w.kv_data):
        w.add_add_bos_token(False)  # llama.cpp: granite/SmolLM small models never add BOS


# ----------------------------------------------------------------------------
# convert HF -> GGUF
# ----------------------------------------------------------------------------

ROPE_TYPES = ("default", "linear", "llama3", "yarn")   # what llama.cpp's converter maps for LLaMA


@dataclass(frozen=True)
class RopeSpec:
    """The RoPE section of a HF LLaMA config, read from either schema and checked."""
    type: str                    # default | linear | llama3 | yarn
    theta: float                 # rope_theta -> llama.rope.freq_base
    factor: float = 1.0          # linear, llama3, yarn: context extension factor
    orig_ctx: int = 0            # llama3, yarn: original_max_position_embeddings
    low_freq_factor: float = 0.0   # llama3
    high_freq_factor: float = 0.0  # llama3
    beta_fast: float | None = None   # yarn, when given
    beta_slow: float | None = None   # yarn, when given
    attn_factor: float | None = None  # yarn: attention_factor given, or from mscale / mscale_all_dim

    def hf_params(self) -> dict:
        """transformers 5's rope_parameters for this spec."""
        d: dict[str, Any] = {"rope_type": self.type, "rope_theta": self.theta}
        if self.type != "default":
            d["factor"] = self.factor
        if self.type in ("llama3", "yarn"):
            d["original_max_position_embeddings"] = self.orig_ctx
        if self.type == "llama3":
            d.update(low_freq_factor=self.low_freq_factor, high_freq_factor=self.high_freq_factor)
        for k, v in (("attention_factor", self.attn_factor), ("beta_fast", self.beta_fast),
                     ("beta_slow", self.beta_slow)):
            if v is not None:
                d[k] = v
        return d


def _num(where: str, v, integer: bool = False, positive: bool = True):
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (integer and not isinstance(v, int)):
        raise ConvertError(f"config.json: {where} must be {'an integer' if integer else 'a number'}, got {v!r}")
    if not math.isfinite(v) or (positive and v <= 0):
        raise ConvertError(f"config.json: {where} must be {'positive' if positive else 'finite'}, got {v!r}")
    return v


def read_rope(cfg: dict) -> RopeSpec:
    """RoPE of a config.json: transformers 4 (top-level rope_theta, rope_scaling with type/rope_type) or
    transformers 5 (rope_parameters with rope_theta and rope_type, possibly per layer type). Missing values
    default only where transformers' LlamaConfig does (rope_theta 10000 without any RoPE section;
    original_max_position_embeddings = max_position_embeddings for llama3 / yarn)."""
    rp, rs = cfg.get("rope_parameters"), cfg.get("rope_scaling")
    if rp is not None and rs is not None and rp != rs:
        raise ConvertError("config.json: both rope_parameters and rope_scaling are set and differ")
    sec, src = (rp, "rope_parameters") if rp is not None else (rs, "rope_scaling")
    if sec is not None and not isinstance(sec, dict):
        raise ConvertError(f"config.json: {src} must be an object, got {sec!r}")
    sec = dict(sec or {})
    nested = [k for k in sec if k.endswith("_attention")]
    if nested:   # per layer type; every LLaMA layer is full attention
        if nested != ["full_attention"] or len(sec) != 1:
            raise ConvertError(f"config.json: {src} per layer type {sorted(sec)} is ambiguous for LLaMA "
                               "(only full_attention layers)")
        lt = cfg.get("layer_types")
        if lt is not None and (not isinstance(lt, list) or any(t != "full_attention" for t in lt)):
            raise ConvertError(f"config.json: layer_types {lt!r} is not all full_attention (LLaMA)")
        src += ".full_attention"
        sec = sec["full_attention"]
        if not isinstance(sec, dict):
            raise ConvertError(f"config.json: {src} must be an object, got {sec!r}")
    top_theta = cfg.get("rope_theta")
    if "rope_theta" in sec:
        theta = _num(f"{src}.rope_theta", sec["rope_theta"])
        if top_theta is not None and top_theta != theta:
            raise ConvertError(f"config.json: rope_theta {top_theta!r} differs from {src}.rope_theta {theta!r}")
    elif top_theta is not None:
        theta = _num("rope_theta", top_theta)
    elif src.startswith("rope_parameters"):
        raise ConvertError(f"config.json: {src} lacks rope_theta")
    else:
        theta = 10000.0   # transformers' LlamaConfig default_theta, for a config without any RoPE base
    t1, t2 = sec.get("rope_type"), sec.get("type")
    if t1 is not None and t2 is not None and t1 != t2:
        raise ConvertError(f"config.json: {src}.rope_type {t1!r} differs from {src}.type {t2!r}")
    typ = t1 if t1 is not None else t2 if t2 is not None else "default"
    if typ not in ROPE_TYPES:
        raise ConvertError(f"config.json: unsupported {src}.rope_type {typ!r} (supported: {', '.join(ROPE_TYPES)})")
    prf = sec.get("partial_rotary_factor", cfg.get("partial_rotary_factor"))
    if prf is not None and _num(f"{src}.partial_rotary_factor", prf) != 1:
        raise ConvertError(f"config.json: {src}.partial_rotary_factor {prf!r} is not supported (LLaMA rotates "
                           "the whole head)")
    if typ == "default":
        return RopeSpec("default", float(theta))

    def need(k, integer=False):
        if sec.get(k) is None:
            raise ConvertError(f"config.json: {src} of type {typ!r} lacks {k}")
        return _num(f"{src}.{k}", sec[k], integer)

    def opt(k):
        return None if sec.get(k) is None else float(_num(f"{src}.{k}", sec[k]))

    factor = float(need("factor"))
    if typ == "linear":
        return RopeSpec("linear", float(theta), factor)
    if sec.get("original_max_position_embeddings") is None:
        sec["original_max_position_embeddings"] = cfg.get("max_position_embeddings")
    orig = int(need("original_max_position_embeddings", integer=True))
    if typ == "llama3":
        lo, hi = float(need("low_freq_factor")), float(need("high_freq_factor"))
        if hi <= lo:
            raise ConvertError(f"config.json: {src}.high_freq_factor {hi} must exceed low_freq_factor {lo}")
        return RopeSpec("llama3", float(theta), factor, orig, lo, hi)
    if sec.get("truncate", True) is not True:
        raise ConvertError(f"config.json: {src}.truncate must be true (GGUF YaRN always truncates the "
                           f"correction range), got {sec['truncate']!r}")
    attn = opt("attention_factor")
    ms, ms_all = opt("mscale"), opt("mscale_all_dim")
    if attn is None and ms and ms_all:   # transformers' _compute_yarn_parameters
        attn = _yarn_mscale(factor, ms) / _yarn_mscale(factor, ms_all)
    return RopeSpec("yarn", float(theta), factor, orig, beta_fast=opt("beta_fast"), beta_slow=opt("beta_slow"),
                    attn_factor=attn)


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def llama3_rope_factors(rope: RopeSpec, n_rot: int) -> np.ndarray:
    """rope_freqs.weight (n_rot/2,) f32: the divisor of each pair's frequency, computed in float32 as
    llama.cpp's converter does (LlamaModel.generate_extra_tensors)."""
    f32 = np.float32
    # theta ** (2i / n_rot) correctly rounded to float32 (libm's double pow, scalar): numpy's float32 power
    # dispatches to SVML on AVX-512 hosts and differs there by an ulp from torch and from AVX2 hosts
    expo = np.arange(0, n_rot, 2, dtype=np.float32) / f32(n_rot)
    freqs = f32(1.0) / np.array([math.pow(float(f32(rope.theta)), float(x)) for x in expo]).astype(np.float32)
    wavelen = f32(2 * math.pi) / freqs
    lo_wl = f32(rope.orig_ctx / rope.low_freq_factor)
    hi_wl = f32(rope.orig_ctx / rope.high_freq_factor)
    smooth = (f32(rope.orig_ctx) / wavelen - f32(rope.low_freq_factor)) / f32(
        rope.high_freq_factor - rope.low_freq_factor)
    mid = f32(1) / ((f32(1) - smooth) / f32(rope.factor) + smooth)
    out = np.where(wavelen < hi_wl, f32(1), np.where(wavelen > lo_wl, f32(rope.factor), mid))
    return out.astype(np.float32)


def convert_hf(hf_dir, out_path, outtype: str = "f16", force: bool = False, progress=None) -> Path:
    hf_dir = Path(hf_dir)
    out_path = Path(out_path)
    outtype = parse_type(outtype, "--outtype")
    if not hf_dir.exists():
        raise ConvertError(f"HF model folder not found: {hf_dir}")
    if not hf_dir.is_dir():
        raise ConvertError(f"{hf_dir} is a file, expected a HF model folder")
    _check_out(out_path, force, [p for p in hf_dir.iterdir() if p.is_file()])
    cfg_path = hf_dir / "config.json"
    if not cfg_path.is_file():
        raise ConvertError(f"no config.json in {hf_dir}")
    cfg = hf.read_json(cfg_path)
    archs = cfg.get("architectures") or []
    if not archs or archs[0] not in SUPPORTED_ARCHS:
        raise ConvertError(f"unsupported architecture {archs[0] if archs else cfg.get('model_type')!r} "
                           f"(supported: {', '.join(SUPPORTED_ARCHS)})")
    try:
        n_layer = int(cfg["num_hidden_layers"])
        n_embd = int(cfg["hidden_size"])
        n_ff = int(cfg["intermediate_size"])
        n_head = int(cfg["num_attention_heads"])
    except KeyError as e:
        raise ConvertError(f"config.json lacks {e.args[0]}") from None
    n_head_kv = int(cfg.get("num_key_value_heads") or n_head)
    head_dim = int(cfg.get("head_dim") or n_embd // n_head)
    if cfg.get("hidden_act", "silu") != "silu":
        raise ConvertError(f"unsupported hidden_act {cfg.get('hidden_act')!r}")
    rope = read_rope(cfg)
    tied = bool(cfg.get("tie_word_embeddings", False))

    try:
        ckpt = hf.HFCheckpoint(hf_dir)
    except hf.SafetensorsError as e:
        raise ConvertError(str(e)) from None

    # map & validate tensor names
    gnames: dict[str, str] = {}
    for name in ckpt.names():
        if _IGNORED.match(name):
            continue
        g = hf_to_gguf_name(name)
        if g is None:
            raise ConvertError(f"unexpected tensor {name!r} (not a LLaMA tensor)")
        m = re.match(r"blk\.(\d+)\.", g)
        if m and int(m.group(1)) >= n_layer:
            raise ConvertError(f"tensor {name!r} beyond num_hidden_layers={n_layer}")
        gnames[name] = g
    required = ["model.embed_tokens.weight", "model.norm.weight"]
    required += [f"model.layers.{i}.{s}" for i in range(n_layer) for s in _LAYER_REQUIRED]
    if not tied:
        required.append("lm_head.weight")
    missing = [n for n in required if n not in ckpt]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ConvertError(f"missing tensor {missing[0]}{more}")
    if tied and "lm_head.weight" in gnames:
        del gnames["lm_head.weight"]
    for name in ckpt.names():
        if name in gnames and ckpt.dtype(name) not in ("F32", "F16", "BF16"):
            raise ConvertError(f"tensor {name}: unsupported dtype {ckpt.dtype(name)}")

    vocab_size = int(cfg.get("vocab_size") or ckpt.shape("model.embed_tokens.weight")[0])
    if ckpt.shape("model.embed_tokens.weight") != (vocab_size, n_embd):
        raise ConvertError(f"embed_tokens shape {ckpt.shape('model.embed_tokens.weight')} "
                           f"does not match vocab_size={vocab_size}, hidden_size={n_embd}")
    target = WEIGHT_TYPES[outtype]

    def order_key(item):
        g = item[1]
        m = re.match(r"blk\.(\d+)\.", g)
        if g == "token_embd.weight":
            return (0, 0, g)
        if m:
            return (1, int(m.group(1)), g)
        return (2, 0 if g == "output_norm.weight" else 1, g)

    planned: list[_PlannedTensor] = []
    if rope.type == "llama3":
        rope_factors = llama3_rope_factors(rope, head_dim)
        planned.append(_PlannedTensor("rope_freqs.weight", rope_factors.shape, QT.F32,
                                      (lambda a=rope_factors: a)))
    for hname, g in sorted(gnames.items(), key=order_key):
        shape = ckpt.shape(hname)
        if _keeps_f32(g, len(shape)):
            qt = QT.F32
        elif not _can_use(target, shape[-1]):
            qt = QT.F16
            print(f"warning: {g}: row length {shape[-1]} not a multiple of the {outtype} block, using f16",
                  file=sys.stderr)
        else:
            qt = target
        perm = None
        if hname.endswith(("q_proj.weight", "q_proj.bias")):
            perm = n_head
        elif hname.endswith(("k_proj.weight", "k_proj.bias")):
            perm = n_head_kv

        def produce(hname=hname, qt=qt, perm=perm):
            x = np.asarray(ckpt.get(hname), dtype=np.float32)
            if perm is not None:
                x = permute_qk(x, perm)
            return encode(x, qt)
        planned.append(_PlannedTensor(g, tuple(shape), qt, produce))

    def setup(w: gguf.GGUFWriter) -> None:
        w.add_type("model")
        name = str(cfg.get("_name_or_path") or "").rstrip("/").split("/")[-1] or hf_dir.resolve().name
        w.add_name(name)
        arch = "llama"
        w.add_block_count(n_layer)
        w.add_context_length(int(cfg.get("max_position_embeddings") or cfg.get("max_sequence_length") or 2048))
        w.add_embedding_length(n_embd)
        w.add_feed_forward_length(n_ff)
        w.add_head_count(n_head)
        w.add_head_count_kv(n_head_kv)
        w.add_rope_freq_base(rope.theta)
        w.add_layer_norm_rms_eps(float(cfg.get("rms_norm_eps", 1e-6)))
        if cfg.get("head_dim") is not None:
            w.add_key_length(head_dim)
            w.add_value_length(head_dim)
        w.add_file_type(int(FILE_TYPES[outtype]))
        w.add_vocab_size(vocab_size)
        w.add_rope_dimension_count(head_dim)
        if rope.type in ("linear", "yarn"):   # llama.cpp's TextModel.set_gguf_parameters
            w.add_rope_scaling_type(gguf.RopeScalingType(rope.type))
            w.add_rope_scaling_factor(rope.factor)
        if rope.type == "yarn":
            w.add_rope_scaling_orig_ctx_len(rope.orig_ctx)
            if rope.attn_factor is not None:
                w.add_rope_scaling_yarn_attn_factor(rope.attn_factor)
            if rope.beta_fast is not None:
                w.add_rope_scaling_yarn_beta_fast(rope.beta_fast)
            if rope.beta_slow is not None:
                w.add_rope_scaling_yarn_beta_slow(rope.beta_slow)
        assert arch == w.arch
        _add_vocab(w, hf_dir, cfg)
        w.add_quantization_version(gguf.GGML_QUANT_VERSION)

    return _write_gguf(out_path, setup, "llama", planned, force, progress, "convert")


# ----------------------------------------------------------------------------
# GGUF reading helpers
# ----------------------------------------------------------------------------

def _open_gguf(path) -> gguf.GGUFReader:
    """gguf-py's reader over a file pykv's own parser accepted first (bounds-checked header, tensor
    data inside the file, in order: a hostile file gets a one-line PykvError, not gguf-py's exception)."""
    from pykv.gguf_io import GGUFFile
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


# ----------------------------------------------------------------------------
# quantize GGUF -> GGUF
# ----------------------------------------------------------------------------

def parse_quant_type(name: str) -> str:
    """A `pykv quantize` target: a plain type (every weight in it) or a llama-quantize mix name."""
    from pykv.quant_plan import MIXES
    n = str(name).strip().lower()
    if n not in MIXES:
        raise ConvertError(f"unsupported type {name!r} (choose from {', '.join(MIXES)})")
    return n


def quantize_plan(r: gguf.GGUFReader, qtype: str, output_type=None, token_embedding_type=None) -> dict[str, QT]:
    """{tensor name: ggml type} that `pykv quantize` writes (llama-quantize's choice for a mix)."""
    from pykv.quant_plan import MIXES, plan_types
    mix = MIXES[parse_quant_type(qtype)]
    otype = WEIGHT_TYPES[parse_type(output_type, "--output-type")] if output_type else None
    etype = WEIGHT_TYPES[parse_type(token_embedding_type, "--token-embedding-type")] if token_embedding_type else None
    arch = _field_value(r.fields["general.architecture"]) if "general.architecture" in r.fields else "?"
    f = r.fields.get(f"{arch}.block_count")
    n_layer = int(_field_value(f)) if f is not None else 0
    weights = [(rt.name, _tensor_shape(rt)) for rt in r.tensors
               if not _keeps_f32(rt.name, len(_tensor_shape(rt)))]
    plan = {rt.name: QT.F32 for rt in r.tensors}
    plan.update(zip([n for n, _ in weights], plan_types(weights, mix, n_layer, otype, etype)))
    return plan


def quantize_gguf(in_path, out_path, qtype, output_type=None, token_embedding_type=None,
                  force: bool = False, progress=None, imatrix=None) -> Path:
    """Requantize a llama GGUF to a plain type or a llama-quantize mix (see pykv.quant_plan);
    imatrix: a llama-imatrix file whose per-column weights steer the K / q4_0..q5_1 quantizers."""
    from pykv.quant_plan import MIXES, ImatrixError, imatrix_for, read_imatrix
    in_path, out_path = Path(in_path), Path(out_path)
    qtype = parse_quant_type(qtype)
    _check_out(out_path, force, [in_path] + ([imatrix] if imatrix else []))
    r = _open_gguf(in_path)
    arch = _field_value(r.fields["general.architecture"]) if "general.architecture" in r.fields else "?"
    if arch != "llama":
        raise ConvertError(f"unsupported architecture {arch!r} (only llama)")
    plan = quantize_plan(r, qtype, output_type, token_embedding_type)
    try:
        imat = read_imatrix(imatrix) if imatrix is not None else None
        qws = {rt.name: imatrix_for(imat, rt.name, _tensor_shape(rt)[-1]) for rt in r.tensors
               if plan[rt.name] != QT.F32}
    except ImatrixError as e:
        raise ConvertError(str(e)) from None
    if imat is not None and not any(w is not None for w in qws.values()):
        raise ConvertError(f"imatrix {imatrix} has no entry for any tensor of {in_path.name}")

    planned: list[_PlannedTensor] = []
    for rt in r.tensors:
        shape = _tensor_shape(rt)
        want = plan[rt.name]
        src = rt.tensor_type

        def produce(rt=rt, src=src, want=want, shape=shape, qw=qws.get(rt.name)):
            if src == want:
                return np.ascontiguousarray(rt.data)
            return encode(decode(rt.data, src).reshape(shape), want, qw=qw)
        planned.append(_PlannedTensor(rt.name, shape, want, produce))

    def setup(w: gguf.GGUFWriter) -> None:
        for key, f in r.fields.items():
            if key.startswith("GGUF.") or key in ("general.architecture", "general.file_type",
                                                   "general.quantization_version"):
                continue
            if key == "general.alignment":
                continue
            _copy_field(w, key, f)
            if key == f"{arch}.rope.dimension_count":
                pass
        w.add_file_type(int(MIXES[qtype].file_type))
        w.add_quantization_version(gguf.GGML_QUANT_VERSION)

    return _write_gguf(out_path, setup, arch, planned, force, progress, "quantize")


# ----------------------------------------------------------------------------
# export GGUF -> HF
# ----------------------------------------------------------------------------

def _tokenizer_files(md: dict, n_vocab: int) -> dict[str, Any]:
    """Build HF tokenizer files from GGUF tokenizer metadata. Returns {filename: json-obj|bytes}."""
    model = md.get("tokenizer.ggml.model")
    tokens = md.get("tokenizer.ggml.tokens")
    if not tokens:
        raise ConvertError("GGUF has no tokenizer.ggml.tokens")
    tokens = [t if isinstance(t, str) else t.decode("utf-8", "replace") for t in tokens]
    types = md.get("tokenizer.ggml.token_type") or [int(_TT.NORMAL)] * len(tokens)
    ids = {k: md.get(f"tokenizer.ggml.{key}_token_id")
           for k, key in (("bos", "bos"), ("eos", "eos"), ("unk", "unknown"), ("pad", "padding"))}
    add_bos = md.get("tokenizer.ggml.add_bos_token")
    add_eos = md.get("tokenizer.ggml.add_eos_token")
    add_space = md.get("tokenizer.ggml.add_space_prefix")
    files: dict[str, Any] = {}

    special_ids = {i for i, t in enumerate(types) if t == _TT.CONTROL}
    special_ids |= {v for v in ids.values() if v is not None and 0 <= v < len(tokens)}
    user_ids = {i for i, t in enumerate(types) if t == _TT.USER_DEFINED}

    def added_entry(i: int) -> dict:
        return {"id": i, "content": tokens[i], "single_word": False, "lstrip": False, "rstrip": False,
                "normalized": i not in special_ids, "special": i in special_ids}

    added_ids = sorted(special_ids | user_ids)
    tcfg: dict[str, Any] = {
        "added_tokens_decoder": {str(i): {k: v for k, v in added_entry(i).items() if k != "id"}
                                 for i in added_ids},
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(md.get("llama.context_length") or 2048),
    }
    for k in ("bos", "eos", "unk", "pad"):
        if ids[k] is not None and 0 <= ids[k] < len(tokens):
            tcfg[f"{k}_token"] = tokens[ids[k]]
    if add_bos is not None:
        tcfg["add_bos_token"] = bool(add_bos)
    if add_eos is not None:
        tcfg["add_eos_token"] = bool(add_eos)
    if add_space is not None:
        tcfg["add_prefix_space"] = bool(add_space)
    if md.get("tokenizer.chat_template"):
        tcfg["chat_template"] = md["tokenizer.chat_template"]

    if model == "gpt2":
        merges = md.get("tokenizer.ggml.merges") or []
        merges = [m if isinstance(m, str) else m.decode("utf-8", "replace") for m in merges]
        added_set = set(added_ids)
        vocab = {}
        for i, t in enumerate(tokens):
            if i in added_set or types[i] == _TT.UNUSED and t == f"[PAD{i}]":
                continue
            vocab.setdefault(t, i)
        pre = md.get("tokenizer.ggml.pre") or "default"
        if add_bos and ids["bos"] is not None:
            bos = tokens[ids["bos"]]
            post = {"type": "TemplateProcessing",
                    "single": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
                    "pair": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                             {"SpecialToken": {"id": bos, "type_id": 1}}, {"Sequence": {"id": "B", "type_id": 1}}],
                    "special_tokens": {bos: {"id": bos, "ids": [ids["bos"]], "tokens": [bos]}}}
        else:
            post = {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": False, "use_regex": True}
        files["tokenizer.json"] = {
            "version": "1.0", "truncation": None, "padding": None,
            "added_tokens": [added_entry(i) for i in added_ids],
            "normalizer": None,
            "pre_tokenizer": hf.pre_tokenizer_for(pre),
            "post_processor": post,
            "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
            "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                      "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
                      "ignore_merges": False, "vocab": vocab, "merges": merges},
        }
        tcfg["tokenizer_class"] = "GPT2Tokenizer"
        if add_space is None:
            tcfg["add_prefix_space"] = False
    elif model == "llama":
        scores = md.get("tokenizer.ggml.scores") or [0.0] * len(tokens)
        pieces = []
        for i, t in enumerate(tokens):
            typ = int(types[i]) if i < len(types) else 1
            if typ not in (1, 2, 3, 4, 5, 6):
                typ = 1
            pieces.append((t.encode("utf-8"), float(scores[i]), typ))
        has_bytes = any(p[2] == _TT.BYTE for p in pieces)

        def sid(k, default):
            v = ids[k]
            return int(v) if v is not None else default
        unk = sid("unk", 0)
        if not (0 <= unk < len(pieces)) or pieces[unk][2] != _TT.UNKNOWN:
            unk = next((i for i, p in enumerate(pieces) if p[2] == _TT.UNKNOWN), 0)
        files["tokenizer.model"] = hf.build_spm_model(
            pieces, model_type=2, unk_id=unk, bos_id=sid("bos", -1), eos_id=sid("eos", -1),
            pad_id=sid("pad", -1), add_dummy_prefix=True if add_space is None else bool(add_space),
            byte_fallback=has_bytes)
        tcfg["tokenizer_class"] = "LlamaTokenizer"
        tcfg["legacy"] = True
        # every token, CONTROL/USER_DEFINED ones included, is a piece of tokenizer.model itself;
        # listing them again as added tokens would change their scores on a re-convert
        tcfg.pop("added_tokens_decoder")
        tcfg.pop("add_prefix_space", None)
        if add_bos is None:
            tcfg["add_bos_token"] = True
    else:
        raise ConvertError(f"unsupported tokenizer model {model!r}")
    files["tokenizer_config.json"] = tcfg
    stm = {f"{k}_token": tcfg[f"{k}_token"] for k in ("bos", "eos", "unk", "pad") if f"{k}_token" in tcfg}
    files["special_tokens_map.json"] = stm
    return files


def _f32_repr(v: float) -> float:
    """Shortest decimal that reads back as the same float32 (1e-05, not 9.99999974e-06)."""
    return float(str(np.float32(v)))


def rope_from_gguf(md: dict, freqs: np.ndarray | None, n_rot: int) -> RopeSpec:
    """The HF RoPE section of a GGUF: metadata as llama.cpp reads it; Llama 3's parameters recovered from
    rope_freqs.weight (only the ratios original_max_position_embeddings / low_freq_factor and / high_freq_factor
    are fixed by the factors: low_freq_factor is taken as 1), accepted only if they regenerate the tensor exactly."""
    theta = _f32_repr(md.get("llama.rope.freq_base", 10000.0))
    scaling = md.get("llama.rope.scaling.type", "linear")
    factor = _f32_repr(md.get("llama.rope.scaling.factor") or 1.0)
    if scaling not in ("none", "linear", "yarn"):
        raise ConvertError(f"cannot export RoPE scaling type {scaling!r} (none, linear, yarn)")
    if freqs is not None:
        if scaling != "none" and factor != 1.0:
            raise ConvertError(f"cannot export rope_freqs.weight together with {scaling} scaling")
        return _fit_llama3(np.asarray(freqs, np.float32), theta, n_rot)
    if scaling == "yarn":
        def opt(k):
            v = md.get(f"llama.rope.scaling.{k}")
            return None if v is None else _f32_repr(v)
        orig = md.get("llama.rope.scaling.original_context_length") or md.get("llama.context_length")
        if not orig:
            raise ConvertError("GGUF lacks llama.rope.scaling.original_context_length for YaRN")
        return RopeSpec("yarn", theta, factor, int(orig), beta_fast=opt("yarn_beta_fast"),
                        beta_slow=opt("yarn_beta_slow"), attn_factor=opt("yarn_attn_factor"))
    if scaling == "linear" and factor != 1.0:
        return RopeSpec("linear", theta, factor)
    return RopeSpec("default", theta)


def _fit_llama3(ff: np.ndarray, theta: float, n_rot: int) -> RopeSpec:
    # rope_freqs = 1 (short wavelengths), factor (long), and 1 / ((1 - s) / factor + s) between, where
    # s = (orig / wavelen - low) / (high - low) is linear in 1 / wavelen: two points of that band fix it
    if ff.shape != (n_rot // 2,):
        raise ConvertError(f"rope_freqs.weight has {ff.size} factors, expected {n_rot // 2}")
    fail = "cannot recover llama3 rope parameters from rope_freqs.weight"
    factor = float(ff[-1])
    band = (ff != 1.0) & (ff != ff[-1])
    if factor <= 1.0 or band.sum() < 2:
        raise ConvertError(f"{fail} (needs factors 1, a smoothing band of >= 2 pairs, then the factor)")
    inv_wl = 1.0 / (2 * math.pi * theta ** (np.arange(0, n_rot, 2, dtype=np.float64) / n_rot))
    s = (1.0 / ff[band].astype(np.float64) - 1.0 / factor) / (1.0 - 1.0 / factor)
    P, Q = np.polyfit(inv_wl[band], s, 1)      # s = P / wavelen - Q, P = orig / (high - low), Q = low / (high - low)
    P, Q = float(P), -float(Q)
    if not (P > 0 and Q > 0):
        raise ConvertError(f"{fail} (the smoothing band does not fit)")
    orig, high = P / Q, 1.0 + 1.0 / Q
    spec = RopeSpec("llama3", theta, _f32_repr(factor), int(round(orig)), 1.0, float(f"{high:.6g}"))
    if not np.array_equal(llama3_rope_factors(spec, n_rot), ff):
        raise ConvertError(f"{fail} (the best fit, {spec.hf_params()}, does not reproduce it exactly)")
    return spec


def export_hf(in_path, out_dir, dtype: str = "f16", force: bool = False, progress=None) -> Path:
    in_path, out_dir = Path(in_path), Path(out_dir)
    dtype = str(dtype).lower()
    if dtype not in ("f16", "f32", "bf16"):
        raise ConvertError(f"unsupported export dtype {dtype!r} (f16, f32 or bf16)")
    r = _open_gguf(in_path)
    md = gguf_metadata(r)
    arch = md.get("general.architecture")
    if arch != "llama":
        raise ConvertError(f"unsupported architecture {arch!r} (only llama)")
    if out_dir.exists() and not out_dir.is_dir():
        raise ConvertError(f"output exists and is not a folder: {out_dir}")

    def need(k):
        if f"llama.{k}" not in md:
            raise ConvertError(f"GGUF lacks llama.{k}")
        return md[f"llama.{k}"]
    n_layer = int(need("block_count"))
    n_embd = int(need("embedding_length"))
    n_head = int(need("attention.head_count"))
    n_head_kv = int(md.get("llama.attention.head_count_kv") or n_head)
    head_dim = int(md.get("llama.attention.key_length") or n_embd // n_head)
    names = {t.name: t for t in r.tensors}
    if "token_embd.weight" not in names:
        raise ConvertError("missing tensor token_embd.weight")
    n_vocab = _tensor_shape(names["token_embd.weight"])[0]
    tied = "output.weight" not in names
    unknown = [n for n in names if gguf_to_hf_name(n) is None and n != "rope_freqs.weight"]
    if unknown:
        raise ConvertError(f"unexpected tensor {unknown[0]!r}")
    required = ["token_embd.weight", "output_norm.weight"] + [
        f"blk.{i}.{_LAYER_MAP[s]}" for i in range(n_layer) for s in _LAYER_REQUIRED]
    missing = [n for n in required if n not in names]
    if missing:
        raise ConvertError(f"missing tensor {missing[0]}")

    tok_files = _tokenizer_files(md, n_vocab)

    cfg: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_act": "silu",
        "hidden_size": n_embd,
        "intermediate_size": int(need("feed_forward_length")),
        "num_hidden_layers": n_layer,
        "num_attention_heads": n_head,
        "num_key_value_heads": n_head_kv,
        "max_position_embeddings": int(md.get("llama.context_length") or 2048),
        "rms_norm_eps": _f32_repr(md.get("llama.attention.layer_norm_rms_epsilon") or 1e-5),
        "vocab_size": n_vocab,
        "tie_word_embeddings": tied,
        "attention_bias": "blk.0.attn_q.bias" in names,
        "mlp_bias": "blk.0.ffn_up.bias" in names,
        "initializer_range": 0.02,
        "pretraining_tp": 1,
        "use_cache": True,
        "torch_dtype": {"f16": "float16", "f32": "float32", "bf16": "bfloat16"}[dtype],
    }
    if md.get("general.name"):
        cfg["_name_or_path"] = str(md["general.name"])
    if md.get("llama.attention.key_length") is not None or head_dim * n_head != n_embd:
        cfg["head_dim"] = head_dim
    freqs = _tensor_f32(names["rope_freqs.weight"]).reshape(-1) if "rope_freqs.weight" in names else None
    cfg["rope_parameters"] = rope_from_gguf(md, freqs, int(md.get("llama.rope.dimension_count") or head_dim)).hf_params()
    for k, key in (("bos", "bos"), ("eos", "eos"), ("pad", "padding")):
        v = md.get(f"tokenizer.ggml.{key}_token_id")
        if v is not None:
            cfg[f"{k}_token_id"] = int(v)

    # plan output files
    outputs = ["config.json", "model.safetensors", "generation_config.json"] + list(tok_files)
    for fn in outputs:
        if _same_file(out_dir / fn, in_path):
            raise ConvertError(f"output {out_dir / fn} is the input {in_path}: export to another folder")
        if (out_dir / fn).is_dir():
            raise ConvertError(f"output is a directory: {out_dir / fn}")
        if not force and (out_dir / fn).exists():
            raise ConvertError(f"output exists: {out_dir / fn} (use --force)")
    out_dir.mkdir(parents=True, exist_ok=True)

    np_dtype = {"f16": np.float16, "f32": np.float32, "bf16": np.uint16}[dtype]
    tensors: dict[str, np.ndarray] = {}
    st_dtypes: dict[str, str] = {}
    bar = _Bar(_want_progress(progress), sum(int(t.n_bytes) for t in r.tensors), "export")
    try:
        for rt in r.tensors:
            hname = gguf_to_hf_name(rt.name)
            bar.update(int(rt.n_bytes), rt.name)
            if hname is None:
                continue
            x = _tensor_f32(rt)
            if rt.name.endswith(("attn_q.weight", "attn_q.bias")):
                x = unpermute_qk(x, n_head)
            elif rt.name.endswith(("attn_k.weight", "attn_k.bias")):
                x = unpermute_qk(x, n_head_kv)
            if dtype == "bf16":
                tensors[hname] = hf.f32_to_bf16_bits(x)
                st_dtypes[hname] = "BF16"
            else:
                tensors[hname] = x.astype(np_dtype)
    finally:
        bar.close()

    def put(fn: str, writer: Callable[[Path], None]) -> None:
        tmp = _tmp_path(out_dir / fn)
        try:
            writer(tmp)
            _test_pause()
            os.replace(tmp, out_dir / fn)
        except BaseException:
            try:
                tmp.unlink()
            except FileNotFoundError:
                pass
            raise

    def put_st(p: Path) -> None:
        hf.write_safetensors(p, tensors, {"format": "pt"}, st_dtypes)
        back = hf.SafetensorsFile(p)
        if sorted(back.keys()) != sorted(tensors) or any(
                back.shape(k) != tensors[k].shape for k in tensors):
            raise ConvertError("written model.safetensors does not read back")

    put("model.safetensors", put_st)
    put("config.json", lambda p: hf.write_json(p, cfg))
    gen = {k: cfg[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in cfg}
    put("generation_config.json", lambda p: hf.write_json(p, gen))
    for fn, content in tok_files.items():
        if isinstance(content, bytes):
            put(fn, lambda p, c=content: p.write_bytes(c))
        else:
            put(fn, lambda p, c=content: hf.write_json(p, c))
    return out_dir


# ----------------------------------------------------------------------------
# info
# ----------------------------------------------------------------------------

def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} GiB"


def info(path) -> str:
    r = _open_gguf(path)
    md = gguf_metadata(r)
    lines = [f"file: {path}", f"GGUF version: {_field_value(r.fields['GGUF.version']) if 'GGUF.version' in r.fields else '?'}",
             "", "metadata:"]
    for k, v in md.items():
        if isinstance(v, list):
            head = ", ".join(repr(x) for x in v[:4])
            s = f"[{len(v)} items] {head}{', ...' if len(v) > 4 else ''}"
        elif isinstance(v, str) and (len(v) > 120 or "\n" in v):
            s = repr(v[:100]) + f"... ({len(v)} chars)"
        else:
            s = repr(v)
        lines.append(f"  {k} = {s}")
    lines += ["", "tensors:", f"  {'name':<28} {'type':<6} {'shape (rows x cols)':<20} {'bytes':>12}"]
    total_b = total_p = 0
    by_type: dict[str, int] = {}
    for t in r.tensors:
        shape = _tensor_shape(t)
        n = int(np.prod(shape))
        total_p += n
        total_b += int(t.n_bytes)
        by_type[t.tensor_type.name] = by_type.get(t.tensor_type.name, 0) + 1
        lines.append(f"  {t.name:<28} {t.tensor_type.name:<6} {'x'.join(map(str, shape)):<20} {int(t.n_bytes):>12}")
    lines += ["", f"totals: {len(r.tensors)} tensors, {total_p:,} parameters, {total_b:,} bytes "
                  f"({_fmt_bytes(total_b)}), {8 * total_b / max(total_p, 1):.2f} bits/weight",
              "  tensor types: " + ", ".join(f"{k}={v}" for k, v in sorted(by_type.items()))]
    arch = md.get("general.architecture", "llama")
    n_layer = md.get(f"{arch}.block_count")
    n_head = md.get(f"{arch}.attention.head_count")
    n_embd = md.get(f"{arch}.embedding_length")
    if n_layer and n_head and n_embd:
        n_kv = md.get(f"{arch}.attention.head_count_kv") or n_head
        kd = md.get(f"{arch}.attention.key_length") or n_embd // n_head
        vd = md.get(f"{arch}.attention.value_length") or n_embd // n_head
        n_ctx = md.get(f"{arch}.context_length")
        lines += ["", f"KV cache per token ({n_layer} layers x {n_kv} KV heads x (K {kd} + V {vd})):"]
        for kvt in KV_INFO_TYPES:
            try:
                per_tok = bytes_per_token(kvt, kvt, n_layer, n_kv, kd, head_dim_v=vd)
            except ValueError:          # head size not a whole number of blocks: the table's nominal rate
                per_tok = n_layer * n_kv * (kd + vd) * KV_FORMATS[kvt].bits / 8
            extra = f"   ({_fmt_bytes(per_tok * n_ctx)} at n_ctx={n_ctx})" if n_ctx else ""
            bits = 8 * per_tok / (n_layer * n_kv * (kd + vd))
            lines.append(f"  {kvt:<9} {per_tok:>10.1f} bytes  {bits:5.2f} bits/value{extra}")
        lines.append("  (klt types hold keys only: their rows count the values in the nl type of the same bits;"
                     " int4 / int2 add their f16 window of the newest tokens)")
    return "\n".join(lines)


# ----------------------------------------------------------------------------
# CLI
# ----------------------------------------------------------------------------

def _run(fn: Callable[[], Any]) -> int:
    """Run a subcommand; a ConvertError reaches pykv.cli.main, the one place that formats errors."""
    res = fn()
    if isinstance(res, str):
        print(res)
    return 0


def _cmd_convert(a) -> int:
    def go():
        p = convert_hf(a.hf_dir, a.out, outtype=a.outtype, force=a.force)
        print(f"wrote {p}", file=sys.stderr)
    return _run(go)


def _cmd_quantize(a) -> int:
    def go():
        p = quantize_gguf(a.input, a.out, a.type, output_type=a.output_type,
                          token_embedding_type=a.token_embedding_type, force=a.force, imatrix=a.imatrix)
        print(f"wrote {p}", file=sys.stderr)
    return _run(go)


def _cmd_export(a) -> int:
    def go():
        p = export_hf(a.input, a.out_dir, dtype=a.dtype, force=a.force)
        print(f"wrote {p}", file=sys.stderr)
    return _run(go)


def _cmd_info(a) -> int:
    return _run(lambda: info(a.model))


def register_cli(subparsers) -> None:
    p = subparsers.add_parser("convert", help="convert a HF LLaMA checkpoint to GGUF",
                              description="Convert a HF LLaMA/Mistral checkpoint (config.json + safetensors + "
                                          "tokenizer) to GGUF, as llama.cpp's converter writes it.")
    p.add_argument("hf_dir", help="HF model folder")
    p.add_argument("out", help="output .gguf")
    p.add_argument("--outtype", default="f16", type=str.lower, choices=list(WEIGHT_TYPES),
                   help="type of the 2-D weights (default f16; norms stay f32)")
    p.add_argument("--force", action="store_true", help="overwrite an existing output")
    p.set_defaults(func=_cmd_convert)

    from pykv.quant_plan import MIXES
    p = subparsers.add_parser("quantize", help="requantize the 2-D weights of a GGUF",
                              description="Requantize the 2-D weights of a GGUF model: a plain type (every "
                                          f"weight in it: {', '.join(n for n, m in MIXES.items() if m.pure)}) "
                                          "or a llama-quantize mix (q3_k_m, q4_k_s, q4_k_m, q5_k_m, q6_k), "
                                          "with llama.cpp's per-tensor choices and fallbacks.")
    p.add_argument("input", help="input .gguf")
    p.add_argument("out", help="output .gguf")
    p.add_argument("type", type=str.lower, choices=list(MIXES), help="target type or mix")
    p.add_argument("--imatrix", help="importance matrix written by llama-imatrix (GGUF or legacy .dat)")
    p.add_argument("--output-type", "--output-tensor-type", dest="output_type", type=str.lower,
                   choices=list(WEIGHT_TYPES), help="type for output.weight")
    p.add_argument("--token-embedding-type", dest="token_embedding_type", type=str.lower,
                   choices=list(WEIGHT_TYPES), help="type for token_embd.weight")
    p.add_argument("--force", action="store_true", help="overwrite an existing output")
    p.set_defaults(func=_cmd_quantize)

    p = subparsers.add_parser("export", help="export a GGUF back to a HF folder",
                              description="Export a GGUF LLaMA model to HF format (config.json, "
                                          "model.safetensors, tokenizer files).")
    p.add_argument("input", help="input .gguf")
    p.add_argument("out_dir", help="output folder")
    p.add_argument("--dtype", default="f16", type=str.lower, choices=["f16", "f32", "bf16"],
                   help="safetensors dtype (default f16)")
    p.add_argument("--force", action="store_true", help="overwrite existing files")
    p.set_defaults(func=_cmd_export)

    p = subparsers.add_parser("info", help="show GGUF metadata, tensors and KV cache sizes")
    p.add_argument("model", help=".gguf file")
    p.set_defaults(func=_cmd_info)
