"""pykv serve end to end: a real server (uvicorn in a thread on a free loopback port, the engine over
SmolLM2 with a small KV pool) driven by the openai client and httpx. Many concurrent streams get the
unbatched text; a client that goes away frees its pages; errors have OpenAI's shape and status; a shared
system prompt reuses the prefix cache; /v1/models and /metrics; and the `pykv serve` command drains a
stream on SIGINT and fails in one line (a busy port, no serve extra)."""
import asyncio
import json
import signal
import socket
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import pytest

pytest.importorskip("starlette")
pytest.importorskip("sse_starlette")
pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")

from pykv.api.chat import CHATML_STOP, CHATML_TEMPLATE  # noqa: E402
from tests.util import assert_clean_error, run_module  # noqa: E402

KEY = "sk-test-pykv"
N_CTX = 1024
PARALLEL = 32                    # slots: more than the pool holds requests, so the KV budget is what queues
PAGES = 24                       # the KV pool: 24 pages of 32 tokens (f16 SmolLM2: 737,280 bytes a page)
PROMPTS = ["The capital of France is", "Once upon a time", "def fib(n):", "Water boils at"]
CHAT = [{"role": "system", "content": "You are a terse assistant."},
        {"role": "user", "content": "What is the capital of France?"}]
LONG_SYSTEM = "You are a helpful assistant. " + " ".join(
    f"Rule {i}: always answer politely and precisely about topic number {i}." for i in range(28))
COUNTING = "Here is a very long list of numbers: 1, 2, 3,"     # greedy: counts on past 300 tokens


def _chat_ids(model, messages):
    text = model.apply_chat_template(messages, add_generation_prompt=True)
    return model.tokenizer.encode(text, add_special=False, parse_special=True)


@pytest.fixture(scope="module")
def srv():
    import pykv
    from pykv.server.serve import make_server
    model = pykv.load(None, n_ctx=N_CTX, max_seqs=PARALLEL, kv_budget=PAGES * 32 * 23040)
    assert model.cache.n_pages == PAGES
    stops = [CHATML_STOP] if model.chat_template == CHATML_TEMPLATE else []
    refs = {p: "".join(model.generate(p, max_tokens=8, temperature=0)) for p in PROMPTS}
    refs["long"] = "".join(model.generate(PROMPTS[1], max_tokens=24, temperature=0))
    refs["chat"] = "".join(model.generate(_chat_ids(model, CHAT), max_tokens=24, temperature=0, stop=stops))
    server = make_server(model, port=0, parallel=PARALLEL, api_key=KEY, max_queue=128, poll_s=0.1)
    th = threading.Thread(target=server.run, name="test-server", daemon=True)
    th.start()
    t0 = time.time()
    while not server.started:
        assert th.is_alive() and time.time() - t0 < 60, "the server did not start"
        time.sleep(0.02)
    name = server.config.app.state.api.name
    yield SimpleNamespace(url=server.url, engine=server.engine, model=model, refs=refs, name=name,
                          auth={"Authorization": f"Bearer {KEY}"})
    server.should_exit = True
    th.join(30)
    assert not th.is_alive()
    assert server.engine.thread is None or not server.engine.thread.is_alive()     # stopped, drained


def _client(srv, **kw):
    return openai.OpenAI(base_url=srv.url + "/v1", api_key=KEY, max_retries=0, timeout=120, **kw)


def _idle(engine, timeout=10.0) -> dict:
    t0 = time.time()
    while True:
        s = engine.stats()
        if s["running"] == 0 and s["queued"] == 0:
            return s
        assert time.time() - t0 < timeout, s
        time.sleep(0.02)


def _metrics(srv) -> dict:
    from prometheus_client.parser import text_string_to_metric_families
    r = httpx.get(srv.url + "/metrics", timeout=10)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    return {s.name: s.value for fam in text_string_to_metric_families(r.text) for s in fam.samples
            if not s.labels}


def test_100_concurrent_streams_get_the_unbatched_text(srv):
    before = srv.engine.stats()

    async def one(client, i):
        prompt = PROMPTS[i % len(PROMPTS)]
        stream = await client.completions.create(model=srv.name, prompt=prompt, max_tokens=8, temperature=0,
                                                 stream=True)
        text, finish = "", None
        async for ch in stream:
            if ch.choices:
                text += ch.choices[0].text
                finish = ch.choices[0].finish_reason or finish
        return prompt, text, finish

    async def main():
        client = openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key=KEY, max_retries=0, timeout=120)
        try:
            return await asyncio.gather(*(one(client, i) for i in range(100)), return_exceptions=True)
        finally:
            await client.close()

    res = asyncio.run(main())
    errors = [r for r in res if isinstance(r, BaseException)]
    assert not errors, errors[:3]
    for prompt, text, finish in res:
        assert text == srv.refs[prompt], (prompt, text)
        assert finish == "length"
    s = _idle(srv.engine)
    assert s["requests"] - before["requests"] == 100 and s["rejected"] == before["rejected"]
    assert s["generated_tokens"] - before["generated_tokens"] == 800
    assert 1 < s["peak_running"] <= PAGES < 100        # a page each at most at once: the rest waited in the queue
    r = httpx.get(srv.url + "/health", timeout=5)
    assert r.status_code == 200 and r.json() == {"status": "ok"}


def test_a_client_that_goes_away_frees_its_pages(srv):
    e = srv.engine
    before = _idle(e)
    body = {"model": srv.name, "prompt": COUNTING, "max_tokens": 400, "temperature": 0}
    with httpx.Client(timeout=30, headers=srv.auth) as c:
        with c.stream("POST", srv.url + "/v1/completions", json={**body, "stream": True}) as r:
            assert r.status_code == 200
            n = 0
            for line in r.iter_lines():
                n += line.startswith("data:")
                if n == 2:
                    break
            during = e.stats()
            assert during["running"] == 1 and during["pages_used"] > before["pages_used"]
    after = _idle(e)
    assert after["pages_used"] == before["pages_used"] and after["pages_free"] == before["pages_free"]
    assert after["generated_tokens"] - before["generated_tokens"] < 400      # cut short, not run to the end
    # a non-streaming client that gives up: the server sees it gone while waiting, and cancels
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(srv.url + "/v1/completions", json=body, headers=srv.auth, timeout=0.5)
    t0 = time.time()
    while e.stats()["running"] and time.time() - t0 < 10:
        time.sleep(0.02)
    again = _idle(e)
    assert again["pages_used"] == before["pages_used"]
    assert again["generated_tokens"] - after["generated_tokens"] < 400


def test_errors_have_openai_shape(srv):
    url = srv.url + "/v1/completions"

    def check(r, status, code=None):
        assert r.status_code == status, r.text
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"], err
        if code is not None:
            assert err["code"] == code, err
        return err

    check(httpx.post(url, content=b'{"prompt": "hi", ', headers={**srv.auth, "content-type": "application/json"}),
          400, "invalid_json")
    check(httpx.post(url, json={"prompt": "hi", "n": 2}, headers=srv.auth), 400)
    check(httpx.post(url, json={"prompt": "hi", "max_tokens": N_CTX * 4}, headers=srv.auth), 400)
    check(httpx.post(url, json={"prompt": "hi", "temperature": "hot"}, headers=srv.auth), 400)
    check(httpx.post(url, content=b"x" * (5 << 20), headers=srv.auth), 413, "request_too_large")
    check(httpx.get(srv.url + "/v1/nothing", headers=srv.auth), 404)
    client = _client(srv)
    with pytest.raises(openai.NotFoundError) as ei:
        client.completions.create(model="gpt-4o", prompt="hi", max_tokens=2)
    assert ei.value.status_code == 404 and ei.value.body["code"] == "model_not_found"
    check(ei.value.response, 404, "model_not_found")
    with pytest.raises(openai.BadRequestError) as ei:
        client.completions.create(model=srv.name, prompt="word " * (N_CTX + 50), max_tokens=2)
    assert ei.value.status_code == 400 and "context" in ei.value.body["message"]
    check(ei.value.response, 400, "context_length_exceeded")
    with pytest.raises(openai.BadRequestError) as ei:      # a chat that does not fit, streamed or not
        client.chat.completions.create(model=srv.name, messages=[{"role": "user", "content": "word " * N_CTX}],
                                       stream=True)
    check(ei.value.response, 400, "context_length_exceeded")
    for key in ("wrong-key", None):
        headers = {} if key is None else {"Authorization": f"Bearer {key}"}
        check(httpx.get(srv.url + "/v1/models", headers=headers), 401, "invalid_api_key")
    with pytest.raises(openai.AuthenticationError) as ei:
        openai.OpenAI(base_url=srv.url + "/v1", api_key="wrong", max_retries=0).completions.create(
            model=srv.name, prompt="hi", max_tokens=2)
    assert ei.value.status_code == 401 and ei.value.body["message"]
    assert httpx.get(srv.url + "/health").status_code == 200               # open without the key
    _idle(srv.engine)


def test_a_shared_system_prompt_reuses_the_prefix_cache(srv):
    client = _client(srv)
    m0 = _metrics(srv)

    def ask(question):
        t0 = time.perf_counter()
        msgs = [{"role": "system", "content": LONG_SYSTEM}, {"role": "user", "content": question}]
        stream = client.chat.completions.create(model=srv.name, messages=msgs, max_tokens=8, temperature=0,
                                                stream=True, stream_options={"include_usage": True})
        ttft, text, usage = None, "", None
        for ch in stream:
            if ch.choices and ch.choices[0].delta.content:
                ttft = ttft or time.perf_counter() - t0
                text += ch.choices[0].delta.content
            if ch.usage is not None:
                usage = ch.usage
        return ttft, text, usage

    t1, _, u1 = ask("What is topic number 3 about?")
    t2, _, u2 = ask("Name one rule.")
    assert u1.prompt_tokens > 450 and u2.prompt_tokens > 450
    assert not (u1.prompt_tokens_details and u1.prompt_tokens_details.cached_tokens)
    assert u2.prompt_tokens_details.cached_tokens >= 416                     # 13+ of its pages reused
    assert t2 < t1, (t1, t2)
    m1 = _metrics(srv)
    assert m1["pykv_prefix_cache_hits_total"] - m0["pykv_prefix_cache_hits_total"] == 1
    assert m1["pykv_prefix_cache_tokens_total"] - m0["pykv_prefix_cache_tokens_total"] == \
        u2.prompt_tokens_details.cached_tokens
    assert m1["pykv_kv_pages_cached"] >= 13
    _idle(srv.engine)


def test_non_streaming_completion_and_chat_match_generate(srv):
    client = _client(srv)
    r = client.completions.create(model=srv.name, prompt=PROMPTS[1], max_tokens=24, temperature=0, logprobs=2)
    c = r.choices[0]
    assert r.id.startswith("cmpl-") and r.object == "text_completion" and r.model == srv.name and r.created > 0
    assert c.text == srv.refs["long"] and c.finish_reason == "length"
    assert r.usage.completion_tokens == 24 and r.usage.total_tokens == r.usage.prompt_tokens + 24
    lp = c.logprobs.token_logprobs
    assert len(lp) == 24 and all(isinstance(x, float) and x <= 0 for x in lp)
    assert "".join(c.logprobs.tokens) == c.text
    assert all(len(t) == 2 and max(t.values()) >= v - 1e-6 for t, v in zip(c.logprobs.top_logprobs, lp))
    # echo, and the prompt as token ids
    ids = srv.model.tokenize(PROMPTS[1])
    r = client.completions.create(model=srv.name, prompt=ids, max_tokens=24, temperature=0, echo=True)
    assert r.choices[0].text == srv.model.detokenize(ids) + srv.refs["long"]

    r = client.chat.completions.create(model=srv.name, messages=CHAT, max_tokens=24, temperature=0, logprobs=True,
                                       top_logprobs=3)
    c = r.choices[0]
    assert r.id.startswith("chatcmpl-") and r.object == "chat.completion"
    assert c.message.role == "assistant" and c.message.content == srv.refs["chat"]
    assert c.finish_reason in ("stop", "length")
    assert len(c.logprobs.content) == r.usage.completion_tokens > 0
    assert all(t.logprob <= 0 and len(t.top_logprobs) == 3 for t in c.logprobs.content)
    # streamed chat: the same text, usage in the finish chunk (no include_usage)
    text, last = "", None
    for ch in client.chat.completions.create(model=srv.name, messages=CHAT, max_tokens=24, temperature=0,
                                             stream=True):
        text += ch.choices[0].delta.content or ""
        last = ch
    assert text == srv.refs["chat"] and last.usage.completion_tokens == r.usage.completion_tokens
    _idle(srv.engine)


def test_models_and_metrics(srv):
    models = _client(srv).models.list().data
    assert [m.id for m in models] == [srv.name]
    r = _client(srv).completions.create(model=srv.name, prompt=PROMPTS[0], max_tokens=4, temperature=0)
    assert r.usage.completion_tokens == 4
    _idle(srv.engine)
    m = _metrics(srv)
    for name in ("pykv_tokens_per_second", "pykv_requests_running", "pykv_requests_queued", "pykv_kv_pages_used",
                 "pykv_kv_pages_free", "pykv_kv_pages_cached", "pykv_kv_bytes_per_token",
                 "pykv_prefix_cache_hits_total", "pykv_prefix_cache_tokens_total", "pykv_generated_tokens_total",
                 "pykv_prompt_tokens_total", "pykv_requests_rejected_total", "pykv_time_to_first_token_seconds_count"):
        assert name in m, name
    s = srv.engine.stats()
    assert m["pykv_kv_pages_used"] + m["pykv_kv_pages_free"] == PAGES == m["pykv_kv_pages_total"]
    assert m["pykv_kv_pages_used"] == s["pages_used"] and m["pykv_kv_pages_cached"] == s["pages_cached"]
    assert m["pykv_kv_bytes_per_token"] == pytest.approx(srv.model.kv_bytes_per_token())
    assert m["pykv_generated_tokens_total"] == s["generated_tokens"] >= 4
    assert m["pykv_prompt_tokens_total"] == s["prompt_tokens"] >= len(srv.model.tokenize(PROMPTS[0]))
    assert m["pykv_requests_running"] == 0 and m["pykv_requests_rejected_total"] == 0
    assert m["pykv_tokens_per_second"] > 0                        # 4 tokens within the last 5 s at least
    assert m["pykv_time_to_first_token_seconds_count"] >= 1 and m["pykv_time_to_first_token_seconds_sum"] > 0
    assert m["pykv_request_duration_seconds_count"] >= 1


class _StubEngine:
    """An engine that refuses every request the way a full or stopped engine does."""

    def __init__(self, model, exc):
        self.model, self.exc, self.parallel, self.error, self.closing = model, exc, 1, None, False

    def submit(self, *a, **kw):
        raise self.exc

    def stats(self):
        return {}


def test_busy_and_stopped_engines_answer_503(srv):
    from starlette.testclient import TestClient
    from pykv.api.engine import EngineClosed, QueueFull
    from pykv.server.app import create_app
    body = {"prompt": "hi", "max_tokens": 4}
    eng = _StubEngine(srv.model, QueueFull("9 requests are waiting already"))
    with TestClient(create_app(eng, "m", manage_engine=False)) as tc:
        r = tc.post("/v1/completions", json=body)
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        assert r.json()["error"]["code"] == "server_busy"
        eng.exc = EngineClosed("the server is shutting down")
        r = tc.post("/v1/chat/completions", json={"messages": CHAT, "stream": True})
        assert r.status_code == 503 and "shutting down" in r.json()["error"]["message"]
        eng.error = "RuntimeError: boom"
        assert tc.get("/health").status_code == 503


def test_the_serve_command_drains_a_stream_on_sigint():
    p = subprocess.Popen([sys.executable, "-m", "pykv", "serve", "-c", "256", "--port", "0", "--parallel", "2",
                          "--api-key", KEY], stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True)
    try:
        line = p.stderr.readline()
        while line.startswith(("pykv: compiling", "pykv: loading", "pykv: fetching")):
            line = p.stderr.readline()
        assert line.startswith("pykv: serving ") and "2 slots" in line, line
        url = line.split(" on ")[1].split()[0]
        assert url.startswith("http://127.0.0.1:")
        chunks = []
        with httpx.Client(timeout=60, headers={"Authorization": f"Bearer {KEY}"}) as c:
            with c.stream("POST", url + "/v1/completions", json={"prompt": COUNTING, "max_tokens": 48,
                                                                   "temperature": 0, "stream": True}) as r:
                for ln in r.iter_lines():
                    if ln.startswith("data:"):
                        chunks.append(ln[5:].strip())
                        if len(chunks) == 2:
                            p.send_signal(signal.SIGINT)       # graceful: the stream runs to its end
        assert chunks[-1] == "[DONE]"
        last = json.loads(chunks[-2])
        assert last["choices"][0]["finish_reason"] == "length" and last["usage"]["completion_tokens"] == 48
        assert p.wait(30) == 0
        err = p.stderr.read()
        assert "pykv: server stopped" in err and "Traceback" not in err, err
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_the_serve_command_stops_cleanly_when_idle(sig):
    """No request in flight: the signal stops it at once, exit 0, one line, no traceback."""
    p = subprocess.Popen([sys.executable, "-m", "pykv", "serve", "-c", "256", "--port", "0", "--parallel", "1"],
                         stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True)
    try:
        line = p.stderr.readline()
        while line.startswith(("pykv: compiling", "pykv: loading", "pykv: fetching")):
            line = p.stderr.readline()
        assert line.startswith("pykv: serving "), line
        url = line.split(" on ")[1].split()[0]
        assert httpx.get(url + "/health", timeout=30).status_code == 200
        p.send_signal(sig)
        assert p.wait(30) == 0
        err = p.stderr.read()
        assert err.strip() == "pykv: server stopped", err
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


def test_the_serve_command_fails_in_one_line():
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen(1)
    try:          # a busy port is refused before the model loads
        assert_clean_error(run_module("pykv", "serve", "--port", str(busy.getsockname()[1]), timeout=120),
                           "cannot listen on 127.0.0.1:")
    finally:
        busy.close()
    assert_clean_error(run_module("pykv", "serve", "--parallel", "0", timeout=120), "--parallel must be at least 1")
    # without the serve extra: one line naming it
    r = subprocess.run([sys.executable, "-c", "import sys; sys.modules['uvicorn'] = None\n"
                        "from pykv.cli import main; raise SystemExit(main(['serve']))"],
                       capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert_clean_error(r, "pip install 'pykv[serve]'")
