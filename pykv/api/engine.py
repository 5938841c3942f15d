"""Continuous batching: many requests decoded together over the model's one paged KV pool.

One engine thread owns the model. Each step (Decoder.step) runs every running request's next token
and, beside them, prompt chunks of requests still in prefill (the chunks _feed would cut, so a
request's bits do not depend on what it was batched with); requests join and leave between steps.
Admission is by the KV budget: a request is admitted when the pool can hold its prompt plus
max_tokens beside what the running requests may still take, so a running request never runs out of
pages and is never evicted; the others wait in a bounded queue (QueueFull when it is full).
Prefix caching: the full pages of a finished prompt stay in the pool, keyed by their tokens (a chain
of hashes, vLLM's automatic prefix caching), and a later request that begins with the same tokens
shares them (page reference counts) instead of running them again; the least recently used are
freed when admission needs their room.
"""
from __future__ import annotations

import hashlib
import math
import threading
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field

import numpy as np

from pykv.api.generate import StopText, make_sampler, stop_list
from pykv.files.config import PykvError


class QueueFull(PykvError):
    """The wait queue is full (the server answers 503)."""


class EngineClosed(PykvError):
    """The engine is draining or stopped: no new requests."""


@dataclass
class Request:
    """One generation request. on_event(dict) is called on the engine thread with
    {"type": "token", "text", "token", "logprob", "top_logprobs": [(id, text, logprob), ...]} per sampled
    token (text may be "",
    held back for a stop string), then once {"type": "done", "finish_reason": "stop" | "length" |
    "cancelled" | "error", "usage": {...}, "error": str | None}."""
    ids: list
    max_new: int
    sampler: object
    stops: list
    logprobs: int | None
    on_event: object
    seq: object = None
    fed: int = 0                  # prompt tokens in the cache (reused prefix included)
    cached: int = 0               # prompt tokens reused from the prefix cache
    need: int = 0                 # pages the request may hold at most (prompt + max_new)
    history: list = field(default_factory=list)
    gen: int = 0
    text: object = None           # its StopText
    t_submit: float = 0.0
    t_first: float | None = None
    cancelled: bool = False
    done: bool = False
    ignore_eos: bool = False      # end-of-generation tokens do not end it (benchmarks: exactly max_tokens)
    processor: object = None      # logits_processor(history, logits) -> logits, or None


@dataclass
class _Entry:
    page: int
    parent: bytes | None
    root: object                  # the lineage's per-sequence state (key smoothing, sink rows)
    children: int = 0


class PrefixCache:
    """Full KV pages of earlier prompts, keyed by a hash chain over their tokens. Each entry holds a
    reference on its page; a sequence that attaches one holds another. Only one lineage is kept per
    chain: an entry is added for a sequence's page only when the page before it is the chain's own,
    so a chain's pages were all quantized with one sequence's key smoothing (kept at its root)."""

    def __init__(self, cache):
        self.cache = cache
        self.P = cache.P
        self.entries: OrderedDict[bytes, _Entry] = OrderedDict()

    @staticmethod
    def _key(parent: bytes | None, ids) -> bytes:
        h = hashlib.blake2b(np.asarray(ids, np.int64).tobytes(), digest_size=16, key=parent or b"")
        return h.digest()

    def _root_state(self, seq):
        return (np.array(seq.k_shift), np.array(seq.k_scale), {k: np.array(v) for k, v in seq.sink.items()})

    def lookup(self, ids) -> list:
        """The longest chain of entries that ids begins with, leaving at least one id to run."""
        out, key, P = [], None, self.P
        while (len(out) + 1) * P <= len(ids) - 1:
            i = len(out)
            key = self._key(key, ids[i * P:(i + 1) * P])
            e = self.entries.get(key)
            if e is None:
                break
            out.append((key, e))
        return out

    def attach(self, seq, chain) -> int:
        """Give an empty sequence the chain's pages and its lineage's state; returns tokens attached."""
        if not chain:
            return 0
        c = self.cache
        for i, (key, e) in enumerate(chain):
            seq.page_table[i] = e.page
            c.page_refs[e.page] += 1
            self.entries.move_to_end(key)
        shift, scale, sink = chain[0][1].root
        seq.k_shift[...] = shift
        seq.k_scale[...] = scale
        for k, v in sink.items():
            seq.sink[k][...] = v
        seq.n_tokens = len(chain) * self.P
        c._upload(seq)
        return seq.n_tokens

    def register(self, seq, ids) -> None:
        """Add seq's full pages of ids (the tokens in its cache, in order) to the chain."""
        c, P, key, root = self.cache, self.P, None, None
        n = min(len(ids), seq.n_tokens) // P
        for i in range(n):
            page = int(seq.page_table[i])
            pkey, key = key, self._key(key, ids[i * P:(i + 1) * P])
            e = self.entries.get(key)
            if e is not None:
                if e.page != page:       # another lineage's page: this sequence's own copy stays private
                    return
                root = e.root
                self.entries.move_to_end(key)
                continue
            if root is None:
                root = self._root_state(seq)
            self.entries[key] = _Entry(page, pkey, root)
            c.page_refs[page] += 1
            if pkey is not None:
                self.entries[pkey].children += 1

    def evictable(self) -> int:
        """Pages only the prefix cache holds (freed by evict, leaves first)."""
        return sum(1 for e in self.entries.values() if self.cache.page_refs[e.page] == 1)

    def evict(self, n: int) -> int:
        """Free up to n pages held only by the cache, least recently used leaves first; returns freed."""
        freed, c = 0, self.cache
        while freed < n:
            victim = next((k for k, e in self.entries.items()
                           if e.children == 0 and c.page_refs[e.page] == 1), None)
            if victim is None:
                break
            e = self.entries.pop(victim)
            c.page_refs[e.page] -= 1
            c.free_pages.append(e.page)
            if e.parent is not None and e.parent in self.entries:
                self.entries[e.parent].children -= 1
            freed += 1
        return freed

    def clear(self) -> None:
        self.evict(len(self.entries))


class Engine:
    """Runs requests in continuous batches on one engine thread (start / stop). submit() is
    thread-safe. parallel: most requests decoding at once (the model needs max_seqs >= parallel);
    max_queue: requests waiting for room before QueueFull; prefix_cache: share earlier prompts' pages."""

    def __init__(self, model, parallel: int = 8, max_queue: int = 256, prefix_cache: bool = True):
        self.model = model
        self.cache = model.cache
        if parallel < 1:
            raise PykvError(f"parallel must be >= 1, got {parallel}")
        if model.step_rows < model.n_batch + parallel and parallel > 1:
            raise PykvError(f"the model runs {model.step_rows - model.n_batch} sequences per step; load it "
                            f"with max_seqs >= {parallel}")
        self.parallel, self.max_queue = int(parallel), int(max_queue)
        c = self.cache
        plain = all(f.kind != "kivi" for l in c.layers for f in (l.k_fmt, l.v_fmt)) and not c.W
        self.prefix = PrefixCache(c) if prefix_cache and plain and model.be.name == "cpu" else None
        self.queue: deque[Request] = deque()
        self.running: list[Request] = []
        self.cond = threading.Condition()
        self.thread = None
        self.closing = False
        self.error = None
        self.counters = {"requests": 0, "prompt_tokens": 0, "cached_tokens": 0, "prefix_hits": 0,
                         "generated_tokens": 0, "steps": 0, "rejected": 0}
        self.recent: deque = deque(maxlen=256)    # (time, tokens) of the newest steps
        self.peak_running = 0

    # ---- the caller's side (any thread) -------------------------------------------------------
    def submit(self, ids, on_event, max_tokens: int | None = 16, temperature: float = 0.8, top_k: int = 40,
               top_p: float = 0.95, min_p: float = 0.05, repeat_penalty: float = 1.0, seed=None, stop=(),
               logprobs: int | None = None, ignore_eos: bool = False, logits_processor=None) -> Request:
        """Queue a request for prompt ids; raises PykvError (it can never fit: the context or the
        pool), QueueFull or EngineClosed at once, else events follow on the engine thread.
        logits_processor(history, logits) -> logits: applied to each of its rows before sampling
        (history: the prompt and the tokens so far; logits: a float32 (V,) copy it may change in place)."""
        m = self.model
        ids = [int(i) for i in ids]
        if not ids:
            raise PykvError("empty prompt")
        if min(ids) < 0 or max(ids) >= m.n_vocab:
            raise PykvError(f"token id out of range [0, {m.n_vocab})")
        if len(ids) >= m.n_ctx:
            raise PykvError(f"prompt is {len(ids)} tokens; the context size is {m.n_ctx}")
        if max_tokens is not None and max_tokens == 0:
            raise PykvError("max_tokens must be at least 1")
        room = m.n_ctx - len(ids)
        max_new = room if max_tokens is None or max_tokens < 0 else min(int(max_tokens), room)
        if max_tokens is not None and max_tokens > room:
            raise PykvError(f"prompt ({len(ids)} tokens) + max_tokens ({max_tokens}) exceed the context "
                            f"size {m.n_ctx}")
        r = Request(ids, max_new, make_sampler(m, temperature, top_k, top_p, min_p, repeat_penalty, seed),
                    stop_list(stop), logprobs, on_event, ignore_eos=bool(ignore_eos), processor=logits_processor)
        r.need = math.ceil((len(ids) + max_new) / self.cache.P)
        if r.need > self.cache.n_pages:
            raise PykvError(f"the KV budget holds {self.cache.capacity_tokens()} tokens; this request needs "
                            f"{len(ids) + max_new} (prompt + max_tokens)")
        with self.cond:
            if self.closing or self.error is not None:
                raise EngineClosed("the server is shutting down" if self.error is None else
                                   f"the engine stopped: {self.error}")
            if len(self.queue) >= self.max_queue:
                self.counters["rejected"] += 1
                raise QueueFull(f"{len(self.queue)} requests are waiting already (the queue is full)")
            r.t_submit = time.perf_counter()
            r.history, r.text = list(ids), StopText(m.tokenizer, r.stops)
            self.queue.append(r)
            self.counters["requests"] += 1
            self.cond.notify()
        return r

    def cancel(self, r: Request) -> None:
        """Stop a request (its client went away): its pages are freed before the next step."""
        with self.cond:
            r.cancelled = True
            self.cond.notify()

    def start(self) -> "Engine":
        if self.thread is None:
            self.thread = threading.Thread(target=self._loop, name="pykv-engine", daemon=True)
            self.thread.start()
        return self

    def stop(self, drain: bool = True, timeout: float | None = None) -> None:
        """No new requests; drain: finish the running and queued ones first, else cancel them."""
        with self.cond:
            self.closing = True
            if not drain:
                for r in list(self.queue) + self.running:
                    r.cancelled = True
            self.cond.notify()
        if self.thread is not None:
            self.thread.join(timeout)

    def stats(self) -> dict:
        """Gauges for /metrics: running and queued requests, KV pages used / free / cached, bytes per
        token, tokens per second over the last few seconds, and the counters."""
        c = self.cache
        with self.cond:
            now = time.perf_counter()
            toks = sum(n for t, n in self.recent if now - t <= 5.0)
            return {"running": len(self.running), "queued": len(self.queue), "pages_total": c.n_pages,
                    "pages_free": len(c.free_pages), "pages_used": c.n_pages - len(c.free_pages),
                    "pages_cached": 0 if self.prefix is None else len(self.prefix.entries),
                    "page_tokens": c.P, "kv_bytes_per_token": c.bytes_per_token(), "tokens_per_s": toks / 5.0,
                    "peak_running": self.peak_running, **self.counters}

    # ---- the engine thread --------------------------------------------------------------------
    def _loop(self) -> None:
        try:
            while True:
                with self.cond:
                    self._reap()
                    self._admit()
                    if not self.running:
                        if self.closing and not self.queue:
                            return
                        self.cond.wait(0.5)
                        continue
                self._step()
        except BaseException as e:      # a kernel or model error: fail every request, refuse new ones
            with self.cond:
                self.error = f"{type(e).__name__}: {e}"
                for r in list(self.queue) + self.running:
                    self._finish(r, "error", self.error)
                self.queue.clear()
                self.running = []

    def _remaining(self) -> int:
        """Pages the running requests may still allocate (their reservations)."""
        c = self.cache
        return sum(max(0, r.need - c.n_pages_held(r.seq)) for r in self.running)

    def _admit(self) -> None:
        c = self.cache
        while self.queue and len(self.running) < self.parallel:
            r = self.queue[0]
            if r.cancelled:
                self.queue.popleft()
                self._finish(r, "cancelled")
                continue
            chain = self.prefix.lookup(r.ids) if self.prefix is not None else []
            want = r.need - len(chain) + self._remaining()
            if want > len(c.free_pages) and self.prefix is not None:
                self.prefix.evict(want - len(c.free_pages))
                chain = self.prefix.lookup(r.ids)        # eviction may have taken the chain's tail
                want = r.need - len(chain) + self._remaining()
            if want > len(c.free_pages):
                # first come, first served: the head waits for room, unless it could never get it (pages
                # held outside the engine: the model's own sequence, open sessions)
                held = sum(c.n_pages_held(x.seq) for x in self.running)
                ev = self.prefix.evictable() if self.prefix is not None else 0
                if r.need - len(chain) > len(c.free_pages) + held + ev:
                    self.queue.popleft()
                    self._finish(r, "error", f"the KV pool cannot hold this request: it needs {r.need} pages, "
                                             f"{len(c.free_pages) + held + ev} can be free")
                    continue
                return
            self.queue.popleft()
            r.seq = c.new_sequence()
            if self.prefix is not None and chain:
                r.fed = r.cached = self.prefix.attach(r.seq, chain)
                self.counters["cached_tokens"] += r.cached
                self.counters["prefix_hits"] += 1
            self.counters["prompt_tokens"] += len(r.ids)
            self.running.append(r)
            self.peak_running = max(self.peak_running, len(self.running))

    def _reap(self) -> None:
        for r in [r for r in self.running if r.cancelled]:
            self._finish(r, "cancelled")
        if any(r.cancelled for r in self.queue):     # a client that hung up while waiting frees its place
            for r in [r for r in self.queue if r.cancelled]:
                self.queue.remove(r)
                self._finish(r, "cancelled")

    def _release(self, r: Request) -> None:
        if r in self.running:
            self.running.remove(r)
        if r.seq is not None:
            if self.prefix is not None and not r.cancelled:
                self.prefix.register(r.seq, r.history)
            self.cache.free_sequence(r.seq)
            r.seq = None

    def _finish(self, r: Request, reason: str, error: str | None = None) -> None:
        self._release(r)
        if r.done:
            return
        r.done = True
        if reason in ("stop", "length"):
            rest = r.text.flush()
            if rest:
                self._emit(r, {"type": "token", "text": rest, "token": None, "logprob": None,
                               "top_logprobs": None})
        usage = {"prompt_tokens": len(r.ids), "completion_tokens": r.gen, "total_tokens": len(r.ids) + r.gen,
                 "prompt_tokens_details": {"cached_tokens": r.cached}}
        self._emit(r, {"type": "done", "finish_reason": reason, "usage": usage, "error": error,
                       "ttft": None if r.t_first is None else r.t_first - r.t_submit})

    def _emit(self, r: Request, ev: dict) -> None:
        try:
            r.on_event(ev)
        except Exception:        # a consumer's failure cancels its request only
            r.cancelled = True

    def _step(self) -> None:
        m, budget, work, rows = self.model, self.model.n_batch, [], []
        for r in self.running:
            if r.fed < len(r.ids):
                n = min(len(r.ids) - r.fed, m.chunk_limit(r.seq))
                if n <= budget:
                    work.append((r.seq, r.ids[r.fed:r.fed + n]))
                    rows.append((r, n))
                    budget -= n
            else:
                work.append((r.seq, r.history[-1:]))
                rows.append((r, 0))
        logits = m.step(work)
        now = time.perf_counter()
        self.counters["steps"] += 1
        n_tok = 0
        with self.cond:
            for (r, n), row in zip(rows, logits):
                if n:
                    r.fed += n
                    if r.fed < len(r.ids):
                        continue
                n_tok += 1
                self._sample(r, row, now)
            self.recent.append((now, n_tok))
            self.counters["generated_tokens"] += n_tok

    def _sample(self, r: Request, row: np.ndarray, now: float) -> None:
        m = self.model
        if r.processor is not None:      # its failure ends its own request only
            try:
                row = np.asarray(r.processor(r.history, row), np.float32)
                if row.shape != (m.n_vocab,):
                    raise ValueError(f"it returned shape {row.shape}, not ({m.n_vocab},)")
            except Exception as e:
                self._finish(r, "error", f"logits processor: {type(e).__name__}: {e}")
                return
        tid = r.sampler.pick(row, r.history, r.sampler.draw())
        if r.t_first is None:
            r.t_first = now
        r.history.append(tid)
        if m.tokenizer.is_eog(tid) and not r.ignore_eos:
            self._finish(r, "stop")
            return
        r.gen += 1
        lp = top = None
        if r.logprobs is not None:
            x = row.astype(np.float64)
            ls = x - (x.max() + np.log(np.exp(x - x.max()).sum()))
            lp = float(ls[tid])
            if r.logprobs > 0:
                k = min(int(r.logprobs), len(ls))
                best = np.argpartition(-ls, k - 1)[:k]
                best = best[np.argsort(-ls[best], kind="stable")]
                top = [(int(i), m.tokenizer.decode([int(i)]), float(ls[i])) for i in best]
        piece, stopped = r.text.feed(tid)
        self._emit(r, {"type": "token", "text": piece, "token": tid, "logprob": lp, "top_logprobs": top})
        if stopped:
            self._finish(r, "stop")
        elif r.gen >= r.max_new or r.seq.n_tokens >= m.n_ctx:
            self._finish(r, "length")
