"""The OpenAI-compatible HTTP API over an Engine (pykv serve): /v1/completions and /v1/chat/completions
(JSON, or server-sent events with stream), /v1/models, /health and Prometheus /metrics, on Starlette
and sse-starlette. The engine calls back on its own thread; each request's events cross to the event
loop through call_soon_threadsafe into the request's asyncio queue. A request whose client goes away
(a closed stream, or a non-streaming client seen gone by polling) is cancelled, so its KV pages are
freed before the engine's next step. Errors have OpenAI's shape: {"error": {message, type, param, code}}.
"""
from __future__ import annotations

import asyncio
import hmac
import json
import math
import time
import uuid
from contextlib import asynccontextmanager

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from sse_starlette import EventSourceResponse
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from pykv.api.chat import CHATML_STOP, CHATML_TEMPLATE
from pykv.api.engine import EngineClosed, QueueFull
from pykv.api.generate import stop_list
from pykv.files.config import PykvError

MAX_BODY = 4 << 20                 # bytes of a request body (413 above)
MAX_LOGPROBS = 20                  # most top logprobs per token
OFF_LOOP_CHARS = 8192              # prompts longer than this are tokenized on a worker thread
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
LATENCY_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


def _dumps(obj) -> str:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False)


class ApiError(Exception):
    """An error answered in OpenAI's shape with an HTTP status."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param=None, code=None,
                 headers=None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers

    def response(self) -> JSONResponse:
        return JSONResponse({"error": {"message": self.message, "type": self.type, "param": self.param,
                                       "code": self.code}}, status_code=self.status, headers=self.headers)


# ---- request fields ---------------------------------------------------------------------------------------

def _field(body: dict, name: str, kind, default=None, lo=None, hi=None):
    """body[name] checked as an int / float / bool within [lo, hi]; missing or null: default."""
    v = body.get(name)
    if v is None:
        return default
    if kind is bool:
        ok = isinstance(v, bool)
    elif kind is int:
        if isinstance(v, float) and v.is_integer():
            v = int(v)
        ok = isinstance(v, int) and not isinstance(v, bool)
    else:
        ok = isinstance(v, (int, float)) and not isinstance(v, bool)
        v = float(v) if ok else v
        ok = ok and math.isfinite(v)
    if not ok:
        what = {bool: "a boolean", int: "an integer"}.get(kind, "a number")
        raise ApiError(400, f"'{name}' must be {what}, got {_dumps(v)[:40]}", param=name, code="invalid_type")
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        rng = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise ApiError(400, f"'{name}' must be {rng}, got {v}", param=name, code="invalid_value")
    return v


def _sampling(body: dict) -> dict:
    """Sampling fields (pykv's defaults where missing: temperature 0.8, top_k 40, top_p 0.95, min_p 0.05), and
    llama-server's ignore_eos (benchmarks: exactly max_tokens)."""
    return dict(temperature=_field(body, "temperature", float, 0.8, 0.0), top_k=_field(body, "top_k", int, 40, 0),
                top_p=_field(body, "top_p", float, 0.95, 0.0, 1.0), min_p=_field(body, "min_p", float, 0.05, 0.0, 1.0),
                repeat_penalty=_field(body, "repeat_penalty", float, 1.0, 0.0),
                seed=_field(body, "seed", int, None), ignore_eos=_field(body, "ignore_eos", bool, False))


def _stops(body: dict) -> list:
    s = body.get("stop")
    if s is None or isinstance(s, str) or (isinstance(s, list) and all(isinstance(x, str) for x in s)):
        return stop_list(s)
    raise ApiError(400, "'stop' must be a string or a list of strings", param="stop", code="invalid_type")


def _text_content(content, i: int) -> str:
    """A message's content as text: a string, null, or a list of {"type": "text", "text": ...} parts."""
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        out = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ApiError(400, f"messages[{i}].content: only text parts are supported",
                               param=f"messages[{i}].content")
            out.append(part["text"])
        return "".join(out)
    raise ApiError(400, f"messages[{i}].content must be a string or a list of text parts",
                   param=f"messages[{i}].content", code="invalid_type")


async def _off_loop(fn, size: int, *args):
    """fn(*args), on a worker thread when the text is long (tokenizing megabytes would stall every stream)."""
    return await run_in_threadpool(fn, *args) if size > OFF_LOOP_CHARS else fn(*args)


# ---- what a request sends back ------------------------------------------------------------------------------

class _Output:
    """The text, logprobs and finish of one request, built from engine events, in chat or completion shape."""

    def __init__(self, tokenizer, chat: bool, n_top: int | None, offset: int = 0):
        self.tok, self.chat, self.n_top = tokenizer, chat, n_top
        self.texts: list[str] = []
        self.lp: list = []         # chat: content entries; completion: (token, logprob, top, offset)
        self.offset = offset       # completions' text_offset of the next token

    def add(self, ev: dict):
        """Record a token event; returns (text, logprobs entries of this event or None)."""
        text = ev["text"]
        self.texts.append(text)
        if self.n_top is None or ev["token"] is None or ev["logprob"] is None:
            return text, None
        piece = self.tok.decode([int(ev["token"])])
        top = ev.get("top_logprobs") or []      # [(id, text, logprob)], best first
        if self.chat:
            entry = {"token": piece, "logprob": ev["logprob"], "bytes": list(piece.encode("utf-8")),
                     "top_logprobs": [{"token": t, "logprob": v, "bytes": list(t.encode("utf-8"))}
                                      for _, t, v in top]}
        else:   # the legacy completions format is a dict by text (two ids of one text keep the better)
            entry = (piece, ev["logprob"], {t: v for _, t, v in reversed(top)} if self.n_top else None,
                     self.offset)
            self.offset += len(piece)
        self.lp.append(entry)
        return text, [entry]

    def logprobs(self, entries=None):
        """OpenAI's logprobs object of these entries (all of them by default); None when not asked."""
        if self.n_top is None:
            return None
        entries = self.lp if entries is None else entries
        if self.chat:
            return {"content": list(entries), "refusal": None}
        return {"tokens": [e[0] for e in entries], "token_logprobs": [e[1] for e in entries],
                "top_logprobs": [e[2] for e in entries], "text_offset": [e[3] for e in entries]}


class _Call:
    """One submitted request: engine events (engine thread) into an asyncio queue (event loop)."""

    def __init__(self, loop, metrics):
        self.loop, self.metrics = loop, metrics
        self.queue: asyncio.Queue = asyncio.Queue()
        self.req = None
        self.done = False
        self.t0 = time.perf_counter()

    def on_event(self, ev: dict) -> None:            # on the engine thread
        if ev["type"] == "done":
            self.metrics.observe(ev, self.t0)
        self.loop.call_soon_threadsafe(self.queue.put_nowait, ev)


# ---- metrics -------------------------------------------------------------------------------------------------

class _EngineCollector:
    """Prometheus metrics read from engine.stats() at each scrape."""

    GAUGES = (("tokens_per_second", "tokens_per_s", "tokens generated per second over the last 5 s"),
              ("requests_running", "running", "requests being decoded (or prefilled) now"),
              ("requests_queued", "queued", "requests waiting for room in the KV pool or a slot"),
              ("requests_peak_running", "peak_running", "most requests running at once so far"),
              ("kv_pages_total", "pages_total", "pages in the KV pool"),
              ("kv_pages_used", "pages_used", "KV pages held by requests or the prefix cache"),
              ("kv_pages_free", "pages_free", "KV pages free"),
              ("kv_pages_cached", "pages_cached", "KV pages kept by the prefix cache"),
              ("kv_page_tokens", "page_tokens", "tokens per KV page"),
              ("kv_bytes_per_token", "kv_bytes_per_token", "KV cache bytes per token (all layers, K + V)"))
    COUNTERS = (("requests", "requests", "requests accepted"),
                ("requests_rejected", "rejected", "requests refused because the queue was full"),
                ("prompt_tokens", "prompt_tokens", "prompt tokens of admitted requests (reused ones included)"),
                ("generated_tokens", "generated_tokens", "tokens generated"),
                ("prefix_cache_hits", "prefix_hits", "requests that reused pages of the prefix cache"),
                ("prefix_cache_tokens", "cached_tokens", "prompt tokens reused from the prefix cache"),
                ("engine_steps", "steps", "batched forward steps"))

    def __init__(self, engine):
        self.engine = engine

    def describe(self):
        return []

    def collect(self):
        s = self.engine.stats()
        for name, key, doc in self.GAUGES:
            yield GaugeMetricFamily("pykv_" + name, doc, value=float(s.get(key, 0)))
        for name, key, doc in self.COUNTERS:
            yield CounterMetricFamily("pykv_" + name, doc, value=float(s.get(key, 0)))
        yield GaugeMetricFamily("pykv_engine_up", "1 while the engine runs, 0 after an engine error",
                                value=0.0 if self.engine.error is not None else 1.0)


class _Metrics:
    def __init__(self, engine):
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(engine))
        self.ttft = Histogram("pykv_time_to_first_token_seconds", "seconds from a request's arrival to its first "
                              "token", buckets=TTFT_BUCKETS, registry=self.registry)
        self.latency = Histogram("pykv_request_duration_seconds", "seconds from a request's arrival to its last "
                                 "token", buckets=LATENCY_BUCKETS, registry=self.registry)

    def observe(self, ev: dict, t0: float) -> None:
        if ev.get("ttft") is not None:
            self.ttft.observe(ev["ttft"])
        if ev.get("finish_reason") in ("stop", "length"):
            self.latency.observe(time.perf_counter() - t0)


# ---- the app -------------------------------------------------------------------------------------------------

class _Api:
    def __init__(self, engine, model_name: str, api_key=None, max_body: int = MAX_BODY, max_tokens_limit=None,
                 default_max_tokens=None, poll_s: float = 0.25, drain_s: float = 300.0, ping_s: float = 15.0):
        self.engine, self.model, self.name = engine, engine.model, str(model_name)
        self.api_key = api_key or None
        self.max_body = int(max_body)
        self.n_ctx = self.model.n_ctx
        self.max_tokens_limit = int(max_tokens_limit) if max_tokens_limit else self.n_ctx
        self.default_max_tokens = default_max_tokens
        self.poll_s, self.drain_s, self.ping_s = poll_s, drain_s, ping_s
        self.metrics = _Metrics(engine)
        self.created = int(time.time())

    # -- plumbing
    def _auth(self, request: Request) -> None:
        if self.api_key is None:
            return
        h = request.headers.get("authorization", "")
        key = h[7:].strip() if h[:7].lower() == "bearer " else ""
        if not key or not hmac.compare_digest(key.encode(), self.api_key.encode()):
            raise ApiError(401, "invalid or missing API key (send 'Authorization: Bearer KEY')",
                           code="invalid_api_key")

    async def _body(self, request: Request) -> dict:
        n = request.headers.get("content-length")
        if n is not None and n.isdigit() and int(n) > self.max_body:
            raise ApiError(413, f"request body of {n} bytes is over the limit of {self.max_body}",
                           code="request_too_large")
        chunks, size = [], 0
        try:
            async for chunk in request.stream():
                size += len(chunk)
                if size > self.max_body:
                    raise ApiError(413, f"request body is over the limit of {self.max_body} bytes",
                                   code="request_too_large")
                chunks.append(chunk)
        except ClientDisconnect:
            raise ApiError(400, "the client went away while sending the body") from None
        try:
            body = json.loads(b"".join(chunks))
        except (ValueError, UnicodeDecodeError) as e:
            raise ApiError(400, f"the body is not valid JSON: {e}", code="invalid_json") from None
        if not isinstance(body, dict):
            raise ApiError(400, "the body must be a JSON object", code="invalid_json")
        m = body.get("model")
        if m not in (None, "", self.name):
            raise ApiError(404, f"the model '{m}' does not exist; this server serves '{self.name}'", param="model",
                           code="model_not_found")
        for name in ("n", "best_of"):
            if _field(body, name, int, 1) != 1:
                raise ApiError(400, f"'{name}' must be 1 (one choice per request)", param=name,
                               code="invalid_value")
        return body

    def _max_tokens(self, body: dict, n_prompt: int, names, default):
        for name in names:
            v = _field(body, name, int, None)
            if v is not None:
                if v < 1:
                    raise ApiError(400, f"'{name}' must be at least 1, got {v}", param=name, code="invalid_value")
                if v > self.max_tokens_limit:
                    raise ApiError(400, f"'{name}' is {v}; this server allows at most {self.max_tokens_limit}",
                                   param=name, code="invalid_value")
                if n_prompt + v > self.n_ctx:
                    raise ApiError(400, f"the prompt ({n_prompt} tokens) + {name} ({v}) exceed the context size "
                                   f"{self.n_ctx}", param=name, code="context_length_exceeded")
                return v
        if default is not None:
            return max(1, min(default, self.n_ctx - n_prompt))
        # until the end of generation: what the context and the KV pool leave, within the limit
        room = min(self.n_ctx, self.model.cache.capacity_tokens()) - n_prompt
        return max(1, min(room, self.max_tokens_limit))

    def _check_prompt(self, ids, param: str) -> None:
        if not ids:
            raise ApiError(400, "the prompt is empty", param=param)
        if len(ids) >= self.n_ctx:
            raise ApiError(400, f"the prompt is {len(ids)} tokens; this model's context is {self.n_ctx} tokens",
                           param=param, code="context_length_exceeded")

    def _submit(self, ids, call: _Call, max_tokens: int, sampling: dict, stops, logprobs) -> None:
        try:
            call.req = self.engine.submit(ids, call.on_event, max_tokens=max_tokens, stop=stops, logprobs=logprobs,
                                          **sampling)
        except QueueFull as e:
            raise ApiError(503, f"server busy: {e}; retry later", "server_error", code="server_busy",
                           headers={"Retry-After": "1"}) from None
        except EngineClosed as e:
            raise ApiError(503, str(e), "server_error", code="server_unavailable") from None
        except PykvError as e:       # what the fields' checks leave: prompt + max_tokens past the KV pool
            raise ApiError(400, f"{e}; ask for fewer tokens", param="max_tokens",
                           code="context_length_exceeded") from None

    def _cancel(self, call: _Call) -> None:
        if call.req is not None and not call.done:
            call.done = True
            self.engine.cancel(call.req)

    # -- the two generation endpoints share this
    async def _generate(self, request: Request, body: dict, chat: bool, ids, stops, n_top, prefix: str,
                        names, default_max):
        max_tokens = self._max_tokens(body, len(ids), names, default_max)
        sampling = _sampling(body)
        stream = _field(body, "stream", bool, False)
        opts = body.get("stream_options")
        include_usage = isinstance(opts, dict) and bool(opts.get("include_usage"))
        call = _Call(asyncio.get_running_loop(), self.metrics)
        self._submit(ids, call, max_tokens, sampling, stops, n_top)
        head = {"id": ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24],
                "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
                "model": self.name, "system_fingerprint": None}
        out = _Output(self.model.tokenizer, chat, n_top, len(prefix))
        if stream:
            async def on_close(_message):
                self._cancel(call)
            return EventSourceResponse(self._events(call, head, out, prefix, include_usage), sep="\n",
                                       ping=self.ping_s, shutdown_grace_period=self.drain_s,
                                       client_close_handler_callable=on_close)
        ev = await self._collect(request, call, out)
        if ev is None:                       # the client went away: nobody reads this
            return Response(status_code=499)
        text = prefix + "".join(out.texts)
        choice = ({"index": 0, "message": {"role": "assistant", "content": text}} if chat
                  else {"index": 0, "text": text})
        choice.update(logprobs=out.logprobs(), finish_reason=ev["finish_reason"])
        return JSONResponse({**head, "choices": [choice], "usage": ev["usage"]})

    def _failed(self, ev: dict) -> ApiError:
        if ev["finish_reason"] == "cancelled":
            return ApiError(503, "the request was cancelled (the server is shutting down)", "server_error",
                            code="server_unavailable")
        return ApiError(500, f"generation failed: {ev.get('error') or 'engine error'}", "server_error",
                        code="engine_error")

    async def _collect(self, request: Request, call: _Call, out: _Output):
        """Wait for the request's events; the done event, or None when the client went away."""
        loop = asyncio.get_running_loop()
        getter, check = None, loop.time() + self.poll_s
        try:
            while True:
                if getter is None:
                    getter = asyncio.ensure_future(call.queue.get())
                done, _ = await asyncio.wait({getter}, timeout=max(0.0, check - loop.time()))
                if done:
                    ev, getter = getter.result(), None
                    if ev["type"] != "token":
                        call.done = True
                        if ev["finish_reason"] not in ("stop", "length"):
                            raise self._failed(ev)
                        return ev
                    out.add(ev)
                if loop.time() >= check:        # every poll_s, tokens flowing or not
                    check = loop.time() + self.poll_s
                    if await request.is_disconnected():
                        self._cancel(call)
                        return None
        finally:
            if getter is not None:
                getter.cancel()
            self._cancel(call)

    async def _events(self, call: _Call, head: dict, out: _Output, prefix: str, include_usage: bool):
        """The SSE data of a streamed request: chunks, the finish (with usage), then [DONE]."""
        chat = out.chat
        obj = "chat.completion.chunk" if chat else "text_completion"

        def chunk(text, finish=None, logprobs=None, role=False):
            if chat:
                delta = {"role": "assistant", "content": text} if role else ({"content": text} if text else {})
                c = {"index": 0, "delta": delta}
            else:
                c = {"index": 0, "text": text}
            c.update(logprobs=logprobs, finish_reason=finish)
            d = {**head, "object": obj, "choices": [c]}
            if include_usage:
                d["usage"] = None
            return _dumps(d)

        try:
            if chat:
                yield chunk("", role=True)
            if prefix:
                yield chunk(prefix)
            while True:
                ev = await call.queue.get()
                if ev["type"] == "token":
                    text, entries = out.add(ev)
                    if text or entries:
                        yield chunk(text, logprobs=out.logprobs(entries) if entries else None)
                    continue
                call.done = True
                if ev["finish_reason"] not in ("stop", "length"):
                    e = self._failed(ev)
                    yield _dumps({"error": {"message": e.message, "type": e.type, "param": None, "code": e.code}})
                    return
                last = json.loads(chunk("", ev["finish_reason"]))
                if include_usage:        # OpenAI: a last chunk with no choices carries the usage
                    yield _dumps(last)
                    yield _dumps({**head, "object": obj, "choices": [], "usage": ev["usage"]})
                else:                    # llama-server: the finish chunk carries it
                    last["usage"] = ev["usage"]
                    yield _dumps(last)
                yield "[DONE]"
                return
        finally:
            self._cancel(call)

    # -- endpoints
    async def completions(self, request: Request):
        self._auth(request)
        body = await self._body(request)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]                        # a batch of one
        if isinstance(prompt, str):
            ids = await _off_loop(self.model.tokenize, len(prompt), prompt) if prompt else []
        elif isinstance(prompt, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in prompt):
            ids = list(prompt)
            if ids and (min(ids) < 0 or max(ids) >= self.model.n_vocab):
                raise ApiError(400, f"token ids must be in [0, {self.model.n_vocab})", param="prompt",
                               code="invalid_value")
        else:
            raise ApiError(400, "'prompt' must be a string or a list of token ids (one prompt per request)",
                           param="prompt", code="invalid_type")
        self._check_prompt(ids, "prompt")
        n_top = _field(body, "logprobs", int, None, 0, MAX_LOGPROBS)
        prefix = ""
        if _field(body, "echo", bool, False):
            prefix = prompt if isinstance(prompt, str) else self.model.detokenize(ids)
        return await self._generate(request, body, False, ids, _stops(body), n_top, prefix, ("max_tokens",), 16)

    async def chat_completions(self, request: Request):
        self._auth(request)
        body = await self._body(request)
        msgs = body.get("messages")
        if not isinstance(msgs, list) or not msgs:
            raise ApiError(400, "'messages' must be a non-empty list", param="messages", code="invalid_type")
        plain = []
        for i, m in enumerate(msgs):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise ApiError(400, f"messages[{i}] must be an object with a 'role'", param=f"messages[{i}]")
            plain.append({**m, "content": _text_content(m.get("content"), i)})
        tools = body.get("tools")
        size = sum(len(m["content"]) for m in plain)

        def render_ids():
            text = self.model.apply_chat_template(plain, add_generation_prompt=True,
                                                  **({"tools": tools} if tools else {}))
            return self.model.tokenizer.encode(text, add_special=False, parse_special=True)

        try:
            ids = await _off_loop(render_ids, size)
        except PykvError as e:
            raise ApiError(400, str(e), param="messages") from None
        self._check_prompt(ids, "messages")
        n_top = None
        if _field(body, "logprobs", bool, False):
            n_top = _field(body, "top_logprobs", int, 0, 0, MAX_LOGPROBS)
        stops = _stops(body)
        if self.model.chat_template == CHATML_TEMPLATE and CHATML_STOP not in stops:
            stops.append(CHATML_STOP)
        return await self._generate(request, body, True, ids, stops, n_top, "",
                                    ("max_completion_tokens", "max_tokens"), self.default_max_tokens)

    def _model_card(self) -> dict:
        return {"id": self.name, "object": "model", "created": self.created, "owned_by": "pykv",
                "meta": {"n_ctx": self.n_ctx, "n_vocab": self.model.n_vocab,
                         "kv_type_k": self.model.cache.k_name(), "kv_type_v": self.model.cache.v_name(),
                         "kv_bytes_per_token": self.model.cache.bytes_per_token(),
                         "parallel": self.engine.parallel}}

    async def models(self, request: Request):
        self._auth(request)
        return JSONResponse({"object": "list", "data": [self._model_card()]})

    async def model(self, request: Request):
        self._auth(request)
        if request.path_params["name"] != self.name:
            raise ApiError(404, f"the model '{request.path_params['name']}' does not exist", param="model",
                           code="model_not_found")
        return JSONResponse(self._model_card())

    async def health(self, request: Request):
        e = self.engine
        if e.error is not None:
            return JSONResponse({"status": "error", "error": e.error}, status_code=503)
        if e.closing:
            return JSONResponse({"status": "shutting_down"}, status_code=503)
        return JSONResponse({"status": "ok"})

    async def metrics_text(self, request: Request):
        return Response(generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST)


async def _api_error(request, exc: ApiError):
    return exc.response()


async def _http_error(request, exc: HTTPException):
    msg = {404: f"no route {request.url.path}", 405: f"method {request.method} is not allowed here"}.get(
        exc.status_code, str(exc.detail))
    return ApiError(exc.status_code, msg, code={404: "not_found", 405: "method_not_allowed"}.get(exc.status_code),
                    headers=exc.headers).response()


async def _server_error(request, exc: Exception):
    return ApiError(500, f"internal error: {type(exc).__name__}: {exc}", "server_error").response()


def create_app(engine, model_name: str, *, api_key: str | None = None, max_body: int = MAX_BODY,
               max_tokens_limit: int | None = None, default_max_tokens: int | None = None,
               manage_engine: bool = True, poll_s: float = 0.25, drain_s: float = 300.0,
               ping_s: float = 15.0) -> Starlette:
    """The Starlette app serving `engine` as model `model_name`. api_key: /v1/* needs 'Authorization:
    Bearer KEY' (/health and /metrics stay open); max_body: bytes of a request body; max_tokens_limit:
    most max_tokens a request may ask (None: the context); default_max_tokens: a chat request's
    max_tokens when it gives none (None: what the context and the pool leave). manage_engine: start the
    engine at startup, stop it (draining) at shutdown. poll_s: how often a non-streaming request checks
    that its client is still there; drain_s: how long a stream may run on after shutdown begins."""
    api = _Api(engine, model_name, api_key, max_body, max_tokens_limit, default_max_tokens, poll_s, drain_s, ping_s)

    @asynccontextmanager
    async def lifespan(app):
        if manage_engine:
            engine.start()
        try:
            yield
        finally:
            if manage_engine:
                await run_in_threadpool(engine.stop, True)

    routes = [Route("/v1/completions", api.completions, methods=["POST"]),
              Route("/v1/chat/completions", api.chat_completions, methods=["POST"]),
              Route("/v1/models", api.models, methods=["GET"]),
              Route("/v1/models/{name:path}", api.model, methods=["GET"]),
              Route("/health", api.health, methods=["GET"]),
              Route("/metrics", api.metrics_text, methods=["GET"])]
    app = Starlette(routes=routes, lifespan=lifespan,
                    exception_handlers={ApiError: _api_error, HTTPException: _http_error, 500: _server_error})
    app.state.api = api
    return app
