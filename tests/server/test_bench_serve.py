"""pykv.server.bench (pykv bench-serve) against a tiny fake OpenAI-compatible SSE server: a Starlette app
in a uvicorn thread that streams one chunk per token with known delays, then a usage chunk."""
import asyncio
import json
import subprocess
import sys
import threading
import time

import pytest

pytest.importorskip("httpx")
pytest.importorskip("starlette")
uvicorn = pytest.importorskip("uvicorn")

from starlette.applications import Starlette  # noqa: E402
from starlette.requests import Request  # noqa: E402
from starlette.responses import JSONResponse, PlainTextResponse, StreamingResponse  # noqa: E402
from starlette.routing import Route  # noqa: E402

from pykv.server import bench  # noqa: E402

TTFT_S = 0.05      # the fake server's delay before the first token
ITL_S = 0.01       # and between tokens


class Fake:
    """The fake server's state: request bodies seen, requests in flight and their peak."""

    def __init__(self):
        self.bodies = []
        self.running = 0
        self.peak = 0


def _app(state: Fake) -> Starlette:
    async def completions(request: Request):
        body = await request.json()
        state.bodies.append(body)
        prompt = body["prompt"]
        if "FAIL" in prompt:
            return JSONResponse({"error": {"message": "boom", "type": "server_error"}}, status_code=500)
        n = int(body["max_tokens"])
        usage_n = n
        if "USAGE=" in prompt:            # the usage chunk claims a different count than the chunks
            usage_n = int(prompt.split("USAGE=")[1].split()[0])

        def chunk(obj):
            return f"data: {json.dumps(obj)}\n\n"

        async def gen():
            state.running += 1
            state.peak = max(state.peak, state.running)
            try:
                await asyncio.sleep(TTFT_S)
                for k in range(n):
                    if k:
                        await asyncio.sleep(ITL_S)
                    fin = "length" if k == n - 1 else None
                    yield chunk({"id": "c", "object": "text_completion", "model": "fake",
                                 "choices": [{"index": 0, "text": f" w{k}", "finish_reason": fin}]})
                if "NOUSAGE" not in prompt and body.get("stream_options", {}).get("include_usage"):
                    yield chunk({"id": "c", "object": "text_completion", "choices": [],
                                 "usage": {"prompt_tokens": 7, "completion_tokens": usage_n,
                                           "total_tokens": 7 + usage_n}})
                yield "data: [DONE]\n\n"
            finally:
                state.running -= 1
        return StreamingResponse(gen(), media_type="text/event-stream")

    async def metrics(request):
        return PlainTextResponse("# HELP pykv_requests_running requests being decoded\n"
                                 "# TYPE pykv_requests_running gauge\n"
                                 f"pykv_requests_running {float(state.running)}\n"
                                 "pykv_requests_queued 0.0\n")

    async def health(request):
        return JSONResponse({"status": "ok"})

    async def models(request):
        return JSONResponse({"object": "list", "data": [{"id": "fake-model", "object": "model"}]})

    return Starlette(routes=[Route("/v1/completions", completions, methods=["POST"]),
                             Route("/metrics", metrics), Route("/health", health), Route("/v1/models", models)])


@pytest.fixture(scope="module")
def fake():
    state = Fake()
    port = bench.free_port()
    server = uvicorn.Server(uvicorn.Config(_app(state), host="127.0.0.1", port=port, log_level="error",
                                           lifespan="off"))
    t = threading.Thread(target=server.run, daemon=True)
    t.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline, "fake server did not start"
        time.sleep(0.02)
    yield f"http://127.0.0.1:{port}", state
    server.should_exit = True
    t.join(5)


def test_run_load_measures_tokens_latencies_and_throughput(fake):
    url, state = fake
    state.bodies.clear()
    n_tok, clients, n_req = 16, 4, 8
    res = bench.load(url, clients=clients, requests=n_req, max_tokens=n_tok, prompt_tokens=24,
                     metrics_interval=0.05)
    s = res.summary()
    assert (s["requests"], s["ok"], s["errors"]) == (n_req, n_req, 0)
    assert s["completion_tokens"] == n_req * n_tok and s["tokens_per_request"] == n_tok
    assert s["usage_reported"] and s["model"] == "fake-model"
    assert all(r.chunks == n_tok and len(r.itl) == n_tok - 1 for r in res.results)
    # each client ran two requests one after another: at least two requests' duration
    per_req = TTFT_S + (n_tok - 1) * ITL_S
    assert 2 * per_req * 0.95 <= s["wall_s"] < 2 * per_req + 2.0
    assert s["output_tok_s"] == pytest.approx(s["completion_tokens"] / s["wall_s"], rel=1e-3)
    assert s["req_s"] == pytest.approx(n_req / s["wall_s"], rel=1e-3)
    assert TTFT_S * 1000 * 0.9 <= s["ttft_p50_ms"] <= s["ttft_p99_ms"] < TTFT_S * 1000 + 150
    assert ITL_S * 1000 * 0.5 <= s["itl_p50_ms"] < ITL_S * 1000 + 20
    assert s["itl_p50_ms"] <= s["itl_p99_ms"] < ITL_S * 1000 + 150
    assert 2 <= s["peak_running"] <= clients and state.peak <= clients
    # the request bodies: distinct prompts of about prompt_tokens words, usage and ignore_eos asked for
    prompts = [b["prompt"] for b in state.bodies]
    assert len(set(prompts)) == n_req and all(20 <= len(p.split()) <= 28 for p in prompts)
    b = state.bodies[0]
    assert b["stream"] and b["stream_options"] == {"include_usage": True} and b["ignore_eos"] is True
    assert b["max_tokens"] == n_tok and b["temperature"] == 0 and b["model"] == "fake-model"


def test_run_load_counts_errors_and_prefers_usage(fake):
    url, _ = fake
    prompts = ["a story USAGE=5", "FAIL now", "a NOUSAGE story", "another story"]
    res = bench.load(url, clients=2, requests=8, prompts=prompts, max_tokens=6, metrics_interval=0)
    s = res.summary()
    assert (s["ok"], s["errors"]) == (6, 2)
    assert any("HTTP 500" in e and "boom" in e for e in s["error_samples"])
    by = {r.index: r for r in res.results}
    assert by[0].completion_tokens == 5 and by[0].chunks == 6 and by[0].usage      # usage wins
    assert by[2].completion_tokens == 6 and not by[2].usage                          # chunks counted
    assert by[3].completion_tokens == 6 and by[3].prompt_tokens == 7
    assert not by[1].ok and not by[5].ok
    assert s["completion_tokens"] == 2 * (5 + 6 + 6)
    assert s["peak_running"] is None                                                 # not scraped


def test_run_load_connection_refused_is_an_error_per_request():
    url = f"http://127.0.0.1:{bench.free_port()}"
    s = bench.load(url, clients=2, requests=3, max_tokens=4, metrics_interval=0.05).summary()
    assert (s["ok"], s["errors"], s["output_tok_s"]) == (0, 3, 0.0)
    assert s["peak_running"] is None and s["ttft_p50_ms"] is None


def test_parse_metrics_and_table():
    text = ('# TYPE x gauge\npykv_requests_running{model="m"} 3\npykv_requests_running{model="n"} 2\n'
            'llamacpp:requests_processing 7\n')
    assert bench.parse_metrics(text) == 5.0
    assert bench.parse_metrics("llamacpp:requests_processing 7\n") == 7.0
    assert bench.parse_metrics("other 1\n") is None
    t = bench.format_table([{"kv": "f16", "clients": 8, "output_tok_s": 123.456, "errors": 0}])
    assert t.splitlines()[0].startswith("| KV type") and "123.46" in t and len(t.splitlines()) == 3
    assert bench.percentile([1, 2, 3, 4], 50) == 2.5 and bench.percentile([], 99) is None


def test_cli_help_and_json_against_url(fake, capsys):
    from pykv.cli import main
    r = subprocess.run([sys.executable, "-m", "pykv", "bench-serve", "--help"], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0 and "--clients" in r.stdout and "--url" in r.stdout
    url, state = fake
    state.bodies.clear()
    assert main(["bench-serve", "--url", url, "--clients", "3", "--requests", "6", "--max-tokens", "5",
                 "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert len(state.bodies) == 6 + 3                  # a warm-up round of one request per client first
    assert len({b["prompt"] for b in state.bodies}) == 9
    assert len(rows) == 1 and rows[0]["kv"] == "server"
    assert (rows[0]["clients"], rows[0]["requests"], rows[0]["ok"], rows[0]["completion_tokens"]) == (3, 6, 6, 30)
    assert main(["bench-serve", "--url", url, "-ctk", "q8_0", "--clients", "2", "--max-tokens", "3"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("| KV type") and out[2].startswith("| q8_0")


def test_cli_one_line_errors(capsys):
    from pykv.cli import main
    url = f"http://127.0.0.1:{bench.free_port()}"
    assert main(["bench-serve", "--url", url]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("pykv: error: --url") and "cannot reach" in err[0]
    assert main(["bench-serve", "--url", url, "--clients", "0"]) == 2
    assert capsys.readouterr().err.strip() == "pykv: error: --clients must be at least 1, got 0"


def _serve_compare():
    import importlib.util
    from pathlib import Path
    path = Path(__file__).resolve().parents[2] / "tools" / "serve_compare.py"
    spec = importlib.util.spec_from_file_location("serve_compare", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_serve_compare_parsing_and_missing_binaries(tmp_path, capsys):
    sc = _serve_compare()
    table = ("main: n_kv_max = 4096\n\n"
             "|    PP |     TG |    B |   N_KV |   T_PP s | S_PP t/s |   T_TG s | S_TG t/s |      T s |    S t/s |\n"
             "|-------|--------|------|--------|----------|----------|----------|----------|----------|----------|\n"
             "|    32 |    128 |    1 |    160 |    0.021 |  1523.81 |    0.736 |   173.91 |    0.757 |   211.36 |\n"
             "|    32 |    128 |    8 |   1280 |    0.477 |   537.05 |    5.828 |   175.70 |    6.305 |   203.02 |\n")
    rows = sc.parse_batched_bench(table)
    assert rows[1]["S_TG t/s"] == 173.91 and rows[8]["S_TG t/s"] == 175.70 and rows[8]["N_KV"] == 1280
    flags = "flags\t\t: fpu sse2 avx2 avx512f avx512bw avx512_vnni\n"
    assert sc.isa_class(flags) == "avx512vnni"
    assert sc.isa_class("flags : avx2 avx_vnni\n") == "avxvnni"
    assert sc.isa_class("flags : sse2 avx2\n") == "avx2" and sc.isa_class("flags : sse2\n") == "generic"
    assert sc.main(["--skip", "pykv-serve,decode", "--bin-dir", str(tmp_path), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["rows"] == []
    skipped = [n for n in out["notes"] if n.startswith("skipped")]
    assert len(skipped) == 2 and "llama-server" in skipped[0] and "llama-batched-bench" in skipped[1]
