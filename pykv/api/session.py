"""Sessions: one sequence in the model's shared KV page pool that keeps its cache between calls.

A session holds its text as token ids (`tokens`); the KV cache holds `tokens[:n_cached]`, every id
but the last sampled one, which is run first by the next call. A new call feeds only what the cache
does not already hold: new text that shares a prefix with the cached ids reuses it, and where it
diverges the cache is cut back to the common prefix. `fork()` shares the pages copy-on-write, and
`save()` / `Session.load()` write and read the pages as stored (quantized), see STATE FILES below.
"""
from __future__ import annotations

import hashlib
import json
import os
import struct
import time
import weakref
import zlib

import numpy as np

from pykv.files.config import PykvError
from pykv.api.generate import make_sampler, sample_loop, stop_list

# ---- STATE FILES -----------------------------------------------------------------------------------
#   prefix   "<8sII": STATE_MAGIC, STATE_VERSION, header length H
#   header   H bytes of UTF-8 JSON: model fingerprint, KV types per layer, page size, rotation flag,
#            key smoothing per layer, cached token count, messages, and the array table
#            [name, dtype, shape, crc32] (token ids, then KVCache.export_seq's arrays: the pages as
#            stored, the f16 sink rows and KIVI ring, the key smoothing shift/scale)
#   crc32    "<I" of prefix + header
#   payload  the arrays' bytes, in the table's order
STATE_MAGIC = b"PYKVSES\x00"
STATE_VERSION = 1
_PREFIX = struct.Struct("<8sII")
_CRC = struct.Struct("<I")
MAX_HEADER = 1 << 28


def gguf_fingerprint(gf) -> str:
    """sha256 of a GGUF's metadata (every key and value), its tensor table (name, type, shape,
    offset) and the first 64 bytes of each tensor's data."""
    h = hashlib.sha256()
    h.update(json.dumps(gf.metadata, sort_keys=True, default=str).encode())
    for name in sorted(gf.tensors):
        ti = gf.tensors[name]
        h.update(json.dumps([name, int(ti.ggml_type), list(ti.shape)]).encode())
        h.update(np.ascontiguousarray(ti.data).reshape(-1).view(np.uint8)[:64].tobytes())
    return h.hexdigest()


def _release(cache, seq) -> None:
    cache.free_sequence(seq)


def _common_prefix(a, b) -> int:
    n = min(len(a), len(b))
    if n == 0:
        return 0
    diff = np.flatnonzero(np.asarray(a[:n], np.int64) != np.asarray(b[:n], np.int64))
    return int(diff[0]) if diff.size else n


class Session:
    """One conversation or text stream whose KV cache stays in the model's page pool between calls.

    Make one with `model.session()`. `generate` appends text and continues it (an empty prompt just
    continues); `chat`, `create_completion` and `create_chat_completion` take the whole prompt or
    conversation and run only what the cache lacks. Counters: `stats` (the last call: prompt_tokens,
    cached_tokens reused, prefill_tokens run, gen_tokens, finish_reason, seconds), `n_prefilled` and
    `n_generated` (all calls). `close()` gives the pages back (also done when it is collected)."""

    def __init__(self, model, _seq=None):
        if model.be.name != "cpu":   # copy-on-write and state files copy pages with numpy indexing
            raise PykvError(f"sessions run on the CPU backend for now (this model is on {model.be.name})")
        self.model = model
        self.cache = model.cache
        self.seq = _seq if _seq is not None else self.cache.new_sequence()
        self.tokens: list[int] = []        # the session's text; the cache holds tokens[:n_cached]
        self.messages: list | None = None  # the conversation of the last chat call, reply included
        self.stats: dict = {}
        self.n_prefilled = 0
        self.n_generated = 0
        self._epoch = 0
        self._closed = False
        self._finalizer = weakref.finalize(self, _release, self.cache, self.seq)

    # ---- state ---------------------------------------------------------------------------------
    @property
    def n_cached(self) -> int:
        """Tokens held in the KV cache."""
        return self.seq.n_tokens

    @property
    def text(self) -> str:
        """The session's text (prompts and replies so far)."""
        return self.model.detokenize(self.tokens)

    def kv_bytes(self) -> int:
        """Bytes of KV cache this session holds: its pages (shared ones counted in full) and its
        per-sequence f16 rows (sink tokens, KIVI window)."""
        extra = sum(a.nbytes for a in self.seq.sink.values()) + sum(a.nbytes for a in self.seq.residual.values())
        return self.cache.n_pages_held(self.seq) * self.cache.bytes_per_page + extra

    def _check(self) -> None:
        if self._closed:
            raise PykvError("this session is closed")
        if self.cache is not self.model.cache:
            raise PykvError("the model's KV cache was replaced (set_kv_types): this session is gone")

    def reset(self) -> None:
        """Forget everything: the cache and the text."""
        self._check()
        self._epoch += 1
        self.cache.truncate(self.seq, 0)
        self.tokens, self.messages = [], None

    def close(self) -> None:
        """Give the session's pages back to the pool (pages shared with a fork stay with the fork)."""
        self._epoch += 1
        self._closed = True
        self._finalizer()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    def fork(self) -> "Session":
        """A new session with the same text and cache. The pages are shared, copy-on-write: a common
        system prompt is stored once, and a page is copied only when one of the two writes into it."""
        self._check()
        s = Session(self.model, self.cache.fork(self.seq))
        s.tokens = list(self.tokens)
        s.messages = None if self.messages is None else list(self.messages)
        return s

    # ---- feeding -------------------------------------------------------------------------------
    def _prefill(self, ids, stats) -> list:
        """Cut the cache back to the longest cached prefix of ids (all but the last id, whose logits
        are needed) and return the ids still to feed (ids[k:], at least the last one)."""
        cache, seq = self.cache, self.seq
        n = seq.n_tokens
        k = min(_common_prefix(self.tokens[:n], ids), len(ids) - 1)
        if k < n:
            if not cache.can_truncate(seq, k):    # KIVI pages already quantized: start over
                k = 0
            cache.truncate(seq, k)
        self.tokens = list(ids)                   # tokens[:n_cached] is what the cache holds, always
        stats["cached_tokens"], stats["prefill_tokens"] = k, len(ids) - k
        self.n_prefilled += len(ids) - k
        return ids[k:]

    def _room(self, n_prompt: int, max_tokens) -> int:
        n_ctx = self.model.n_ctx
        if max_tokens is not None and max_tokens < 0:
            max_tokens = None
        if n_prompt >= n_ctx or (max_tokens is not None and n_prompt + max_tokens > n_ctx):
            what = f" + max_tokens {max_tokens}" if max_tokens is not None else ""
            raise PykvError(f"context full: {n_prompt} prompt tokens{what} exceed the context size {n_ctx} "
                            f"(use a larger n_ctx / -c, or fewer max_tokens)")
        return n_ctx - n_prompt if max_tokens is None else int(max_tokens)

    def _stream(self, ids, max_tokens, sampling: dict, stop, on_done=None):
        """Checks now, then a generator: prefill what the cache lacks of `ids`, sample, stream text."""
        self._check()
        ids = [int(i) for i in ids]
        if not ids:
            raise PykvError("empty prompt")
        if min(ids) < 0 or max(ids) >= self.model.n_vocab:
            raise PykvError(f"token id out of range [0, {self.model.n_vocab})")
        max_new = self._room(len(ids), max_tokens)
        sampler = make_sampler(self.model, **sampling)
        stops = stop_list(stop)
        self._epoch += 1
        epoch = self._epoch
        stats = self.stats = {"prompt_tokens": len(ids), "cached_tokens": 0, "prefill_tokens": 0, "prompt_s": 0.0,
                              "gen_tokens": 0, "gen_s": 0.0, "finish_reason": None}

        def run():
            text = []
            try:
                if self._epoch != epoch:
                    raise PykvError("this session started another call before this one ran")
                feed = self._prefill(ids, stats)
                for piece in sample_loop(self.model, self.seq, feed, self.tokens, sampler, max_new, stops, stats):
                    text.append(piece)
                    yield piece
                    if self._epoch != epoch:
                        raise PykvError("this session started another call; the earlier reply stops here")
            finally:
                if self._epoch == epoch:
                    self.n_generated += stats["gen_tokens"]
                    if on_done is not None:
                        on_done("".join(text))

        return run()

    # ---- generation ----------------------------------------------------------------------------
    def generate(self, prompt="", max_tokens: int | None = 128, temperature: float = 0.8, top_k: int = 40,
                 top_p: float = 0.95, min_p: float = 0.05, repeat_penalty: float = 1.0, seed=None, stop=()):
        """Append `prompt` (a str, or token ids) to the session's text and stream the continuation.
        An empty prompt continues from where the session stopped (also right after Session.load).
        max_tokens None: up to the context size. The prompt plus max_tokens must fit the context
        (else a PykvError before anything runs). Generation stops at an end-of-generation token of
        the model, at a stop string (matched across token boundaries, not emitted) or at max_tokens."""
        self._check()
        if isinstance(prompt, str):
            if not prompt:
                new = []
            elif self.tokens:
                new = self.model.tokenizer.encode(prompt, add_special=False, parse_special=True)
            else:
                new = self.model.tokenize(prompt)
        else:
            new = [int(i) for i in prompt]
        self.messages = None
        return self._stream(self.tokens + new, max_tokens,
                            dict(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                                 repeat_penalty=repeat_penalty, seed=seed), stop)

    def _chat_ids(self, messages, max_tokens, tools, drop_oldest):
        from pykv.api.chat import fit_messages
        tok = self.model.tokenizer

        def render_ids(msgs):
            text = self.model.apply_chat_template(msgs, add_generation_prompt=True, tools=tools)
            return tok.encode(text, add_special=False, parse_special=True)

        return fit_messages(render_ids, messages, self.model.n_ctx, max_tokens, drop_oldest)

    def _chat_stops(self, stop):
        from pykv.api.chat import CHATML_STOP, CHATML_TEMPLATE
        stops = stop_list(stop)
        if self.model.chat_template == CHATML_TEMPLATE and CHATML_STOP not in stops:
            stops.append(CHATML_STOP)
        return stops

    def chat(self, messages, max_tokens: int | None = None, temperature: float = 0.8, top_k: int = 40,
             top_p: float = 0.95, min_p: float = 0.05, repeat_penalty: float = 1.0, seed=None, stop=(),
             tools=None, drop_oldest: bool = False):
        """Stream the assistant's reply to `messages` (the whole conversation, rendered with the chat
        template). Only the tokens the cache lacks are run: a second turn prefills just the new turn.
        A conversation that does not fit the context with max_tokens raises a PykvError, or with
        drop_oldest=True loses its oldest turns (system messages stay). Afterwards `messages` holds
        the conversation that was used, the reply appended."""
        ids, used = self._chat_ids(messages, max_tokens, tools, drop_oldest)

        def done(reply):
            self.messages = list(used) + [{"role": "assistant", "content": reply}]

        return self._stream(ids, max_tokens, dict(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                                                  repeat_penalty=repeat_penalty, seed=seed),
                            self._chat_stops(stop), done)

    def create_completion(self, prompt, max_tokens: int | None = 16, temperature: float = 0.8, top_p: float = 0.95,
                          min_p: float = 0.05, top_k: int = 40, repeat_penalty: float = 1.0, seed=None, stop=None,
                          stream: bool = False, echo: bool = False):
        """llama-cpp-python's create_completion: `prompt` is the whole text (a str or token ids; the
        cached prefix it shares is reused). Returns {"id", "object": "text_completion", "created",
        "model", "choices": [{"text", "index", "logprobs", "finish_reason"}], "usage": {...}}; with
        stream=True an iterator of chunks of that shape (the last has finish_reason and usage).
        finish_reason: "stop" (end-of-generation token or stop string) or "length"."""
        from pykv.api.chat import completion_result
        ids = self.model.tokenize(prompt) if isinstance(prompt, str) else list(prompt)
        self.messages = None
        gen = self._stream(ids, max_tokens, dict(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                                                 repeat_penalty=repeat_penalty, seed=seed), stop)
        prefix = (prompt if isinstance(prompt, str) else self.model.detokenize(ids)) if echo else ""
        return completion_result(gen, self.stats, os.path.basename(self.model.path), False, stream, prefix)

    def create_chat_completion(self, messages, max_tokens: int | None = None, temperature: float = 0.2,
                               top_p: float = 0.95, min_p: float = 0.05, top_k: int = 40,
                               repeat_penalty: float = 1.0, seed=None, stop=None, stream: bool = False,
                               tools=None, drop_oldest: bool = False):
        """llama-cpp-python's create_chat_completion: returns {"id", "object": "chat.completion",
        "created", "model", "choices": [{"index", "message": {"role": "assistant", "content"},
        "logprobs", "finish_reason"}], "usage": {...}}; with stream=True an iterator of
        "chat.completion.chunk" dicts (a first delta with the role, then content deltas, then one with
        finish_reason and usage). `tools` reaches the template only (no tool-call parsing)."""
        from pykv.api.chat import completion_result
        gen = self.chat(messages, max_tokens=max_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                        min_p=min_p, repeat_penalty=repeat_penalty, seed=seed, stop=stop, tools=tools,
                        drop_oldest=drop_oldest)
        return completion_result(gen, self.stats, os.path.basename(self.model.path), True, stream)

    # ---- state files ---------------------------------------------------------------------------
    def _layout(self) -> dict:
        c = self.cache
        return {"kv_k": [l.k_fmt.name for l in c.layers], "kv_v": [l.v_fmt.name for l in c.layers],
                "page_tokens": c.P, "rotate": bool(self.model.rotate), "k_smooth": [bool(x) for x in c.k_smooth],
                "k_pre": [bool(x) for x in c.k_pre], "k_xf": c.key_xf_id()}

    def save(self, path) -> int:
        """Write the session to a state file (temp file, then rename): the model's fingerprint, the KV
        types, rotation and key smoothing state, the token ids, the messages, and the cache pages as
        stored (quantized: a q4_0 file is about 28 % of an f16 one). Returns the bytes written."""
        self._check()
        arrays = {"tokens": np.asarray(self.tokens, np.int32)}
        arrays.update(self.cache.export_seq(self.seq))
        table = []
        for name, a in arrays.items():
            a = arrays[name] = np.ascontiguousarray(a)
            table.append([name, a.dtype.str, list(a.shape), zlib.crc32(memoryview(a).cast("B"))])
        header = json.dumps({"fingerprint": self.model.fingerprint(), "model": os.path.basename(self.model.path),
                             **self._layout(), "n_cached": self.seq.n_tokens, "messages": self.messages,
                             "arrays": table}).encode()
        head = _PREFIX.pack(STATE_MAGIC, STATE_VERSION, len(header)) + header
        path = os.fspath(path)
        tmp = f"{path}.tmp-{os.getpid()}"
        try:
            with open(tmp, "wb") as f:
                f.write(head)
                f.write(_CRC.pack(zlib.crc32(head)))
                for a in arrays.values():
                    f.write(memoryview(a).cast("B"))
                size = f.tell()
            os.replace(tmp, path)
        except OSError as e:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise PykvError(f"cannot write state file {path}: {e.strerror or e}") from None
        return size

    @classmethod
    def load(cls, model, path) -> "Session":
        """A new session of `model` from a state file written by Session.save. Refused with a one-line
        PykvError: another model's file, other KV types / rotation / page size than the model's cache,
        a truncated or corrupt file (magic, version, header checksum, array checksums)."""
        path = os.fspath(path)
        try:
            with open(path, "rb") as f:
                raw = f.read()
        except OSError as e:
            raise PykvError(f"cannot read state file {path}: {e.strerror or e}") from None
        if len(raw) < _PREFIX.size or raw[:8] != STATE_MAGIC:
            raise PykvError(f"not a pykv session state file: {path}")
        _, version, hlen = _PREFIX.unpack_from(raw)
        end = _PREFIX.size + hlen
        if hlen > MAX_HEADER or end + _CRC.size > len(raw):
            raise PykvError(f"truncated or corrupt state file (header): {path}")
        if _CRC.unpack_from(raw, end)[0] != zlib.crc32(raw[:end]):
            raise PykvError(f"corrupt state file (header checksum mismatch): {path}")
        if version != STATE_VERSION:
            raise PykvError(f"state file format version {version}, this pykv reads {STATE_VERSION}: {path}")
        try:
            h = json.loads(raw[_PREFIX.size:end])
            table = [(str(n), np.dtype(d), tuple(int(x) for x in s), int(c)) for n, d, s, c in h["arrays"]]
            n_cached = int(h["n_cached"])
        except (ValueError, KeyError, TypeError) as e:
            raise PykvError(f"corrupt state file (header: {e}): {path}") from None
        if h.get("fingerprint") != model.fingerprint():
            raise PykvError(f"state file {path} was saved from another model ({h.get('model')}), "
                            f"not {os.path.basename(model.path)}")
        s = cls(model)
        try:
            want = s._layout()
            got = {k: h.get(k) for k in want}
            if got != want:
                def kv(d):
                    try:
                        return (f"{','.join(map(str, dict.fromkeys(d['kv_k'] or [])))}/"
                                f"{','.join(map(str, dict.fromkeys(d['kv_v'] or [])))} "
                                f"KV, rotation {'on' if d['rotate'] else 'off'}, pages of {d['page_tokens']}")
                    except (TypeError, KeyError, ValueError):   # a header field of the wrong type
                        raise PykvError(f"corrupt state file (header layout): {path}") from None
                raise PykvError(f"state file {path} holds a {kv(got)}; this model's cache has {kv(want)} "
                                f"(load the model with the same KV types)")
            need = end + _CRC.size + sum(dt.itemsize * int(np.prod(sh)) for _, dt, sh, _ in table)
            if len(raw) != need:
                raise PykvError(f"truncated or corrupt state file: {len(raw)} bytes, {need} expected: {path}")
            arrays, off = {}, end + _CRC.size
            for name, dt, shape, crc in table:
                nb = dt.itemsize * int(np.prod(shape))
                if zlib.crc32(raw[off:off + nb]) != crc:
                    raise PykvError(f"corrupt state file (array {name} checksum mismatch): {path}")
                arrays[name] = np.frombuffer(raw, dt, nb // dt.itemsize, off).reshape(shape)
                off += nb
            tokens = arrays.pop("tokens", None)
            if tokens is None or tokens.ndim != 1 or not n_cached <= len(tokens) <= model.n_ctx or \
                    (len(tokens) and (tokens.min() < 0 or tokens.max() >= model.n_vocab)):
                raise PykvError(f"state file {path} holds bad token ids, or more than the context size {model.n_ctx}")
            s.cache.import_seq(s.seq, n_cached, arrays)
        except BaseException:
            s.close()
            raise
        s.tokens = [int(t) for t in tokens]
        s.messages = h.get("messages")
        return s
