"""pykv.files.validate: each semantic fault of a model file is refused before any kernel runs, with one line
naming the file, the key or tensor, and what was wrong (a ModelFileError, a PykvError)."""
import math
import struct

import pytest

import pykv
from pykv.files.validate import ModelFileError
from tests.files.test_fuzz import _fuzz_module

fz = _fuzz_module()


@pytest.fixture(scope="module")
def seed(tmp_path_factory):
    d = tmp_path_factory.mktemp("validate")
    return fz.tiny_seed(d / "seed.gguf"), fz.spm_seed(d / "spm.gguf")


def set_kv(g, key, vt, value):
    g.kvs = [kv for kv in g.kvs if kv.key != key] + [fz.KV(key, vt, fz.enc(vt, value))]


def drop_kv(g, key):
    g.kvs = [kv for kv in g.kvs if kv.key != key]


def tensor(g, name):
    return next(t for t in g.tis if t.name == name)


def tokens(g):
    return fz.dec(fz.GT_ARR, next(kv for kv in g.kvs if kv.key == b"tokenizer.ggml.tokens").payload)[1]


def set_f32(g, name, value):
    t = tensor(g, name)
    a = bytearray(g.data)
    a[t.offset:t.offset + 4] = struct.pack("<f", value)
    g.data = bytes(a)


U32, F32, STR, ARR = fz.GT_U32, fz.GT_F32, fz.GT_STR, fz.GT_ARR
LAST = b"blk.1.ffn_down.weight"
CASES = {
    "missing key": (lambda g: drop_kv(g, b"llama.block_count"), "metadata llama.block_count: missing"),
    "wrong type": (lambda g: set_kv(g, b"llama.embedding_length", STR, "64"),
                   "metadata llama.embedding_length: is a string, expected an integer"),
    "zero kv heads": (lambda g: set_kv(g, b"llama.attention.head_count_kv", U32, 0),
                      "metadata llama.attention.head_count_kv: 0, expected >= 1"),
    "heads not divisible": (lambda g: set_kv(g, b"llama.attention.head_count_kv", U32, 3),
                            "head_count 2 is not a multiple of llama.attention.head_count_kv 3"),
    "odd head dim": (lambda g: (set_kv(g, b"llama.attention.head_count", U32, 64),
                                set_kv(g, b"llama.attention.head_count_kv", U32, 1),
                                set_kv(g, b"llama.rope.dimension_count", U32, 2)), "is odd"),
    "nan eps": (lambda g: set_kv(g, b"llama.attention.layer_norm_rms_epsilon", F32, math.nan),
                "layer_norm_rms_epsilon: nan, expected a finite number"),
    "zero rope base": (lambda g: set_kv(g, b"llama.rope.freq_base", F32, 0.0), "rope.freq_base: 0.0, expected > 0"),
    "inf rope base": (lambda g: set_kv(g, b"llama.rope.freq_base", F32, math.inf), "expected a finite number"),
    "vocab size": (lambda g: set_kv(g, b"llama.vocab_size", U32, 300),
                   "tokenizer.ggml.tokens: has 262 tokens, the model's vocabulary is 300"),
    "token types length": (lambda g: set_kv(g, b"tokenizer.ggml.token_type", ARR, (fz.GT_I32, [1] * 5)),
                           "token_type: expected an array of 262 integers"),
    "merge names no token": (lambda g: set_kv(g, b"tokenizer.ggml.merges", ARR, (STR, ["Ġ t", "Ġq zz"])),
                             "merge 1 ('Ġq zz') does not name two tokens"),
    "bos out of range": (lambda g: set_kv(g, b"tokenizer.ggml.bos_token_id", U32, 262),
                         "bos_token_id: 262, outside the vocabulary of 262 tokens"),
    # the last tensor's data may shrink without moving another tensor's
    "tensor shape": (lambda g: setattr(tensor(g, LAST), "dims", [128, 32]),
                     "tensor blk.1.ffn_down.weight: has shape [128, 32], the config needs [128, 64]"),
    "tensor type": (lambda g: setattr(tensor(g, LAST), "gtype", 16),
                    "tensor blk.1.ffn_down.weight: has unsupported type IQ2_XXS"),
    "unknown tensor": (lambda g: setattr(tensor(g, b"blk.1.ffn_up.weight"), "name", b"blk.1.ffn_up.bias"),
                       "tensor blk.1.ffn_up.bias: not a tensor of a llama model"),
    "nan weights": (lambda g: set_f32(g, b"blk.0.attn_norm.weight", math.nan),
                    "tensor blk.0.attn_norm.weight: holds 1 NaN/inf values"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_refused_with_one_line(case, seed, tmp_path):
    mutate, fragment = CASES[case]
    g = fz.gg_parse(seed[0])
    mutate(g)
    p = tmp_path / "bad.gguf"
    p.write_bytes(fz.gg_write(g))
    with pytest.raises(ModelFileError) as e:
        pykv.load(str(p), n_ctx=64)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"{p}: ")
    assert fragment in msg, msg


def test_spm_byte_tokens(seed, tmp_path):
    g = fz.gg_parse(seed[1])
    toks = tokens(g)
    toks[5] = toks[4]                                     # <0x02> becomes a second <0x01>
    set_kv(g, b"tokenizer.ggml.tokens", ARR, (STR, toks))
    p = tmp_path / "spm.gguf"
    p.write_bytes(fz.gg_write(g))
    with pytest.raises(ModelFileError, match=r"tokenizer.ggml.tokens: byte token 5 repeats token 4 \(<0x01>\)"):
        pykv.load(str(p), n_ctx=64)


def test_valid_seeds_load(seed, tmp_path):
    for i, b in enumerate(seed):
        p = tmp_path / f"ok{i}.gguf"
        p.write_bytes(b)
        m = pykv.load(str(p), n_ctx=64)
        assert m.tokenizer.kind == ("bpe", "spm")[i]
