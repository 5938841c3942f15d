"""`pykv bench-serve`: its arguments and handler (the load generator is pykv.server.bench)."""
from __future__ import annotations

import json
import shlex
import sys

from pykv.files.config import PykvError


def _types(spec: str) -> list[str]:
    out = []
    for t in (x.strip() for x in str(spec).split(",")):
        if t and t not in out:
            out.append(t)
    if not out:
        raise PykvError(f"-ctk: expected a comma list of KV cache types, got {spec!r}")
    return out


def _positive(name, v):
    if v is not None and v < 1:
        raise PykvError(f"{name} must be at least 1, got {v}")


def _reachable(url: str, api_key) -> None:
    """PykvError when nothing answers at url (connection refused, bad host): one line, not N errors."""
    import httpx
    from pykv.server.bench import _base, _headers
    try:
        with httpx.Client(timeout=10.0) as c:
            c.get(_base(url) + "/health", headers=_headers(api_key))
    except httpx.HTTPError as e:
        raise PykvError(f"--url {url}: cannot reach the server ({type(e).__name__}: {e})") from None


def cmd_bench_serve(args) -> int:
    try:
        import httpx  # noqa: F401  (the serve extra)
    except ImportError:
        raise PykvError("bench-serve needs httpx: pip install 'pykv[serve]'") from None
    from pykv.server.bench import format_table, load, start_local_server
    for name in ("clients", "requests", "max_tokens", "prompt_tokens", "parallel", "ctx_size"):
        _positive("--" + name.replace("_", "-"), getattr(args, name))
    kw = dict(clients=args.clients, requests=args.requests, prompt_tokens=args.prompt_tokens,
              max_tokens=args.max_tokens, api_key=args.api_key, stream=not args.no_stream,
              ignore_eos=not args.no_ignore_eos, warmup=not args.no_warmup)
    rows = []

    def row(label, res):
        s = res.summary()
        s["kv"] = label
        rows.append(s)
        if not args.json:
            print(f"pykv bench-serve: {label}: {s['ok']}/{s['requests']} ok, {s['completion_tokens']} tokens "
                  f"in {s['wall_s']:.2f} s", file=sys.stderr)
        for e in s["error_samples"]:
            print(f"pykv: warning: {label}: request error: {e}", file=sys.stderr)

    if args.url:
        _reachable(args.url, args.api_key)
        res = load(args.url, model=args.model, **kw)
        row(args.cache_type_k or "server", res)
    else:
        extra = shlex.split(args.serve_args) if args.serve_args else ()
        parallel = args.parallel if args.parallel is not None else args.clients
        for t in _types(args.cache_type_k or "f16"):
            if not args.json:
                print(f"pykv bench-serve: starting pykv serve -ctk {t} -ctv {t} --parallel {parallel} ...",
                      file=sys.stderr)
            h = start_local_server(args.model, t, t, parallel, args.ctx_size, args.kv_budget, None, extra,
                                   api_key=args.api_key)
            try:
                res = load(h.url, **kw)
            finally:
                h.stop()
            row(t, res)
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        print(format_table(rows))
    sys.stdout.flush()
    if rows and all(r["ok"] == 0 for r in rows):
        raise PykvError(f"every request failed: {(rows[0]['error_samples'] or ['?'])[0]}")
    return 0


def register_cli(subparsers) -> None:
    p = subparsers.add_parser(
        "bench-serve", help="load-test an OpenAI-compatible server: concurrent streamed completions",
        description="Concurrent clients, each sending its requests one after another to /v1/completions "
                    "(streamed): output tokens/s, requests/s, time to first token (TTFT) and inter-token "
                    "latency (ITL) percentiles, peak running requests (from /metrics) and errors. Without "
                    "--url: a local `pykv serve` per KV type of -ctk (the same type for K and V), started, "
                    "loaded and stopped in turn. With --url: that server (pykv serve, llama-server, ...).")
    p.add_argument("model", nargs="?", default=None,
                   help="GGUF path or registry name for the local server (default: the default model); "
                        "with --url: the request's model name (default: the server's first /v1/models id)")
    p.add_argument("--url", default=None, help="base URL of a running server, e.g. http://127.0.0.1:8080")
    p.add_argument("-ctk", "--cache-type-k", default=None,
                   help="KV cache types, comma list (default f16): one local server per type, K and V alike; "
                        "with --url: only the row's label")
    p.add_argument("--clients", type=int, default=8, help="concurrent clients (default 8)")
    p.add_argument("--requests", type=int, default=None, help="requests in all (default: one per client)")
    p.add_argument("--max-tokens", type=int, default=128, help="new tokens per request (default 128)")
    p.add_argument("--prompt-tokens", type=int, default=32, help="prompt length in words, about as many tokens "
                                                                 "(default 32)")
    p.add_argument("--parallel", type=int, default=None, help="local server: sequences decoded together "
                                                              "(default: --clients)")
    p.add_argument("-c", "--ctx-size", type=int, default=None, help="local server: context size per sequence")
    p.add_argument("--kv-budget", default=None, help="local server: KV cache budget (e.g. 256M, 1G)")
    p.add_argument("--serve-args", default=None, metavar="ARGS",
                   help="local server: more `pykv serve` arguments, one quoted string")
    p.add_argument("--api-key", default=None, help="bearer token for the server (and the local server's key)")
    p.add_argument("--no-stream", action="store_true", help="plain responses (no TTFT/ITL, only totals)")
    p.add_argument("--no-ignore-eos", action="store_true",
                   help="let requests stop at end of text (default: ask the server to ignore it)")
    p.add_argument("--no-warmup", action="store_true",
                   help="skip the untimed warm-up round (one short request per client, before the timed run)")
    p.add_argument("--json", action="store_true", help="print a JSON list of rows instead of a table")
    p.set_defaults(func=cmd_bench_serve)
