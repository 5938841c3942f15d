"""pykv's server as Ray Serve replicas (pykv.server.ray_app, the distributed extra): a local Ray on
two CPUs, two replicas of SmolLM2 (each its own model and engine, half a CPU and one thread each)
behind Ray's HTTP proxy on a free loopback port. Concurrent requests reach both replicas (told apart by
their x-pykv-replica header) and get the unbatched greedy text; a stream through the proxy (the openai
client, server-sent events) gets it too. Only pykv.server.ray_app imports Ray, and only when used."""
import asyncio
import os
import socket
import subprocess
import sys
import time

import pytest

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")

N_CTX = 512
PARALLEL = 2
PROMPTS = ["The capital of France is", "Once upon a time", "def fib(n):", "Water boils at"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def cluster():
    import pykv
    from pykv.server.ray_app import REPLICA_HEADER, run
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    model = pykv.load(None, n_ctx=N_CTX, max_seqs=PARALLEL, threads=1)
    refs = {p: "".join(model.generate(p, max_tokens=8, temperature=0)) for p in PROMPTS}
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False,
             object_store_memory=100 << 20)         # Serve passes no large objects
    try:
        port = _free_port()
        run(None, port=port, name="pykv-test", num_replicas=2, n_ctx=N_CTX, parallel=PARALLEL, threads=1,
            num_cpus=0.5)
        url = f"http://127.0.0.1:{port}"
        yield url, refs, REPLICA_HEADER
    finally:
        serve.shutdown()
        ray.shutdown()


def test_two_replicas_behind_rays_proxy(cluster):
    url, refs, header = cluster
    seen: dict[str, int] = {}

    async def one(client, prompt):
        r = await client.post(url + "/v1/completions", json={"prompt": prompt, "max_tokens": 8, "temperature": 0})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["choices"][0]["text"] == refs[prompt], (prompt, body)
        assert body["choices"][0]["finish_reason"] == "length"
        return r.headers[header]

    async def main():
        async with httpx.AsyncClient(timeout=120) as client:
            t0 = time.time()
            while len(seen) < 2:             # Ray's router spreads concurrent requests; loop until both answered
                assert time.time() - t0 < 60, f"only replica(s) {seen} answered"
                for tag in await asyncio.gather(*(one(client, p) for p in PROMPTS * 2)):
                    seen[tag] = seen.get(tag, 0) + 1

    asyncio.run(main())
    assert len(seen) == 2, seen

    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
    stream = client.completions.with_raw_response.create(prompt=PROMPTS[1], max_tokens=8, temperature=0,
                                                         stream=True, model="")
    assert stream.headers[header] in seen
    assert stream.headers["content-type"].startswith("text/event-stream")
    text, chunks, finish = "", 0, None
    for ch in stream.parse():
        chunks += 1
        text += ch.choices[0].text
        finish = ch.choices[0].finish_reason or finish
    assert text == refs[PROMPTS[1]] and finish == "length"
    assert chunks >= 8                      # token by token through the proxy, not one buffered body

    models = httpx.get(url + "/v1/models", timeout=30).json()
    assert models["data"][0]["meta"]["n_ctx"] == N_CTX and models["data"][0]["meta"]["parallel"] == PARALLEL


def test_only_ray_app_imports_ray_when_used():
    code = ("import sys, pykv, pykv.cli, pykv.cli.serve, pykv.server.app, pykv.server.serve, pykv.server.ray_app; "
            "print(sorted(m for m in sys.modules if m == 'ray' or m.startswith('ray.')))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "[]", r.stdout + r.stderr
