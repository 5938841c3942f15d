"""Tokenizer built from GGUF metadata, matching llama.cpp's token ids.

Two vocabulary types are supported, selected by ``tokenizer.ggml.model``:

* ``"gpt2"``  -- byte-level BPE (GPT-2 byte<->unicode mapping, merges applied by
  rank).  The text is first partitioned on special tokens (llama.cpp's
  ``tokenizer_st_partition``), then each raw fragment is split into words by the
  pre-tokenizer regex(es) selected by ``tokenizer.ggml.pre`` and each word is
  BPE-merged (results cached per word).
* ``"llama"`` -- SentencePiece vocabulary (scores, token types, ``<0xNN>`` byte
  fallback).  A SentencePiece ``ModelProto`` is serialized from the metadata
  with a small hand-written protobuf encoder (``sentencepiece_model_pb2`` needs
  the ``protobuf`` package, which is not a dependency) and loaded with
  ``SentencePieceProcessor(model_proto=...)``.

Decoding follows llama.cpp's ``token_to_piece`` / ``llama_detokenize``.
"""

from __future__ import annotations

import codecs
import struct
import warnings
from typing import Iterable

import regex

from pykv.files.config import PykvError

__all__ = ["Tokenizer", "StreamDecoder", "tokenizer_from_gguf"]

# GGUF / llama.cpp token types
TOKEN_NORMAL = 1
TOKEN_UNKNOWN = 2
TOKEN_CONTROL = 3
TOKEN_USER_DEFINED = 4
TOKEN_BYTE = 6

# ---------------------------------------------------------------------------
# pre-tokenizer regexes (as used by llama.cpp's llm_tokenizer_bpe)
# ---------------------------------------------------------------------------

_RE_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_RE_LLAMA3 = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
    r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_RE_QWEN2 = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
    r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# name -> (regexes applied in sequence, clean_spaces, ignore_merges)
_PRE_TOKENIZERS: dict[str, tuple[tuple[str, ...], bool, bool]] = {}


def _register(names, exprs, clean_spaces, ignore_merges=False):
    for n in names:
        _PRE_TOKENIZERS[n] = (tuple(exprs), clean_spaces, ignore_merges)


_register(["gpt2", "gpt-2", "phi-2", "mpt", "olmo", "jais", "exaone4"], [_RE_GPT2], True)
_register(["trillion", "granite-docling"], [_RE_GPT2], False)
# starcoder family: individual digits first, then the GPT-2 regex
_register(["starcoder", "refact", "codeshell", "exaone", "minerva-7b"], [r"\p{N}", _RE_GPT2], True)
_register(["smollm", "command-r"], [r"\p{N}", _RE_GPT2], False)
_register(["llama-bpe", "llama3", "llama-v3", "falcon3", "pixtral", "dbrx", "smaug-bpe"],
          [_RE_LLAMA3], True, ignore_merges=True)
_register(["qwen2", "deepseek-r1-qwen"], [_RE_QWEN2], False)
_register(["stablelm2", "megrez"], [_RE_QWEN2], True)
_register(["default"], [r"[\p{P}\$\+<=>\^~\|]+", _RE_GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"], True)


# ---------------------------------------------------------------------------
# GPT-2 byte <-> unicode mapping
# ---------------------------------------------------------------------------

def _bytes_to_unicode() -> dict[int, str]:
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
    mapping = {}
    extra = 0
    for b in range(256):
        if b in keep:
            mapping[b] = chr(b)
        else:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


_BYTE_TO_UNI = _bytes_to_unicode()
_UNI_TO_BYTE = {u: b for b, u in _BYTE_TO_UNI.items()}
# bytes.translate-free fast path: table indexed by byte value
_BYTE_TO_UNI_LIST = [_BYTE_TO_UNI[b] for b in range(256)]


def _byte_encode(text: str) -> str:
    return "".join(_BYTE_TO_UNI_LIST[b] for b in text.encode("utf-8", "surrogatepass"))


# str.translate table for _byte_decode: each byte-map character to its byte; a character below 256 that
# is not in the map goes to U+0100, so that it, like any unmapped character, fails the latin-1 encode
_DECODE_TABLE = {ord(u): b for u, b in _UNI_TO_BYTE.items()}
_DECODE_TABLE.update({c: 0x100 for c in range(256) if chr(c) not in _UNI_TO_BYTE})


def _byte_decode(text: str) -> bytes:
    try:        # the common case in one C pass
        return text.translate(_DECODE_TABLE).encode("latin-1")
    except UnicodeEncodeError:
        pass
    out = bytearray()
    for ch in text:
        b = _UNI_TO_BYTE.get(ch)
        if b is None:
            # llama.cpp emits a marker for characters outside the byte map
            out += b"[UNK_BYTE_0x" + ch.encode("utf-8").hex().encode() + text.encode("utf-8") + b"]"
        else:
            out.append(b)
    return bytes(out)


# ---------------------------------------------------------------------------
# minimal protobuf writer for sentencepiece's ModelProto
# ---------------------------------------------------------------------------

def _pb_varint(v: int) -> bytes:
    if v < 0:
        v &= (1 << 64) - 1  # int32/int64 negatives are encoded as 10-byte varints
    out = bytearray()
    while True:
        b = v & 0x7F
        v >>= 7
        if v:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def _pb_key(field: int, wire: int) -> bytes:
    return _pb_varint((field << 3) | wire)


def _pb_int(field: int, v: int) -> bytes:
    return _pb_key(field, 0) + _pb_varint(int(v))


def _pb_bytes(field: int, v: bytes) -> bytes:
    return _pb_key(field, 2) + _pb_varint(len(v)) + v


def _pb_float(field: int, v: float) -> bytes:
    return _pb_key(field, 5) + struct.pack("<f", float(v))


def build_spm_model(pieces: list[tuple[bytes, float, int]], *, model_type: int = 2,
                    unk_id: int = 0, bos_id: int = 1, eos_id: int = 2, pad_id: int = -1,
                    add_dummy_prefix: bool = True, byte_fallback: bool = False) -> bytes:
    """Serialize a sentencepiece ModelProto (identity normalizer): pieces (utf-8 text, score, type).

    Field numbers follow sentencepiece_model.proto:
      ModelProto: 1 pieces, 2 trainer_spec, 3 normalizer_spec
      SentencePiece: 1 piece, 2 score, 3 type (same values as GGUF token types)
      TrainerSpec: 3 model_type (1 unigram, 2 BPE), 4 vocab_size, 35 byte_fallback,
                   40 unk_id, 41 bos_id, 42 eos_id, 43 pad_id
      NormalizerSpec: 1 name, 3 add_dummy_prefix, 4 remove_extra_whitespaces,
                      5 escape_whitespaces
    """
    body = bytearray()
    for text, score, typ in pieces:
        body += _pb_bytes(1, _pb_bytes(1, text) + _pb_float(2, score) + _pb_int(3, typ))
    trainer = (_pb_int(3, model_type) + _pb_int(4, len(pieces)) + _pb_int(35, 1 if byte_fallback else 0)
               + _pb_int(40, unk_id) + _pb_int(41, bos_id) + _pb_int(42, eos_id) + _pb_int(43, pad_id))
    body += _pb_bytes(2, trainer)
    norm = (_pb_bytes(1, b"identity") + _pb_int(3, 1 if add_dummy_prefix else 0)
            + _pb_int(4, 0) + _pb_int(5, 1))
    body += _pb_bytes(3, norm)
    return bytes(body)


# ---------------------------------------------------------------------------
# end-of-generation detection (llama.cpp's text-based heuristics)
# ---------------------------------------------------------------------------

_EOG_TEXTS = {
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|eom_id|>",
    "<EOT>", "_<EOT>", "<|end_of_text|>", "<end_of_utterance>", "<|return|>", "<|call|>",
}
_FIM_EOG_TEXTS = {  # FIM pad / repo / file-sep tokens are also EOG in llama.cpp
    "<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>",
    "<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>",
    "<|file_sep|>",
}


class Tokenizer:
    """GGUF tokenizer (``gpt2`` byte-level BPE or ``llama`` SentencePiece)."""

    # ------------------------------------------------------------------ build
    def __init__(self, md: dict):
        model = str(md.get("tokenizer.ggml.model", "llama"))
        tokens = list(md["tokenizer.ggml.tokens"])
        n = len(tokens)
        types = md.get("tokenizer.ggml.token_type")
        types = [int(t) for t in types] if types is not None else [TOKEN_NORMAL] * n
        scores = md.get("tokenizer.ggml.scores")
        scores = [float(s) for s in scores] if scores is not None else [0.0] * n

        self.model = model
        self.chat_template: str | None = md.get("tokenizer.chat_template")
        self.tokens: list[str] = tokens
        self.token_types: list[int] = types
        self.scores: list[float] = scores
        self.n_vocab: int = n
        # the first id of a text that occurs twice (filled from the end, so the first id is written last)
        self.token_to_id: dict[str, int] = dict(zip(reversed(tokens), range(n - 1, -1, -1)))

        def _id(key, default):
            v = md.get(key, default)
            if v is None:
                return None
            v = int(v)
            return v if 0 <= v < n else None

        if model == "llama":
            self.kind = "spm"
            self.bos_id = _id("tokenizer.ggml.bos_token_id", 1)
            self.eos_id = _id("tokenizer.ggml.eos_token_id", 2)
            self.unk_id = _id("tokenizer.ggml.unknown_token_id", 0)
            self.add_space_prefix = bool(md.get("tokenizer.ggml.add_space_prefix", True))
            self.add_bos = bool(md.get("tokenizer.ggml.add_bos_token", True))
            self.add_eos = bool(md.get("tokenizer.ggml.add_eos_token", False))
            self.clean_spaces = False
        elif model == "gpt2":
            self.kind = "bpe"
            self.bos_id = _id("tokenizer.ggml.bos_token_id", 11)
            self.eos_id = _id("tokenizer.ggml.eos_token_id", 11)
            self.unk_id = _id("tokenizer.ggml.unknown_token_id", None)
            self.add_space_prefix = bool(md.get("tokenizer.ggml.add_space_prefix", False))
            pre = md.get("tokenizer.ggml.pre") or "default"
            if pre not in _PRE_TOKENIZERS:
                warnings.warn(f"pykv.files.tokenizer: unknown pre-tokenizer {pre!r}; falling back to 'gpt2'",
                              stacklevel=2)
                pre_cfg = _PRE_TOKENIZERS["gpt2"]
            else:
                pre_cfg = _PRE_TOKENIZERS[pre]
            self.pre = pre
            exprs, self.clean_spaces, self.ignore_merges = pre_cfg
            self._pre_regexes = [regex.compile(e) for e in exprs]
            self.add_bos = bool(md.get("tokenizer.ggml.add_bos_token", pre in ("llama-bpe", "llama3", "llama-v3")))
            self.add_eos = bool(md.get("tokenizer.ggml.add_eos_token", False))
            self.bpe_ranks: dict[tuple[str, str], int] = {}
            for rank, m in enumerate(md.get("tokenizer.ggml.merges", [])):
                pos = m.find(" ", 1)
                if pos < 0:
                    continue
                self.bpe_ranks.setdefault((m[:pos], m[pos + 1:]), rank)
            self._bpe_cache: dict[str, tuple[int, ...]] = {}
        else:
            raise ValueError(f"unsupported tokenizer model {model!r} (expected 'gpt2' or 'llama')")

        if self.add_bos and self.bos_id is None:
            raise ValueError("add_bos_token is true but bos_token_id is not set")
        if self.add_eos and self.eos_id is None:
            raise ValueError("add_eos_token is true but eos_token_id is not set")

        # end-of-generation ids, following llama.cpp's vocab loader
        eog: set[int] = set()
        for t, i in self.token_to_id.items():
            if t in _EOG_TEXTS or t in _FIM_EOG_TEXTS:
                eog.add(i)
                if types[i] != TOKEN_CONTROL:
                    types[i] = TOKEN_CONTROL  # llama.cpp forces these to control
        for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
            if key in md:
                v = _id(key, None)
                if v is not None:
                    eog.add(v)
        if self.eos_id is not None:
            eog.add(self.eos_id)
        self.eog_ids: set[int] = eog

        # special tokens searched in the text (longest first), as llama.cpp
        special = [i for i, t in enumerate(types) if t in (TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNKNOWN)]
        special.sort(key=lambda i: (-len(tokens[i].encode("utf-8")), i))
        self._special_ids = special

        # per-token pieces (bytes), rendered with special=True
        self._pieces: list[bytes] = [self._make_piece(i) for i in range(n)]

        if self.kind == "spm":
            self._init_spm()

    @classmethod
    def from_metadata(cls, md: dict) -> "Tokenizer":
        return cls(md)

    # --------------------------------------------------------------- pieces
    def _make_piece(self, tid: int) -> bytes:
        text = self.tokens[tid]
        typ = self.token_types[tid]
        if typ in (TOKEN_CONTROL, TOKEN_UNKNOWN, TOKEN_USER_DEFINED):
            return text.encode("utf-8")
        if typ == TOKEN_BYTE:
            if self.kind == "spm" or (text.startswith("<0x") and text.endswith(">")):
                return bytes([int(text[3:5], 16)])
        if typ in (TOKEN_NORMAL, TOKEN_BYTE):
            if self.kind == "spm":
                return text.replace("\u2581", " ").encode("utf-8")
            return _byte_decode(text)
        return b""  # unused / undefined tokens render as nothing

    def token_bytes(self, tid: int) -> bytes:
        """Raw bytes of one token's piece (control tokens render as their text)."""
        return self._pieces[tid]

    def is_control(self, tid: int) -> bool:
        return self.token_types[tid] in (TOKEN_CONTROL, TOKEN_UNKNOWN)

    def is_eog(self, tid: int) -> bool:
        return tid in self.eog_ids

    # --------------------------------------------------------------- encode
    def _partition(self, text: str, parse_special: bool):
        """Split text into [str | int] fragments (llama.cpp tokenizer_st_partition)."""
        frags: list = [text] if text else []
        for sid in self._special_ids:
            typ = self.token_types[sid]
            if not parse_special and typ in (TOKEN_CONTROL, TOKEN_UNKNOWN):
                continue
            stext = self.tokens[sid]
            if not stext:
                continue
            new: list = []
            changed = False
            for f in frags:
                if isinstance(f, int) or stext not in f:
                    new.append(f)
                    continue
                changed = True
                pieces = f.split(stext)
                for k, p in enumerate(pieces):
                    if k:
                        new.append(sid)
                    if p:
                        new.append(p)
            if changed:
                frags = new
        return frags

    def encode(self, text: str, add_special: bool = True, parse_special: bool = True) -> list[int]:
        """Token ids of ``text`` (llama.cpp ``llama_tokenize`` semantics).

        add_special: prepend BOS / append EOS if the model's add_bos / add_eos flags say so.
        parse_special: map control-token text (e.g. ``<|im_start|>``) to its id.
        """
        out: list[int] = []
        if add_special and self.add_bos:
            out.append(self.bos_id)
        frags = self._partition(text, parse_special)
        if self.kind == "bpe":
            for f in frags:
                if isinstance(f, int):
                    out.append(f)
                else:
                    self._bpe_encode_fragment(f, out)
        else:
            prev_special = True
            for f in frags:
                if isinstance(f, int):
                    out.append(f)
                    prev_special = True
                else:
                    if self.add_space_prefix and prev_special:
                        f = " " + f
                    out.extend(self._sp.encode(f))
                    prev_special = False
        if add_special and self.add_eos:
            out.append(self.eos_id)
        return out

    # BPE -----------------------------------------------------------------
    def _pre_split(self, text: str) -> list[str]:
        words = [text]
        for rx in self._pre_regexes:
            nxt: list[str] = []
            for w in words:
                pos = 0
                for m in rx.finditer(w):
                    s, e = m.span()
                    if s > pos:
                        nxt.append(w[pos:s])
                    if e > s:
                        nxt.append(w[s:e])
                    pos = e
                if pos < len(w):
                    nxt.append(w[pos:])
            words = nxt
        return words

    def _bpe_encode_fragment(self, text: str, out: list[int]) -> None:
        cache = self._bpe_cache
        for word in self._pre_split(text):
            ids = cache.get(word)
            if ids is None:
                ids = self._bpe_word(_byte_encode(word))
                if len(cache) < 200_000:
                    cache[word] = ids
            out.extend(ids)

    def _bpe_word(self, word: str) -> tuple[int, ...]:
        t2i = self.token_to_id
        if self.ignore_merges and word in t2i:
            return (t2i[word],)
        parts = list(word)
        ranks = self.bpe_ranks
        big = 1 << 62
        while len(parts) > 1:
            # lowest-rank adjacent pair; all its (non-overlapping, left-to-right)
            # occurrences are merged, which is equivalent to llama.cpp's heap
            best = big
            best_pair = None
            for a, b in zip(parts, parts[1:]):
                r = ranks.get((a, b), big)
                if r < best:
                    best = r
                    best_pair = (a, b)
            if best_pair is None:
                break
            a, b = best_pair
            merged = a + b
            new = []
            i = 0
            n = len(parts)
            while i < n:
                if i < n - 1 and parts[i] == a and parts[i + 1] == b:
                    new.append(merged)
                    i += 2
                else:
                    new.append(parts[i])
                    i += 1
            parts = new
        ids = []
        for p in parts:
            tid = t2i.get(p)
            if tid is not None:
                ids.append(tid)
            else:
                # llama.cpp: fall back to single-byte lookups of the symbol's UTF-8
                for byte in p.encode("utf-8"):
                    tid = t2i.get(chr(byte)) if byte < 0x80 else None
                    if tid is not None:
                        ids.append(tid)
        return tuple(ids)

    # SPM -----------------------------------------------------------------
    def _init_spm(self) -> None:
        import sentencepiece as spm

        types = list(self.token_types)
        n = self.n_vocab
        # sentencepiece needs exactly one UNKNOWN piece
        unk = [i for i, t in enumerate(types) if t == TOKEN_UNKNOWN]
        if not unk:
            u = self.unk_id if self.unk_id is not None else 0
            types[u] = TOKEN_UNKNOWN
            unk = [u]
        for extra in unk[1:]:
            types[extra] = TOKEN_CONTROL
        byte_texts = {self.tokens[i] for i, t in enumerate(types) if t == TOKEN_BYTE}
        byte_fallback = len(byte_texts) == 256     # sentencepiece wants 256 distinct <0xNN> pieces
        if byte_texts and not byte_fallback:
            types = [TOKEN_NORMAL if t == TOKEN_BYTE else t for t in types]
        # map our ids <-> proto ids; duplicate / empty pieces are not accepted
        # by sentencepiece, so drop them from the proto (they can't be produced)
        seen = set()
        keep = []
        for i, t in enumerate(self.tokens):
            if t and t not in seen:
                seen.add(t)
                keep.append(i)
        identity = len(keep) == n
        # no dummy prefix: like llama.cpp, the tokenizer prepends the space itself (only to
        # fragments that start the text or follow a special token)
        proto = build_spm_model(
            [(self.tokens[i].encode("utf-8"), self.scores[i], types[i]) for i in keep],
            unk_id=keep.index(unk[0]) if not identity else unk[0],
            bos_id=-1, eos_id=-1, pad_id=-1, add_dummy_prefix=False, byte_fallback=byte_fallback)
        sp = spm.SentencePieceProcessor()
        try:
            sp.LoadFromSerializedProto(proto)
        except RuntimeError as e:
            raise PykvError(f"tokenizer: sentencepiece refuses this vocabulary: {str(e).splitlines()[0]}") from None
        if identity:
            self._sp = sp
        else:
            self._sp = _RemappedSP(sp, keep)

    # --------------------------------------------------------------- decode
    def decode(self, ids: Iterable[int], special: bool = True, remove_special: bool = False) -> str:
        """Text of ``ids`` (llama.cpp ``llama_detokenize`` / ``common_detokenize``).

        special: render control tokens as their text (llama.cpp ``unparse_special``;
                 common_detokenize's default is True).
        remove_special: drop a leading BOS / trailing EOS when add_bos / add_eos.
        Bytes that do not form valid UTF-8 become U+FFFD.
        """
        return self.decode_bytes(ids, special=special, remove_special=remove_special).decode("utf-8", "replace")

    def decode_bytes(self, ids: Iterable[int], special: bool = True, remove_special: bool = False) -> bytes:
        ids = [int(i) for i in ids]
        remove_space = self.add_space_prefix
        if remove_special and self.add_bos and ids and ids[0] == self.bos_id:
            remove_space = False
            ids = ids[1:]
        if remove_special and self.add_eos and ids and ids[-1] == self.eos_id:
            ids = ids[:-1]
        buf = bytearray()
        for tid in ids:
            if not special and self.token_types[tid] in (TOKEN_CONTROL, TOKEN_UNKNOWN):
                piece = b""
            else:
                piece = self._pieces[tid]
                if remove_space and piece[:1] == b" ":
                    piece = piece[1:]
            remove_space = False
            buf += piece
        if self.clean_spaces:
            buf = _clean_spaces(bytes(buf))
        return bytes(buf)


class _RemappedSP:
    """Wraps a SentencePieceProcessor whose piece ids are a subset of the vocab."""

    def __init__(self, sp, keep):
        self.sp = sp
        self.keep = keep

    def encode(self, text):
        return [self.keep[i] for i in self.sp.encode(text)]


def _clean_spaces(text: bytes) -> bytes:
    """llama.cpp's clean_spaces post-processing of detokenized text."""
    # pass 1: " ?", " !", " .", " ," -> drop the space
    out = bytearray()
    for i, x in enumerate(text):
        if i > 0 and text[i - 1] == 0x20 and x in b"?!.,":
            out.pop()
        out.append(x)
    # pass 2: " ' " -> "'"
    t = bytearray(out)
    out = bytearray()
    i = 0
    n = len(t)
    while i < n:
        x = t[i]
        if i > 0 and x == 0x27 and i + 1 < n and t[i - 1] == 0x20 and t[i + 1] == 0x20:
            out.pop()
            out.append(x)
            t[i + 1] = 0  # llama.cpp overwrites the skipped space with NUL
            i += 2
            continue
        out.append(x)
        i += 1
    # pass 3: " 's", " 'm", " 're", " 've" -> drop the space
    t = bytes(out)
    out = bytearray()
    n = len(t)
    for i, x in enumerate(t):
        if i > 0 and t[i - 1] == 0x20 and x == 0x27 and i + 1 < n:
            x1 = t[i + 1]
            if x1 in b"sm":
                out.pop()
            elif i + 2 < n and t[i + 1:i + 3] in (b"re", b"ve"):
                out.pop()
        out.append(x)
    return bytes(out)


class StreamDecoder:
    """Incremental detokenizer that never splits a multi-byte UTF-8 character.

    Pieces are concatenated like llama.cpp's ``common_token_to_piece`` (no
    leading-space stripping, no clean-up); control tokens render as their text.
    """

    def __init__(self, tok: Tokenizer, special: bool = True):
        self.tok = tok
        self.special = special
        self._dec = codecs.getincrementaldecoder("utf-8")("replace")

    def feed(self, tid: int) -> str:
        tid = int(tid)
        if not self.special and self.tok.is_control(tid):
            return ""
        return self._dec.decode(self.tok.token_bytes(tid))

    def flush(self) -> str:
        out = self._dec.decode(b"", final=True)
        self._dec.reset()
        return out


# ---------------------------------------------------------------------------
# GGUF convenience
# ---------------------------------------------------------------------------

def _field_value(field):
    try:
        return field.contents()
    except Exception:  # pragma: no cover - older gguf versions
        import gguf
        if len(field.types) == 1 and field.types[0] == gguf.GGUFValueType.STRING:
            return bytes(field.parts[field.data[0]]).decode("utf-8")
        return field.parts[field.data[0]].tolist()


def tokenizer_from_gguf(reader) -> Tokenizer:
    """Build a Tokenizer from a ``gguf.GGUFReader`` (or a path to a .gguf file)."""
    if isinstance(reader, (str, bytes)) or hasattr(reader, "__fspath__"):
        import gguf
        reader = gguf.GGUFReader(reader)
    md = {}
    for key, field in reader.fields.items():
        if key.startswith("tokenizer.ggml.") or key == "tokenizer.chat_template":
            md[key] = _field_value(field)
    return Tokenizer.from_metadata(md)
