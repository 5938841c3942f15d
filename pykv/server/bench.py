"""Load generator for OpenAI-compatible completion servers (`pykv bench-serve`): N concurrent clients,
each sending its requests one after another to /v1/completions (streamed SSE by default), measuring per
request the time to first token (TTFT), the inter-token latencies (ITL: gaps between content chunks)
and the completion tokens, and over the run the wall time, output tokens/s, requests/s, TTFT and ITL
percentiles, errors and, where the server's /metrics exposes a running-requests gauge, its peak.

Works against pykv's own server (pykv serve) and any other OpenAI-compatible one (llama.cpp's
llama-server). Token counts: the final chunk's usage.completion_tokens when the server sends usage
(asked for with stream_options.include_usage), else the number of content chunks. Prompts are distinct
per request (the request index leads the prompt), so a prefix cache cannot make them trivial.

start_local_server starts `python -m pykv serve` on a free loopback port and waits for /health;
start_server_process does the same for any server command line (llama-server).

Needs httpx (the serve extra), imported when a function runs.
"""
from __future__ import annotations

import asyncio
import json
import math
import os
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

from pykv.files.config import PykvError

# /metrics gauges whose value is the number of requests being decoded now, first found wins: pykv's own
# (pykv/server/app.py), then llama-server's (with --metrics). Adjust here if the server renames it.
RUNNING_GAUGES = ("pykv_requests_running", "pykv_running_requests", "pykv_running", "llamacpp:requests_processing")
METRICS_INTERVAL_S = 0.2

# a prompt that tends to produce long text; the request index leads it and words pad it to length
_PROMPT_HEAD = ("Write a very long and detailed story about a traveller who crosses mountains, rivers, "
                "forests and deserts, describing every day of the journey, the people met and the weather.")
_PAD_WORDS = ("the old map showed roads villages bridges towers lakes valleys and distant cities where "
              "merchants sold bread salt wool iron lamps books rope and maps to every passing stranger").split()


def make_prompt(index: int, words: int = 32) -> str:
    """Request `index`'s prompt: about `words` words (roughly as many tokens), distinct per index."""
    head = f"Story {index}. " + _PROMPT_HEAD
    n = len(head.split())
    pad = [_PAD_WORDS[(index + k) % len(_PAD_WORDS)] for k in range(max(0, words - n))]
    if words < n:
        return " ".join(head.split()[:max(2, words)])
    return head + (" Notes: " + " ".join(pad) + "." if pad else "")


@dataclass
class RequestResult:
    """One request: start/first token/end times (perf_counter seconds), content chunk gaps, tokens."""
    index: int
    client: int
    start: float = 0.0
    end: float = 0.0
    ttft: float | None = None            # seconds from send to the first content chunk
    itl: list = field(default_factory=list)   # seconds between consecutive content chunks
    chunks: int = 0                      # content chunks seen
    completion_tokens: int = 0           # usage.completion_tokens if sent, else chunks
    prompt_tokens: int | None = None     # usage.prompt_tokens if sent
    usage: bool = False                  # the server sent usage
    finish_reason: str | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


def percentile(values, q: float) -> float | None:
    """The q-th percentile (0..100, linear interpolation as numpy's default); None for no values."""
    v = sorted(values)
    if not v:
        return None
    pos = (len(v) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return v[lo] + (v[hi] - v[lo]) * (pos - lo)


@dataclass
class LoadResult:
    url: str
    clients: int
    max_tokens: int
    prompt_words: int
    stream: bool
    results: list
    wall_s: float
    peak_running: int | None = None
    model: str | None = None

    def summary(self) -> dict:
        """The run's figures: latencies in milliseconds, throughputs per second of wall time."""
        ok = [r for r in self.results if r.ok]
        errs = [r for r in self.results if not r.ok]
        toks = sum(r.completion_tokens for r in ok)
        ttft = [r.ttft for r in ok if r.ttft is not None]
        itl = [g for r in ok for g in r.itl]
        wall = self.wall_s

        def ms(x):
            return None if x is None else round(1000.0 * x, 3)
        return {
            "url": self.url, "model": self.model, "clients": self.clients, "requests": len(self.results),
            "ok": len(ok), "errors": len(errs), "max_tokens": self.max_tokens, "prompt_words": self.prompt_words,
            "stream": self.stream, "completion_tokens": toks,
            "tokens_per_request": round(toks / len(ok), 2) if ok else None,
            "usage_reported": bool(ok) and all(r.usage for r in ok),
            "wall_s": round(wall, 4),
            "output_tok_s": round(toks / wall, 3) if wall > 0 else None,
            "req_s": round(len(ok) / wall, 4) if wall > 0 else None,
            "ttft_p50_ms": ms(percentile(ttft, 50)), "ttft_p99_ms": ms(percentile(ttft, 99)),
            "itl_p50_ms": ms(percentile(itl, 50)), "itl_p99_ms": ms(percentile(itl, 99)),
            "itl_mean_ms": ms(sum(itl) / len(itl)) if itl else None,
            "peak_running": self.peak_running,
            "error_samples": sorted({r.error for r in errs})[:3],
        }


def _headers(api_key):
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def _base(url: str) -> str:
    url = url.rstrip("/")
    for tail in ("/v1/completions", "/v1"):
        if url.endswith(tail):
            url = url[: -len(tail)]
    return url


def parse_metrics(text: str, names=RUNNING_GAUGES) -> float | None:
    """The value of the first of `names` found in Prometheus text (summed over label sets)."""
    found: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        parts = line.rsplit(None, 1)
        if len(parts) != 2:
            continue
        name = parts[0].split("{", 1)[0].strip()
        if name in names:
            try:
                found[name] = found.get(name, 0.0) + float(parts[1])
            except ValueError:
                continue
    for n in names:
        if n in found:
            return found[n]
    return None


async def _scrape(client, base, headers, stop: asyncio.Event, interval: float) -> int | None:
    """Poll /metrics until `stop`; the peak of the running-requests gauge (None: no such gauge, or the run
    ended before the first sample, taken a moment after the start so that the requests have arrived)."""
    peak = None
    misses = 0
    wait = min(interval, 0.05)
    while True:
        try:
            await asyncio.wait_for(stop.wait(), timeout=wait)
            return peak
        except asyncio.TimeoutError:
            pass
        wait = interval
        try:
            r = await client.get(base + "/metrics", headers=headers)
            v = parse_metrics(r.text) if r.status_code == 200 else None
        except Exception:
            v = None
        if v is None:
            misses += 1
            if peak is None and misses >= 3:      # no /metrics, or none of the gauges: stop asking
                return None
        else:
            peak = int(v) if peak is None else max(peak, int(v))


async def _model_name(client, base, headers) -> str | None:
    try:
        r = await client.get(base + "/v1/models", headers=headers)
        if r.status_code == 200:
            data = r.json().get("data") or []
            if data and data[0].get("id"):
                return str(data[0]["id"])
    except Exception:
        pass
    return None


def _content(obj) -> str | None:
    """The text of a completion (or chat) chunk's first choice; None when it carries no choice."""
    ch = obj.get("choices") or []
    if not ch:
        return None
    c = ch[0]
    if "text" in c:
        return c.get("text") or ""
    d = c.get("delta") or c.get("message") or {}
    return d.get("content") or ""


def _take_usage(res: RequestResult, obj) -> None:
    u = obj.get("usage")
    if isinstance(u, dict) and u.get("completion_tokens") is not None:
        res.usage = True
        res.completion_tokens = int(u["completion_tokens"])
        if u.get("prompt_tokens") is not None:
            res.prompt_tokens = int(u["prompt_tokens"])


async def _one(client, endpoint, headers, body, res: RequestResult) -> None:
    res.start = time.perf_counter()
    last = None
    try:
        if not body.get("stream"):
            r = await client.post(endpoint, json=body, headers=headers)
            now = time.perf_counter()
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {r.text.strip()[:200]}"
                return
            obj = r.json()
            text = _content(obj)
            res.ttft = now - res.start
            res.chunks = 1 if text else 0
            res.completion_tokens = res.chunks
            _take_usage(res, obj)
            ch = obj.get("choices") or [{}]
            res.finish_reason = ch[0].get("finish_reason")
            return
        async with client.stream("POST", endpoint, json=body, headers=headers) as r:
            if r.status_code != 200:
                text = (await r.aread()).decode("utf-8", "replace").strip()
                res.error = f"HTTP {r.status_code}: {text[:200]}"
                return
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                payload = line[5:].strip()
                if payload == "[DONE]":
                    break
                now = time.perf_counter()
                try:
                    obj = json.loads(payload)
                except ValueError:
                    res.error = f"bad SSE data: {payload[:100]}"
                    return
                if obj.get("error"):
                    e = obj["error"]
                    res.error = "server error: " + str(e.get("message", e) if isinstance(e, dict) else e)[:200]
                    return
                text = _content(obj)
                if text:
                    res.chunks += 1
                    if last is None:
                        res.ttft = now - res.start
                    else:
                        res.itl.append(now - last)
                    last = now
                ch = obj.get("choices") or []
                if ch and ch[0].get("finish_reason"):
                    res.finish_reason = ch[0]["finish_reason"]
                _take_usage(res, obj)
        if not res.usage:
            res.completion_tokens = res.chunks
        if res.chunks == 0 and not res.usage and res.finish_reason is None:
            res.error = "no completion in the response"     # not an OpenAI completions stream
    except Exception as e:  # connection refused / reset, timeouts: counted as the request's error
        res.error = f"{type(e).__name__}: {e}"[:200] if str(e) else type(e).__name__
    finally:
        res.end = time.perf_counter()


async def run_load(url: str, *, clients: int = 8, requests: int | None = None, prompt_tokens: int = 32,
                   prompts=None, max_tokens: int = 128, api_key: str | None = None, model: str | None = None,
                   stream: bool = True, temperature: float = 0.0, ignore_eos: bool = True,
                   timeout: float = 600.0, metrics_interval: float = METRICS_INTERVAL_S,
                   extra_body: dict | None = None, warmup: bool = False) -> LoadResult:
    """Drive `clients` concurrent clients against `url` (the server's base URL) until `requests`
    requests (default: one per client) have run; each client sends its next request when its last one
    ends. prompts: a list of prompt strings (request i gets prompts[i % len]); default make_prompt(i,
    prompt_tokens). ignore_eos asks the server to generate exactly max_tokens (llama-server and pykv
    honour it; others may ignore it). model: the request's "model" field (default: the first id of
    /v1/models, else none). warmup: first an untimed round of `clients` concurrent short requests (their
    own prompts), so one-time costs (a kernel compile, buffer growth) stay out of the figures. Returns a
    LoadResult; .summary() gives the figures."""
    import httpx
    clients = max(1, int(clients))
    n_req = clients if requests is None else int(requests)
    if n_req < 1:
        raise PykvError(f"requests must be at least 1, got {n_req}")
    if max_tokens < 1:
        raise PykvError(f"max_tokens must be at least 1, got {max_tokens}")
    base = _base(url)
    endpoint = base + "/v1/completions"
    headers = _headers(api_key)
    limits = httpx.Limits(max_connections=clients + 4, max_keepalive_connections=clients + 4)
    tmo = httpx.Timeout(timeout, connect=30.0)
    prompts = list(prompts) if prompts is not None else None
    results = [RequestResult(index=i, client=-1) for i in range(n_req)]
    counter = iter(range(n_req))

    async with httpx.AsyncClient(limits=limits, timeout=tmo) as client, \
            httpx.AsyncClient(timeout=httpx.Timeout(5.0)) as side:
        if model is None:
            model = await _model_name(side, base, headers)

        def body_for(i, n_new=max_tokens):
            p = make_prompt(i, prompt_tokens) if not prompts or i >= n_req else prompts[i % len(prompts)]
            b = {"prompt": p, "max_tokens": int(n_new), "temperature": float(temperature), "stream": bool(stream)}
            if model:
                b["model"] = model
            if stream:
                b["stream_options"] = {"include_usage": True}
            if ignore_eos:
                b["ignore_eos"] = True
            if extra_body:
                b.update(extra_body)
            return b

        async def worker(c):
            for i in counter:          # a shared iterator: each client takes the next index when free
                res = results[i]
                res.client = c
                await _one(client, endpoint, headers, body_for(i), res)

        if warmup:
            await asyncio.gather(*(_one(client, endpoint, headers, body_for(n_req + c, min(8, max_tokens)),
                                        RequestResult(index=n_req + c, client=c)) for c in range(clients)))
        stop = asyncio.Event()
        scraper = asyncio.create_task(_scrape(side, base, headers, stop, metrics_interval)) \
            if metrics_interval and metrics_interval > 0 else None
        t0 = time.perf_counter()
        try:
            await asyncio.gather(*(worker(c) for c in range(min(clients, n_req))))
        finally:
            wall = time.perf_counter() - t0
            stop.set()
            peak = await scraper if scraper is not None else None
    return LoadResult(url=base, clients=clients, max_tokens=int(max_tokens), prompt_words=int(prompt_tokens),
                      stream=bool(stream), results=results, wall_s=wall, peak_running=peak, model=model)


def load(url: str, **kw) -> LoadResult:
    """run_load from synchronous code (its own event loop)."""
    return asyncio.run(run_load(url, **kw))


# ---- starting servers ------------------------------------------------------------------------------------------
def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _log_tail(path: str, n: int = 1) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            lines = [ln.strip() for ln in f.read().splitlines() if ln.strip()]
    except OSError:
        return ""
    return " | ".join(lines[-n:])


class ServerHandle:
    """A server subprocess: .url (base URL), .proc, .log (its stdout+stderr file); stop() ends it."""

    def __init__(self, proc, url: str, log: str, name: str):
        self.proc, self.url, self.log, self.name = proc, url, log, name

    def stop(self, timeout: float = 20.0) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        try:
            os.unlink(self.log)
        except OSError:
            pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


def wait_healthy(url: str, *, proc=None, timeout: float = 900.0, api_key: str | None = None,
                 log: str | None = None, name: str = "server") -> None:
    """Poll url/health until it answers 200; PykvError if `proc` exits first or `timeout` passes."""
    import httpx
    deadline = time.monotonic() + timeout
    with httpx.Client(timeout=5.0) as c:
        while True:
            if proc is not None and proc.poll() is not None:
                tail = _log_tail(log, 1) if log else ""
                raise PykvError(f"{name} exited with code {proc.returncode} before it was ready"
                                + (f": {tail}" if tail else ""))
            try:
                if c.get(url + "/health", headers=_headers(api_key)).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise PykvError(f"{name} at {url} not ready after {timeout:.0f} s")
            time.sleep(0.25)


def start_server_process(cmd, port: int, *, host: str = "127.0.0.1", timeout: float = 900.0,
                         api_key: str | None = None, name: str | None = None, env=None) -> ServerHandle:
    """Start `cmd` (a server that listens on host:port), wait for /health, return its handle."""
    name = name or os.path.basename(str(cmd[0]))
    fd, log = tempfile.mkstemp(prefix="pykv-bench-serve-", suffix=".log")
    try:
        proc = subprocess.Popen([str(c) for c in cmd], stdout=fd, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, env=env)
    except OSError as e:
        os.close(fd)
        os.unlink(log)
        raise PykvError(f"cannot start {name}: {e}") from None
    os.close(fd)
    h = ServerHandle(proc, f"http://{host}:{port}", log, name)
    try:
        wait_healthy(h.url, proc=proc, timeout=timeout, api_key=api_key, log=log, name=name)
    except BaseException:
        h.stop()
        raise
    return h


def serve_command(model_path=None, *, ctk="f16", ctv=None, parallel=None, n_ctx=None, kv_budget=None,
                  port: int, host: str = "127.0.0.1", api_key=None, extra=()) -> list:
    """The `python -m pykv serve ...` command line."""
    cmd = [sys.executable, "-m", "pykv", "serve"]
    if model_path:
        cmd.append(str(model_path))
    cmd += ["--host", host, "--port", str(port), "-ctk", str(ctk), "-ctv", str(ctv or ctk)]
    if parallel is not None:
        cmd += ["--parallel", str(parallel)]
    if n_ctx is not None:
        cmd += ["-c", str(n_ctx)]
    if kv_budget is not None:
        cmd += ["--kv-budget", str(kv_budget)]
    if api_key:
        cmd += ["--api-key", str(api_key)]
    return cmd + [str(x) for x in extra]


def start_local_server(model_path=None, ctk="f16", ctv=None, parallel=None, n_ctx=None, kv_budget=None,
                       port=None, extra=(), *, api_key=None, timeout: float = 900.0) -> ServerHandle:
    """Start `python -m pykv serve` on a loopback port (port None: a free one) and wait until its
    /health answers (a cold kernel cache compiles first: minutes). Returns a ServerHandle (stop())."""
    port = free_port() if port is None else int(port)
    cmd = serve_command(model_path, ctk=ctk, ctv=ctv, parallel=parallel, n_ctx=n_ctx, kv_budget=kv_budget,
                        port=port, api_key=api_key, extra=extra)
    return start_server_process(cmd, port, timeout=timeout, api_key=api_key, name=f"pykv serve (-ctk {ctk})")


# ---- table -----------------------------------------------------------------------------------------------------
COLUMNS = (("kv", "KV type"), ("clients", "clients"), ("requests", "requests"), ("output_tok_s", "output tok/s"),
           ("req_s", "req/s"), ("tokens_per_request", "tok/req"), ("ttft_p50_ms", "TTFT p50 ms"),
           ("ttft_p99_ms", "TTFT p99 ms"), ("itl_p50_ms", "ITL p50 ms"), ("itl_p99_ms", "ITL p99 ms"),
           ("peak_running", "peak running"), ("errors", "errors"))


def _cell(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.2f}" if abs(v) < 1000 else f"{v:.0f}"
    return str(v)


def format_table(rows, columns=COLUMNS) -> str:
    """A markdown table of summary rows (dicts with the COLUMNS keys)."""
    head = [h for _, h in columns]
    body = [[_cell(r.get(k)) for k, _ in columns] for r in rows]
    w = [max(len(h), *(len(b[i]) for b in body)) if body else len(h) for i, h in enumerate(head)]
    # text columns (the first, and any whose values are all strings) left-aligned, numbers right-aligned
    left = [i == 0 or all(isinstance(r.get(k), str) for r in rows if r.get(k) is not None) and
            any(r.get(k) is not None for r in rows) for i, (k, _) in enumerate(columns)]
    out = ["| " + " | ".join(h.ljust(w[i]) for i, h in enumerate(head)) + " |",
           "| " + " | ".join(("-" * w[i]) if left[i] else ("-" * (w[i] - 1) + ":") for i in range(len(head))) + " |"]
    for b in body:
        out.append("| " + " | ".join(c.ljust(w[i]) if left[i] else c.rjust(w[i]) for i, c in enumerate(b)) + " |")
    return "\n".join(out)
