"""Structure-aware fuzzer for pykv's input parsers: `python tools/fuzz.py --target gguf --n 10000`.

Each case is a mutated copy of a small valid seed input, run in a worker process (a pool of --jobs
workers; the parent is the watchdog). A case FAILS when it
  crashes        the worker dies by a signal (segfault, abort, the OOM killer),
  hangs          no answer within --timeout seconds (the worker is killed and replaced),
  raises         anything but PykvError and its subclasses (a "foreign" exception: a traceback for a user),
  allocates      a tracemalloc peak above the seed's peak plus ALLOC_PER_BYTE x the input's size
                 (a length field believed before it was checked against the file).
A case that raises a PykvError or runs to the end passes. Failing inputs are written to --save
(default tests/data/fuzz/) under a name made of their hash; tests/files/test_fuzz.py replays every file
there and expects a clean PykvError. Exit status: 0 when no case failed, 1 otherwise.

Targets live in TARGETS; adding one is one function decorated with @target(name) that returns a
Target (seed inputs, a mutator, a runner), or raises Skip with the reason it cannot run yet.
    gguf   model files: header counts, metadata keys / types / values / lengths, tensor infos (dims,
           types, offsets), NaN/inf/0/-1 floats, truncation, bit flips; runner: pykv.load + forward + generate
    state  session state files (pykv.api.session.Session.save / Session.load(model, path)); skipped until
           pykv.api.session exists
    http   request bodies for the HTTP server; skipped until pykv has one
Case i of a run is a function of (--seed, i) alone: `--replay i` reruns one case in this process.
"""
from __future__ import annotations

import argparse
import hashlib
import math
import multiprocessing as mp
import os
import random
import struct
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from multiprocessing.connection import wait
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

SAVE_DIR = ROOT / "tests" / "data" / "fuzz"
ALLOC_PER_BYTE = 16      # a parser may hold a few Python objects per input byte; more is a believed length
START_TIMEOUT = 120.0    # a worker's imports (and a first Numba cache load)


class Skip(Exception):
    """A target that cannot run here (its module does not exist yet): the message says why."""


@dataclass
class Target:
    seeds: list[bytes]                                   # valid inputs the mutations start from
    mutate: Callable[[random.Random, bytes], bytes]      # one mutated input
    run: Callable[[str, object], None]                   # load / parse / use the file at this path, with an option
    suffix: str = ".bin"
    options: tuple = (None,)                             # run options a case draws from (gguf: KV cache types)
    warm: Callable[[Path], None] | None = None           # run once in a child before the timed cases


TARGETS: dict[str, Callable[[Path], Target]] = {}


def target(name: str):
    def reg(fn):
        TARGETS[name] = fn
        return fn
    return reg


# ---- generic byte mutations ------------------------------------------------------------------------------

def flip_bits(rng: random.Random, b: bytes, lo: int = 0, hi: int | None = None) -> bytes:
    a = bytearray(b)
    hi = len(a) if hi is None else min(hi, len(a))
    for _ in range(rng.choice((1, 1, 2, 4, 8))):
        if hi > lo:
            a[rng.randrange(lo, hi)] ^= 1 << rng.randrange(8)
    return bytes(a)


def truncate(rng: random.Random, b: bytes, hi: int | None = None) -> bytes:
    return b[:rng.randrange(0, (hi or len(b)) + 1)]


def splat(rng: random.Random, b: bytes, lo: int = 0, hi: int | None = None) -> bytes:
    """Overwrite a few bytes with 0x00, 0xff or random bytes."""
    a = bytearray(b)
    hi = len(a) if hi is None else min(hi, len(a))
    if hi <= lo:
        return b
    i = rng.randrange(lo, hi)
    n = min(rng.choice((1, 2, 4, 8)), len(a) - i)
    fill = rng.choice((b"\x00" * n, b"\xff" * n, bytes(rng.randrange(256) for _ in range(n))))
    a[i:i + n] = fill
    return bytes(a)


# ---- GGUF structure ---------------------------------------------------------------------------------------
# A parsed GGUF keeps each metadata value as its type id and raw payload bytes, so a mutation can change
# a value, its type, or only the type id in front of the same bytes (a misparse), and re-serialize.

GT_U8, GT_I8, GT_U16, GT_I16, GT_U32, GT_I32, GT_F32, GT_BOOL, GT_STR, GT_ARR, GT_U64, GT_I64, GT_F64 = range(13)
SCALAR_FMT = {GT_U8: "<B", GT_I8: "<b", GT_U16: "<H", GT_I16: "<h", GT_U32: "<I", GT_I32: "<i", GT_F32: "<f",
              GT_BOOL: "<?", GT_U64: "<Q", GT_I64: "<q", GT_F64: "<d"}
INT_TYPES = (GT_U8, GT_I8, GT_U16, GT_I16, GT_U32, GT_I32, GT_U64, GT_I64)
FLOAT_TYPES = (GT_F32, GT_F64)
ODD_FLOATS = (math.nan, math.inf, -math.inf, 0.0, -1.0, -0.0, 1e-45, 1e38, 3.0e-39)
ODD_INTS = (0, 1, -1, 2, 3, 7, 255, 65535, 2 ** 31 - 1, 2 ** 31, 2 ** 32 - 1, 2 ** 32, 2 ** 63 - 1, 2 ** 64 - 1)


@dataclass
class KV:
    key: bytes
    vtype: int
    payload: bytes


@dataclass
class TI:
    name: bytes
    dims: list
    gtype: int
    offset: int


@dataclass
class GG:
    version: int
    kvs: list
    tis: list
    data: bytes             # the tensor data section (after the aligned header)
    n_kv: int | None = None        # header count lies (None: the true count)
    n_tensors: int | None = None


def _value_size(b: bytes, off: int, vt: int) -> int:
    if vt in SCALAR_FMT:
        return struct.calcsize(SCALAR_FMT[vt])
    if vt == GT_STR:
        return 8 + struct.unpack_from("<Q", b, off)[0]
    it, n = struct.unpack_from("<IQ", b, off)
    if n > len(b):               # a count an earlier mutation made up: not decodable
        raise ValueError("array count past the buffer")
    p = off + 12
    for _ in range(n):
        p += _value_size(b, p, it)
    return p - off


def gg_parse(b: bytes) -> GG:
    """Parse a valid GGUF (the seed) into its parts."""
    version, n_t, n_kv = struct.unpack_from("<IQQ", b, 4)
    off, kvs, align = 24, [], 32
    for _ in range(n_kv):
        (k,) = struct.unpack_from("<Q", b, off)
        key = b[off + 8:off + 8 + k]
        off += 8 + k
        (vt,) = struct.unpack_from("<I", b, off)
        off += 4
        n = _value_size(b, off, vt)
        kvs.append(KV(key, vt, b[off:off + n]))
        if key == b"general.alignment":
            align = struct.unpack_from(SCALAR_FMT[vt], b, off)[0]
        off += n
    tis = []
    for _ in range(n_t):
        (k,) = struct.unpack_from("<Q", b, off)
        name = b[off + 8:off + 8 + k]
        off += 8 + k
        (nd,) = struct.unpack_from("<I", b, off)
        dims = list(struct.unpack_from(f"<{nd}Q", b, off + 4))
        off += 4 + 8 * nd
        gt, toff = struct.unpack_from("<IQ", b, off)
        off += 12
        tis.append(TI(name, dims, gt, toff))
    start = -(-off // align) * align
    return GG(version, kvs, tis, b[start:])


def gg_write(g: GG, align: int = 32) -> bytes:
    out = bytearray(b"GGUF")
    out += struct.pack("<IQQ", g.version, len(g.tis) if g.n_tensors is None else g.n_tensors,
                       len(g.kvs) if g.n_kv is None else g.n_kv)
    for kv in g.kvs:
        out += struct.pack("<Q", len(kv.key)) + kv.key + struct.pack("<I", kv.vtype) + kv.payload
    for t in g.tis:
        out += struct.pack("<Q", len(t.name)) + t.name + struct.pack("<I", len(t.dims))
        out += b"".join(struct.pack("<Q", d & (2 ** 64 - 1)) for d in t.dims)
        out += struct.pack("<IQ", t.gtype & 0xFFFFFFFF, t.offset & (2 ** 64 - 1))
    out += b"\x00" * (-len(out) % align)
    return bytes(out + g.data)


def enc(vt: int, v) -> bytes:
    """Payload of a value of type vt (ints wrap to the type's width; a str/bytes for GT_STR; for GT_ARR a
    (item type, [items]) pair)."""
    if vt in INT_TYPES:
        bits = 8 * struct.calcsize(SCALAR_FMT[vt])
        v = int(v) & ((1 << bits) - 1)
        signed = SCALAR_FMT[vt].islower()
        if signed and v >= 1 << (bits - 1):
            v -= 1 << bits
        return struct.pack(SCALAR_FMT[vt], v)
    if vt in FLOAT_TYPES:
        return struct.pack(SCALAR_FMT[vt], float(v))
    if vt == GT_BOOL:
        return struct.pack("<B", int(v) & 0xFF)
    if vt == GT_STR:
        s = v.encode("utf-8", "surrogatepass") if isinstance(v, str) else bytes(v)
        return struct.pack("<Q", len(s)) + s
    it, items = v
    return struct.pack("<IQ", it, len(items)) + b"".join(enc(it, x) for x in items)


def dec(vt: int, p: bytes):
    if vt in SCALAR_FMT:
        return struct.unpack_from(SCALAR_FMT[vt], p)[0]
    if vt == GT_STR:
        return p[8:8 + struct.unpack_from("<Q", p)[0]]
    it, n = struct.unpack_from("<IQ", p)
    if n > len(p):
        raise ValueError("array count past the buffer")
    items, off = [], 12
    for _ in range(n):
        k = _value_size(p, off, it)
        items.append(dec(it, p[off:off + k]))
        off += k
    return it, items


# keys the runtime reads (hit most often), and values to try in them
RUNTIME_KEYS = [
    b"general.architecture", b"general.alignment",
    b"llama.block_count", b"llama.context_length", b"llama.embedding_length", b"llama.feed_forward_length",
    b"llama.attention.head_count", b"llama.attention.head_count_kv", b"llama.rope.freq_base",
    b"llama.attention.layer_norm_rms_epsilon", b"llama.rope.dimension_count", b"llama.vocab_size",
    b"llama.rope.scaling.type", b"llama.rope.scaling.factor", b"llama.rope.scaling.original_context_length",
    b"llama.rope.scaling.yarn_attn_factor", b"llama.rope.scaling.yarn_beta_fast", b"llama.rope.scaling.yarn_beta_slow",
    b"llama.attention.key_length", b"llama.attention.value_length",
    b"tokenizer.ggml.model", b"tokenizer.ggml.pre", b"tokenizer.ggml.tokens", b"tokenizer.ggml.token_type",
    b"tokenizer.ggml.scores", b"tokenizer.ggml.merges", b"tokenizer.ggml.bos_token_id",
    b"tokenizer.ggml.eos_token_id", b"tokenizer.ggml.unknown_token_id", b"tokenizer.ggml.eot_token_id",
    b"tokenizer.ggml.eom_token_id", b"tokenizer.ggml.add_bos_token", b"tokenizer.ggml.add_eos_token",
    b"tokenizer.ggml.add_space_prefix", b"tokenizer.chat_template",
]
ODD_STRINGS = ["", "llama", "gpt2", "yarn", "linear", "none", "bogus", "\x00", "a b", " ", "<0x41>", "é",
               b"\xff\xfe", "x" * 300]
GGML_TYPE_IDS = list(range(0, 40)) + [0xFFFF, 0xFFFFFFFF]


def _odd_value(rng: random.Random, vt: int):
    """(type, payload) of a hostile replacement value."""
    kind = rng.random()
    if kind < 0.45:
        t = rng.choice(INT_TYPES)
        return t, enc(t, rng.choice(ODD_INTS) if rng.random() < 0.8 else rng.randrange(-5, 70000))
    if kind < 0.75:
        t = rng.choice(FLOAT_TYPES)
        return t, enc(t, rng.choice(ODD_FLOATS) if rng.random() < 0.8 else rng.uniform(-10, 1e5))
    if kind < 0.85:
        return GT_STR, enc(GT_STR, rng.choice(ODD_STRINGS))
    if kind < 0.9:
        return GT_BOOL, enc(GT_BOOL, rng.choice((0, 1, 2, 255)))
    it = rng.choice(INT_TYPES + (GT_STR, GT_F32))
    items = [rng.choice(ODD_INTS) if it in INT_TYPES else (rng.choice(ODD_FLOATS) if it == GT_F32 else "x")
             for _ in range(rng.choice((0, 1, 3)))]
    return GT_ARR, enc(GT_ARR, (it, items))


def _mutate_value(rng: random.Random, kv: KV) -> None:
    """Change a value keeping its kind, or its type, or only its type id, or a length field."""
    r = rng.random()
    if kv.vtype in SCALAR_FMT and r < 0.5:
        if kv.vtype in FLOAT_TYPES:
            kv.payload = enc(kv.vtype, rng.choice(ODD_FLOATS))
        elif kv.vtype == GT_BOOL:
            kv.payload = enc(kv.vtype, rng.choice((0, 1, 2, 255)))
        else:
            v = dec(kv.vtype, kv.payload)
            kv.payload = enc(kv.vtype, rng.choice(ODD_INTS + (v + 1, v - 1, v * 2, v // 2)))
    elif kv.vtype == GT_STR and r < 0.5:
        if rng.random() < 0.5:
            kv.payload = enc(GT_STR, rng.choice(ODD_STRINGS))
        else:       # a length field that lies
            n = struct.unpack_from("<Q", kv.payload)[0]
            kv.payload = struct.pack("<Q", rng.choice((n + 1, n - 1, n * 2, 2 ** 63, 2 ** 64 - 1, 2 ** 40))
                                     & (2 ** 64 - 1)) + kv.payload[8:]
    elif kv.vtype == GT_ARR and r < 0.6:
        _mutate_array(rng, kv)
    elif r < 0.75:
        kv.vtype, kv.payload = _odd_value(rng, kv.vtype)
    elif r < 0.9:
        kv.vtype = rng.choice(list(range(13)) + [13, 99, 2 ** 32 - 1])     # same bytes, another type id
    else:                    # the same number re-encoded in another numeric type
        if kv.vtype in SCALAR_FMT and kv.vtype != GT_BOOL:
            v = dec(kv.vtype, kv.payload)
            t = rng.choice(INT_TYPES + FLOAT_TYPES)
            kv.vtype, kv.payload = t, enc(t, v if t in FLOAT_TYPES or not isinstance(v, float)
                                          else (int(v) if math.isfinite(v) else 0))
        else:
            kv.vtype, kv.payload = _odd_value(rng, kv.vtype)


def _mutate_array(rng: random.Random, kv: KV) -> None:
    it, n = struct.unpack_from("<IQ", kv.payload)
    r = rng.random()
    if r < 0.25:            # a count that lies
        n2 = rng.choice((n + 1, n - 1, 0, n * 2, 2 ** 31, 2 ** 40, 2 ** 62, 2 ** 64 - 1)) & (2 ** 64 - 1)
        kv.payload = struct.pack("<IQ", it, n2) + kv.payload[12:]
        return
    if r < 0.35:            # another item type over the same bytes
        kv.payload = struct.pack("<IQ", rng.choice(list(range(13)) + [99]), n) + kv.payload[12:]
        return
    it, items = dec(GT_ARR, kv.payload)
    if not items:
        items = [0] if it in INT_TYPES else ([0.0] if it in FLOAT_TYPES else [b"x"])
    r = rng.random()
    i = rng.randrange(len(items))
    if r < 0.2:
        del items[rng.randrange(len(items)):]                  # shorter
    elif r < 0.3:
        items.append(items[i])                                 # longer (a duplicate)
    elif it == GT_STR:
        items[i] = rng.choice([b"", items[(i + 1) % len(items)], b"\xff\xfe", b"<0xZZ>", b"<0x4", b" ",
                               b"a b c", items[i][:1], b"nosuch tokenpair", b"x" * 1000])
    elif it in FLOAT_TYPES:
        items[i] = rng.choice(ODD_FLOATS)
    elif it in INT_TYPES:
        items[i] = rng.choice(ODD_INTS + (5, 6, 7, 8))
    else:
        items[i] = rng.choice((0, 1, 2))
    kv.payload = enc(GT_ARR, (it, items))


def _mutate_key(rng: random.Random, g: GG) -> None:
    r = rng.random()
    i = rng.randrange(len(g.kvs))
    kv = g.kvs[i]
    if r < 0.3:                 # a flipped bit in the name
        k = bytearray(kv.key)
        if k:
            k[rng.randrange(len(k))] ^= 1 << rng.randrange(8)
        kv.key = bytes(k)
    elif r < 0.5:
        del g.kvs[i]
    elif r < 0.65:              # a duplicate key (the later value wins or clashes)
        other = KV(kv.key, *(_odd_value(rng, kv.vtype)))
        g.kvs.insert(rng.randrange(len(g.kvs) + 1), other)
    elif r < 0.8:               # a key the runtime reads, added or overwritten with an odd value
        key = rng.choice(RUNTIME_KEYS)
        g.kvs = [x for x in g.kvs if x.key != key]
        g.kvs.append(KV(key, *(_odd_value(rng, GT_U32))))
    elif r < 0.9:               # a key's length field lies
        kv.key = kv.key[:rng.randrange(len(kv.key) + 1)]
    else:                       # a known key renamed to another known key
        kv.key = rng.choice(RUNTIME_KEYS)


def _mutate_tensor(rng: random.Random, g: GG) -> None:
    t = rng.choice(g.tis)
    r = rng.random()
    if r < 0.35:
        j = rng.randrange(len(t.dims))
        t.dims[j] = rng.choice((0, 1, 2, 31, 33, t.dims[j] + 1, t.dims[j] - 1, t.dims[j] * 2, 2 ** 31,
                                2 ** 32, 2 ** 62, 2 ** 64 - 1))
    elif r < 0.45:
        rng.choice((lambda: t.dims.append(rng.choice((1, 2, 0))), lambda: t.dims.pop() if len(t.dims) > 1 else None,
                    lambda: t.dims.reverse(), lambda: t.dims.extend([1] * 4)))()
    elif r < 0.65:
        t.gtype = rng.choice(GGML_TYPE_IDS)
    elif r < 0.85:
        t.offset = rng.choice((0, 1, t.offset + 32, t.offset - 32, t.offset + 1, len(g.data), 2 ** 40,
                               2 ** 64 - 32, rng.choice(g.tis).offset))
    else:
        other = rng.choice(g.tis)
        t.name = rng.choice((other.name, t.name[:-1], t.name + b"x", b"blk.999.attn_q.weight", b"",
                             t.name.replace(b"blk.0", b"blk.1"), t.name.replace(b"blk.1", b"blk.0")))


def _mutate_header(rng: random.Random, g: GG) -> None:
    r = rng.random()
    if r < 0.4:
        g.n_kv = rng.choice((len(g.kvs) + 1, len(g.kvs) - 1, 0, 2 ** 32, 2 ** 63, 2 ** 64 - 1))
    elif r < 0.8:
        g.n_tensors = rng.choice((len(g.tis) + 1, len(g.tis) - 1, 0, 2 ** 32, 2 ** 63, 2 ** 64 - 1))
    else:
        g.version = rng.choice((0, 1, 2, 4, 2 ** 24, 2 ** 32 - 1))


def _mutate_data(rng: random.Random, g: GG) -> None:
    """Tensor values: NaN / inf / huge floats in a float tensor, random bytes in a block tensor."""
    a = bytearray(g.data)
    t = rng.choice(g.tis)
    i = t.offset + 4 * rng.randrange(16)
    if i + 4 <= len(a):
        a[i:i + 4] = struct.pack("<f", rng.choice(ODD_FLOATS))
    g.data = bytes(a)


def gguf_mutate(rng: random.Random, seed: bytes) -> bytes:
    g = gg_parse(seed)
    header_end = len(seed) - len(g.data)
    r = rng.random()
    if r < 0.08:
        return truncate(rng, seed, header_end + 64 if rng.random() < 0.7 else None)
    if r < 0.16:
        return flip_bits(rng, seed, 0, header_end if rng.random() < 0.8 else None)
    if r < 0.2:
        return splat(rng, seed, 0, header_end)
    for _ in range(rng.choice((1, 1, 1, 2, 3))):
        try:
            _mutate_once(rng, g)
        except (struct.error, ValueError, IndexError, OverflowError, MemoryError):
            pass                 # an earlier mutation left bytes this one cannot decode: keep them
        if not g.kvs or not g.tis:
            break
    out = gg_write(g)
    if rng.random() < 0.05:
        out = truncate(rng, out)
    return out


def _mutate_once(rng: random.Random, g: GG) -> None:
    op = rng.random()
    if op < 0.45:
        if rng.random() < 0.6:      # a key the runtime reads
            wanted = [kv for kv in g.kvs if kv.key in RUNTIME_KEYS]
            _mutate_value(rng, rng.choice(wanted or g.kvs))
        else:
            _mutate_value(rng, rng.choice(g.kvs))
    elif op < 0.65:
        _mutate_key(rng, g)
    elif op < 0.87:
        _mutate_tensor(rng, g)
    elif op < 0.93:
        _mutate_header(rng, g)
    else:
        _mutate_data(rng, g)


def tiny_seed(path: Path, types=None, **kw) -> bytes:
    from gguf import GGMLQuantizationType as T

    from tests.reference import write_tiny_gguf
    types = types or {"default": T.Q8_0, "ffn_down": T.Q4_1, "token_embd": T.F16}
    tmp = _own_tmp(path)
    write_tiny_gguf(tmp, types, dim=64, ff=128, n_heads=2, n_kv=1, n_layers=2, **kw)
    data = tmp.read_bytes()
    os.replace(tmp, path)
    return data


def _own_tmp(path: Path) -> Path:
    """A name beside `path` that only this process writes: the parent and every worker build the
    same seed files in one folder at once, and a file another process has just truncated reads empty."""
    return path.with_name(f".{path.name}.{os.getpid()}.tmp")


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = _own_tmp(path)
    tmp.write_bytes(data)
    os.replace(tmp, path)


def spm_seed(path: Path) -> bytes:
    """The tiny seed with a SentencePiece ("llama") vocabulary of the same size: <unk> <s> </s>, the
    256 <0xNN> byte tokens, three pieces."""
    g = gg_parse(tiny_seed(path, seed=2))
    toks = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + ["\u2581t", "\u2581th", "\u2581the"]
    types = [2, 3, 3] + [6] * 256 + [1, 1, 1]
    scores = [0.0] * 259 + [-1.0, -2.0, -3.0]
    new = {b"tokenizer.ggml.model": (GT_STR, "llama"), b"tokenizer.ggml.tokens": (GT_ARR, (GT_STR, toks)),
           b"tokenizer.ggml.token_type": (GT_ARR, (GT_I32, types)),
           b"tokenizer.ggml.scores": (GT_ARR, (GT_F32, scores)), b"tokenizer.ggml.bos_token_id": (GT_U32, 1),
           b"tokenizer.ggml.eos_token_id": (GT_U32, 2), b"tokenizer.ggml.unknown_token_id": (GT_U32, 0)}
    g.kvs = [kv for kv in g.kvs if kv.key not in new and kv.key not in (b"tokenizer.ggml.merges", b"tokenizer.ggml.pre")]
    g.kvs += [KV(k, t, enc(t, v)) for k, (t, v) in new.items()]
    out = gg_write(g)
    _write_atomic(path, out)
    return out


def gguf_run(path: str, kv: str = "f16") -> None:
    import pykv
    m = pykv.load(path, n_ctx=64, kv_type_k=kv, kv_type_v=kv)
    ids = m.tokenize("Hello world, the cat sat <|im_start|>")[:24] or [0]
    m.forward(ids)
    m.detokenize(ids)
    "".join(m.generate(ids[:8], max_tokens=2, temperature=0))


def gguf_warm(workdir: Path) -> None:
    """Compile (or load from Numba's cache) the kernels of every weight type a mutated seed can name, so
    a valid type swap does not spend the case's time budget compiling."""
    from gguf import GGMLQuantizationType as T
    # each type alone, then the seeds' own mix of types (None: its decode chain is another compile)
    for tt in (T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, None):
        p = workdir / f"warm-{tt.name if tt is not None else 'seed'}.gguf"
        tiny_seed(p, types=None if tt is None else {"default": tt})
        for kv in ("f16", "q4_0"):
            gguf_run(str(p), kv)


@target("gguf")
def gguf_target(workdir: Path) -> Target:
    seeds = [tiny_seed(workdir / "seed.gguf"), tiny_seed(workdir / "seed_untied.gguf", tied=False, seed=1),
             spm_seed(workdir / "seed_spm.gguf")]
    return Target(seeds, gguf_mutate, gguf_run, ".gguf", ("f16", "f16", "f16", "q4_0"), gguf_warm)


@target("state")
def state_target(workdir: Path) -> Target:
    """Session state files, against pykv.api.session's API: Session(model) ... .save(path) and
    Session.load(model, path). Mutations: bytes (flips, truncation) and, where the module names its
    layout (_PREFIX, _CRC), the JSON header's fields with the checksums made right again, so a case
    gets past the checksum to the code that believes the header."""
    import importlib.util
    if importlib.util.find_spec("pykv.api.session") is None:
        raise Skip("pykv.api.session does not exist yet (the library issue adds Session.save / Session.load)")
    import pykv
    from pykv.api import session as S
    mpath = workdir / "model.gguf"
    if not mpath.exists():
        tiny_seed(mpath)
    holder = {}

    def model():
        if "m" not in holder:         # once per process
            holder["m"] = pykv.load(str(mpath), n_ctx=64)
        return holder["m"]

    sp = workdir / "seed.state"
    if not sp.exists():
        sess = S.Session(model())
        "".join(sess.generate("Hello world, the cat sat", max_tokens=4, temperature=0))
        sess.save(str(sp))

    def run(path: str, _opt=None) -> None:
        s = S.Session.load(model(), path)
        "".join(s.generate(" and", max_tokens=2, temperature=0))
        s.close()

    def mutate(rng, seed):
        r = rng.random()
        if r < 0.5 and hasattr(S, "_PREFIX") and hasattr(S, "_CRC"):
            try:
                return _state_header_mutate(rng, seed, S._PREFIX, S._CRC)
            except (ValueError, KeyError, TypeError, IndexError, struct.error):
                pass
        if r < 0.65:
            return truncate(rng, seed)
        if r < 0.9:
            return flip_bits(rng, seed, 0, min(len(seed), 4096) if rng.random() < 0.7 else None)
        return splat(rng, seed, 0, min(len(seed), 4096))
    return Target([sp.read_bytes()], mutate, run, ".state")


def _state_header_mutate(rng: random.Random, b: bytes, prefix, crc) -> bytes:
    import json
    import zlib

    import numpy as np
    magic, version, hlen = prefix.unpack_from(b)
    end = prefix.size + hlen
    h = json.loads(b[prefix.size:end])
    body = b[end + crc.size:]
    odd = [0, -1, 1, 2 ** 31, 2 ** 62, 10 ** 30, 1.5, math.nan, "x", None, [], {}, True]
    key = rng.choice(sorted(h))
    r = rng.random()
    if key == "arrays" and h["arrays"] and r < 0.7:
        a = rng.choice(h["arrays"])
        j = rng.randrange(len(a))
        if j == 2 and a[2] and rng.random() < 0.7:          # one dimension of the shape
            a[2][rng.randrange(len(a[2]))] = rng.choice([0, 1, 2 ** 31, 2 ** 40, -1, a[2][0] + 1])
        else:
            a[j] = rng.choice(odd + ["<f8", "|u1", "<i8", "O", "<U4", "V0"])
        if rng.random() < 0.5:        # the array checksums made right too (offsets from the new table)
            off, fixed = 0, []
            for name, dt, shape, c in h["arrays"]:
                try:
                    nb = int(np.dtype(dt).itemsize * int(np.prod(shape)))
                except Exception:  # noqa: BLE001
                    nb = 0
                fixed.append([name, dt, shape, zlib.crc32(body[off:off + max(nb, 0)])])
                off += max(nb, 0)
            h["arrays"] = fixed
    elif r < 0.85:
        h[key] = rng.choice(odd)
    else:
        del h[key]
    if rng.random() < 0.1:
        version = rng.choice([0, 2, 2 ** 32 - 1])
    hb = json.dumps(h).encode()
    head = prefix.pack(magic, version, len(hb)) + hb
    return head + crc.pack(zlib.crc32(head)) + body


@target("http")
def http_target(workdir: Path) -> Target:
    raise Skip("pykv has no HTTP server yet (the serving issue adds one): nothing to fuzz")


# ---- worker and watchdog ------------------------------------------------------------------------------------

def _classify(run: Callable[[str, object], None], path: str, option) -> tuple[str, str]:
    from pykv.files.config import PykvError
    try:
        run(path, option)
        return "ok", ""
    except PykvError as e:
        return "clean", str(e).splitlines()[0] if str(e) else type(e).__name__
    except BaseException as e:  # noqa: BLE001  (what the fuzzer is looking for)
        tb = traceback.extract_tb(e.__traceback__)
        where = f"{Path(tb[-1].filename).name}:{tb[-1].lineno}" if tb else "?"
        return "foreign", f"{type(e).__name__}: {str(e)[:200]} (at {where})"


def _worker(conn, name: str, workdir: str) -> None:
    import tracemalloc
    import warnings
    warnings.simplefilter("ignore")
    tgt = TARGETS[name](Path(workdir))
    case_path = os.path.join(workdir, f"case-{os.getpid()}{tgt.suffix}")
    with open(case_path, "wb") as f:      # one untraced run first: lazy imports and Numba cache loads
        f.write(tgt.seeds[0])             # are not charged to the seed's allocation baseline or a case
    _classify(tgt.run, case_path, tgt.options[0])
    tracemalloc.start()
    conn.send(("ready", "", 0))
    while True:
        msg = conn.recv()
        if msg is None:
            return
        data, kv = msg
        with open(case_path, "wb") as f:
            f.write(data)
        tracemalloc.reset_peak()
        base = tracemalloc.get_traced_memory()[0]
        status, detail = _classify(tgt.run, case_path, kv)
        detail = detail.replace(case_path, "FILE")
        peak = tracemalloc.get_traced_memory()[1] - base
        conn.send((status, detail, peak))


def _start(p) -> None:
    """Start a spawned process with one Numba thread (NUMBA_NUM_THREADS=1 unless set) while this
    process's environment stays as it was: a test process that kept NUMBA_NUM_THREADS=1 could not
    run its own 2-thread kernels afterwards (Numba re-reads it when it compiles)."""
    old = os.environ.get("NUMBA_NUM_THREADS")
    os.environ.setdefault("NUMBA_NUM_THREADS", "1")
    try:
        p.start()
    finally:
        if old is None:
            os.environ.pop("NUMBA_NUM_THREADS", None)


def _warm(name: str, workdir: str) -> None:
    TARGETS[name](Path(workdir)).warm(Path(workdir))


class _Proc:
    def __init__(self, ctx, name, workdir):
        self.conn, child = ctx.Pipe()
        self.p = ctx.Process(target=_worker, args=(child, name, workdir), daemon=True)
        _start(self.p)
        child.close()
        self.case = None
        self.deadline = time.monotonic() + START_TIMEOUT
        self.ready = False

    def kill(self):
        if self.p.is_alive():
            self.p.kill()
        self.p.join(5)


def case_input(tgt: Target, base_seed: int, i: int) -> tuple[bytes, str]:
    rng = random.Random(f"{base_seed}:{i}")
    seed = tgt.seeds[rng.randrange(len(tgt.seeds))]
    opt = rng.choice(tgt.options)
    return tgt.mutate(rng, seed), opt


def fuzz(name: str, n: int, seed: int = 0, jobs: int = 2, timeout: float = 60.0, save: Path | None = SAVE_DIR,
         verbose: bool = True) -> dict:
    """Run n cases of target `name`; returns the counts and the failures."""
    if name not in TARGETS:
        raise SystemExit(f"fuzz: unknown target {name!r} (known: {', '.join(TARGETS)})")
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix=f"pykv-fuzz-{name}-") as wd:
        try:
            tgt = TARGETS[name](Path(wd))
        except Skip as e:
            return {"target": name, "skipped": str(e)}
        ctx = mp.get_context("spawn")
        if tgt.warm is not None:
            if verbose:
                print(f"fuzz {name}: warming up (Numba compiles on a cold cache)", file=sys.stderr, flush=True)
            w = ctx.Process(target=_warm, args=(name, wd))
            _start(w)
            w.join()
            if w.exitcode:
                raise SystemExit(f"fuzz {name}: warm-up failed (exit {w.exitcode})")
        counts = {"cases": 0, "ok": 0, "clean": 0, "crash": 0, "hang": 0, "foreign": 0, "alloc": 0}
        failures: list[dict] = []
        messages: dict[str, int] = {}
        limit0 = None
        procs = [_Proc(ctx, name, wd) for _ in range(max(1, jobs))]
        todo = list(range(n))
        todo.reverse()
        inputs: dict[int, tuple[bytes, str]] = {}

        def record(i, status, detail, peak=0):
            data, kv = inputs.pop(i)
            counts["cases"] += 1
            limit = limit0 + ALLOC_PER_BYTE * len(data)
            if status in ("ok", "clean") and peak > limit:
                status, detail = "alloc", f"peak {peak} bytes traced for a {len(data)}-byte input (limit {limit})"
            counts[status] += 1
            if status == "clean":
                key = detail[:70]
                messages[key] = messages.get(key, 0) + 1
            if status in ("crash", "hang", "foreign", "alloc"):
                f = {"case": i, "kind": status, "detail": detail, "kv": kv}
                if save is not None:
                    save.mkdir(parents=True, exist_ok=True)
                    out = save / f"{name}-{hashlib.sha1(data).hexdigest()[:12]}{tgt.suffix}"
                    out.write_bytes(data)
                    f["file"] = str(out)
                failures.append(f)
                if verbose:
                    print(f"fuzz {name}: case {i}: {status}: {detail}", file=sys.stderr, flush=True)

        # the seed itself first, in one worker: it must pass, and its peak sets the allocation baseline
        first = procs[0]
        inputs[-1] = (tgt.seeds[0], tgt.options[0])
        pending_seed = True
        while todo or inputs:
            for k, pr in enumerate(procs):
                if pr.ready and pr.case is None:
                    if pending_seed and k == 0:
                        pr.case = -1
                        pending_seed = False
                        pr.conn.send(inputs[-1])
                    elif todo and limit0 is not None:
                        i = todo.pop()
                        inputs[i] = case_input(tgt, seed, i)
                        pr.case = i
                        pr.conn.send(inputs[i])
                    else:
                        continue
                    pr.deadline = time.monotonic() + (START_TIMEOUT if pr.case == -1 else timeout)
            busy = [pr for pr in procs if pr.case is not None or not pr.ready]
            if not busy:
                break
            ready = wait([pr.conn for pr in busy] + [pr.p.sentinel for pr in busy],
                         timeout=max(0.0, min(pr.deadline for pr in busy) - time.monotonic()))
            now = time.monotonic()
            for k, pr in enumerate(procs):
                dead = pr.p.sentinel in ready and not pr.conn.poll()
                msg = None
                if pr.conn in ready or (pr.conn.poll() if not dead else False):
                    try:
                        msg = pr.conn.recv()
                    except (EOFError, OSError):
                        dead = True
                if msg is not None:
                    if msg[0] == "ready":
                        pr.ready = True
                    elif pr.case == -1:
                        if msg[0] != "ok":
                            raise SystemExit(f"fuzz {name}: the unmutated seed fails: {msg[1]}")
                        limit0 = 2 * msg[2] + (8 << 20)
                        inputs.pop(-1)
                        pr.case = None
                    else:
                        record(pr.case, *msg)
                        pr.case = None
                    continue
                if dead or now >= pr.deadline:
                    if not dead:
                        pr.kill()
                    pr.p.join(5)
                    code = pr.p.exitcode
                    if pr.case is None or pr.case == -1:
                        raise SystemExit(f"fuzz {name}: a worker failed to start or run the seed (exit {code})")
                    if dead:
                        record(pr.case, "crash", f"worker died, exit code {code}"
                               + (f" (signal {-code})" if code is not None and code < 0 else ""))
                    else:
                        record(pr.case, "hang", f"no answer within {timeout:g} s")
                    procs[k] = _Proc(ctx, name, wd)
            if verbose and counts["cases"] and counts["cases"] % 1000 == 0 and counts["cases"] != getattr(fuzz, "_shown", 0):
                fuzz._shown = counts["cases"]
                print(f"fuzz {name}: {counts['cases']}/{n} cases, {time.monotonic() - t0:.0f} s", file=sys.stderr,
                      flush=True)
        for pr in procs:
            try:
                pr.conn.send(None)
            except OSError:
                pass
            pr.p.join(5)
            if pr.p.is_alive():
                pr.kill()
    return {"target": name, **counts, "seconds": round(time.monotonic() - t0, 1), "alloc_base": limit0,
            "failures": failures, "top_errors": sorted(messages.items(), key=lambda kv: -kv[1])[:15]}


def replay(name: str, path: str | None, case: int | None, seed: int = 0) -> tuple[str, str]:
    """Run one input (a file, or case i of a run) in this process: (status, detail); ("skipped", why)
    when the target cannot run here."""
    with tempfile.TemporaryDirectory() as wd:
        try:
            tgt = TARGETS[name](Path(wd))
        except Skip as e:
            return "skipped", str(e)
        opt = tgt.options[0]
        if case is not None:
            data, opt = case_input(tgt, seed, case)
            path = os.path.join(wd, f"case{tgt.suffix}")
            Path(path).write_bytes(data)
        return _classify(tgt.run, path, opt)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", required=True, choices=list(TARGETS))
    ap.add_argument("--n", type=int, default=1000, help="cases (default 1000)")
    ap.add_argument("--seed", type=int, default=0, help="base seed: case i is a function of (seed, i)")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="worker processes")
    ap.add_argument("--timeout", type=float, default=60.0, help="seconds per case before it counts as a hang")
    ap.add_argument("--save", default=str(SAVE_DIR), help="folder for failing inputs ('' = keep none)")
    ap.add_argument("--replay", help="run one case number or input file in this process and print the outcome")
    a = ap.parse_args(argv)
    if a.replay is not None:
        case = int(a.replay) if a.replay.isdigit() else None
        status, detail = replay(a.target, None if case is not None else a.replay, case, a.seed)
        print(f"{status}: {detail}")
        return 0 if status in ("ok", "clean") else 1
    res = fuzz(a.target, a.n, a.seed, a.jobs, a.timeout, Path(a.save) if a.save else None)
    if "skipped" in res:
        print(f"fuzz {a.target}: skipped: {res['skipped']}")
        return 0
    print(f"fuzz {a.target}: {res['cases']} cases in {res['seconds']} s: {res['ok']} ran, {res['clean']} clean "
          f"PykvError, {res['crash']} crashes, {res['hang']} hangs, {res['foreign']} foreign exceptions, "
          f"{res['alloc']} oversized allocations (limit: {res['alloc_base']:,} bytes + {ALLOC_PER_BYTE} per input byte)")
    for msg, k in res["top_errors"]:
        print(f"  {k:6d}  {msg}")
    return 1 if res["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
