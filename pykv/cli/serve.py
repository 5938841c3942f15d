"""`pykv serve`: the OpenAI-compatible HTTP server (pykv.server, the serve extra)."""
from __future__ import annotations

import signal
import sys
import threading

from pykv.cli.args import _model_args, load_from_args
from pykv.files.config import PykvError


def cmd_serve(args) -> int:
    try:
        import prometheus_client  # noqa: F401
        import sse_starlette  # noqa: F401
        import starlette  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as e:
        raise PykvError(f"pykv serve needs the serve extra ({e.name} is missing): pip install 'pykv[serve]'") from None
    from pykv.server.serve import bind, default_model_name, make_server
    for name in ("parallel", "queue", "max_tokens_limit", "n_predict"):
        v = getattr(args, name)
        if v is not None and v < (0 if name == "queue" else 1):
            raise PykvError(f"--{name.replace('_', '-')} must be at least {0 if name == 'queue' else 1}, got {v}")
    if not 0 <= args.port <= 65535:
        raise PykvError(f"--port must be in 0..65535, got {args.port}")
    sock = bind(args.host, args.port)          # a busy port fails before the model loads
    try:
        model = load_from_args(args, args.model, max_seqs=args.parallel)
    except BaseException:
        sock.close()
        raise
    name = args.alias or default_model_name(model)

    def listening(server):
        c = model.cache
        print(f"pykv: serving {name} on {server.url} (KV {c.k_name()}/{c.v_name()}, {c.bytes_per_token():.0f} "
              f"B/token, {c.capacity_tokens()} tokens in the pool, {model.n_ctx}-token context, "
              f"{args.parallel} slots)", file=sys.stderr, flush=True)

    server = make_server(model, args.host, args.port, args.parallel, args.api_key, max_queue=args.queue,
                         prefix_cache=not args.no_prefix_cache, model_name=name, on_listen=listening,
                         log_level=args.log_level, max_tokens_limit=args.max_tokens_limit,
                         default_max_tokens=args.n_predict, sock=sock)
    # uvicorn handles SIGINT / SIGTERM while it serves (the first drains, a second quits), then restores
    # the handlers it found and raises the signal again: handlers that only note it make that a clean stop
    # (the CLI's own SIGINT handler would raise KeyboardInterrupt inside uvicorn's loop: a traceback)
    old = {}
    if threading.current_thread() is threading.main_thread():
        old = {sig: signal.signal(sig, lambda signum, frame: None) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        server.run()
    except KeyboardInterrupt:
        pass
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)
    print("pykv: server stopped", file=sys.stderr, flush=True)
    return 0


def register_cli(sub) -> None:
    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server (continuous batching, prefix cache, /metrics)")
    p.add_argument("model", nargs="?", default=None, metavar="MODEL",
                   help="GGUF path or registry name (default: the default model)")
    _model_args(p)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8080, help="port (default 8080; 0: a free one)")
    p.add_argument("--parallel", "-np", type=int, default=8,
                   help="most requests decoded at once (default 8; without --kv-budget the pool holds this many "
                        "full contexts)")
    p.add_argument("--queue", type=int, default=256, help="requests waiting for room before 503s (default 256)")
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1/*")
    p.add_argument("--alias", default=None, help="the model id clients use (default: the file name less .gguf)")
    p.add_argument("-n", "--n-predict", type=int, default=None,
                   help="max_tokens of a chat request that gives none (default: what the context leaves)")
    p.add_argument("--max-tokens-limit", type=int, default=None,
                   help="most max_tokens a request may ask for (default: the context size)")
    p.add_argument("--no-prefix-cache", action="store_true", help="do not reuse earlier prompts' KV pages")
    p.add_argument("--log-level", default="warning", choices=["critical", "error", "warning", "info", "debug"],
                   help="uvicorn's log level (default warning; debug adds an access log)")
    p.set_defaults(func=cmd_serve)
