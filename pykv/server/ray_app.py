"""pykv's OpenAI-compatible server (pykv.server.app) as Ray Serve replicas (the distributed extra:
pip install 'pykv[distributed]'). Each replica loads its own model and runs its own Engine behind the same
Starlette app that `pykv serve` runs; Ray's HTTP proxy (on every node of the cluster) spreads the requests
over the replicas, streams (server-sent events) included. Every response carries the replica's id in an
`x-pykv-replica` header.

Ray Serve takes any ASGI app as a deployment's ingress (serve.ingress). Ours is PykvASGI: it holds only
the settings (so it pickles small and travels to each replica), and at the replica's ASGI lifespan startup
it loads the model and builds the Engine and the app (create_app, which starts the engine then and drains
and stops it at shutdown), off the replica's event loop. Ray is imported here only: the rest of pykv
never imports it.

    python -m pykv.server.ray_app MODEL --replicas 2 --port 8000     # a running cluster (RAY_ADDRESS or
                                                                     # `ray start`), else a local Ray
"""
from __future__ import annotations

import argparse
import asyncio
import inspect
import os
import signal
import sys
import threading
import time

REPLICA_HEADER = "x-pykv-replica"      # the id of the replica that answered, on every response


class PykvASGI:
    """An ASGI app that builds pykv's server app at its lifespan startup, where it runs (a Ray Serve
    replica): pykv.load(model, ...), an Engine, create_app(...). Until then, and after a failed
    startup, HTTP requests get 503. Every response gets REPLICA_HEADER: `replica_id`, else the Ray Serve
    replica's id, else the process id."""

    def __init__(self, model=None, *, ctk="f16", ctv="f16", n_ctx: int = 2048, parallel: int = 4,
                 kv_budget=None, threads: int | None = 1, max_queue: int = 256, prefix_cache: bool = True,
                 model_name: str | None = None, replica_id: str | None = None, app_kw: dict | None = None,
                 **load_kw):
        self.model_path = model
        self.load_kw = dict(n_ctx=int(n_ctx), kv_type_k=_kv_types(ctk), kv_type_v=_kv_types(ctv),
                            threads=threads, kv_budget=_bytes(kv_budget), max_seqs=int(parallel), **load_kw)
        self.parallel, self.max_queue, self.prefix_cache = int(parallel), int(max_queue), bool(prefix_cache)
        self.model_name, self.replica_id, self.app_kw = model_name, replica_id, dict(app_kw or {})
        self.app = self.engine = None
        self._handlers: list = []

    def __getstate__(self):                # what travels to a replica: the settings, never a model
        return {**self.__dict__, "app": None, "engine": None, "_handlers": []}

    def _build(self) -> None:
        import pykv
        from pykv.api.engine import Engine
        from pykv.server.app import create_app
        from pykv.server.serve import default_model_name
        model = pykv.load(self.model_path, **self.load_kw)
        engine = Engine(model, parallel=self.parallel, max_queue=self.max_queue, prefix_cache=self.prefix_cache)
        app = create_app(engine, self.model_name or default_model_name(model), manage_engine=True, **self.app_kw)
        for exc, handler in self._handlers:
            app.add_exception_handler(exc, handler)
        if self.replica_id is None:
            self.replica_id = _replica_id()
        self.engine, self.app = engine, app

    def add_exception_handler(self, exc, handler) -> None:
        """Ray Serve registers its handlers (back-pressure: 503) here before startup; the app gets them."""
        self._handlers.append((exc, handler))
        if self.app is not None:
            self.app.add_exception_handler(exc, handler)

    def engine_error(self) -> str | None:
        """Why this replica cannot serve (None: it can): not started, or the engine's error."""
        if self.engine is None:
            return "the model is not loaded"
        return self.engine.error

    async def __call__(self, scope, receive, send):
        if scope["type"] == "lifespan":
            return await self._lifespan(scope, receive, send)
        app = self.app
        if app is None:
            from starlette.responses import JSONResponse
            return await JSONResponse({"error": {"message": "the model is not loaded yet", "type": "server_error",
                                                 "param": None, "code": "server_unavailable"}},
                                      status_code=503)(scope, receive, send)
        tag = str(self.replica_id).encode("latin-1", "replace")

        async def tagged(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", ()), (REPLICA_HEADER.encode(), tag)]}
            await send(message)

        await app(scope, receive, tagged)

    async def _lifespan(self, scope, receive, send):
        first = await receive()
        if first["type"] != "lifespan.startup":
            return
        if self.app is None:
            try:
                await asyncio.get_running_loop().run_in_executor(None, self._build)
            except Exception as e:           # noqa: BLE001 (the message goes back to Ray, which logs it)
                await send({"type": "lifespan.startup.failed", "message": f"pykv: {type(e).__name__}: {e}"})
                return
        pending = [first]

        async def replay():
            return pending.pop() if pending else await receive()

        await self.app(scope, replay, send)   # create_app's lifespan: starts the engine, drains it at shutdown


def _replica_id() -> str:
    try:
        from ray import serve
        ctx = serve.get_replica_context()
        return str(getattr(ctx, "replica_tag", None) or ctx.replica_id.unique_id)
    except Exception:                        # noqa: BLE001 (outside a replica)
        return f"pid-{os.getpid()}"


def _kv_types(s):
    """'q8_0' or 'q8_0,q4_0,...' (per layer) as pykv.load takes them."""
    if isinstance(s, str) and "," in s:
        return [p.strip() for p in s.split(",") if p.strip()]
    return s


_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1024, "m": 1000**2, "mb": 1000**2, "mib": 1024**2,
          "g": 1000**3, "gb": 1000**3, "gib": 1024**3, "t": 1000**4, "tb": 1000**4, "tib": 1024**4}


def _bytes(v):
    """A KV budget as bytes: None, a number, or a size such as '2GiB' / '512MiB' / '1e9'."""
    from pykv.files.config import PykvError
    if v is None or isinstance(v, (int, float)):
        return None if v is None else int(v)
    t = str(v).strip().lower()
    num = t.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = t[len(num):].strip()
    try:
        value = float(num)
    except ValueError:
        value = -1.0
    if unit not in _UNITS or value < 0:
        raise PykvError(f"bad size {v!r} (e.g. 8GiB, 512MiB, 1e9)")
    return int(value * _UNITS[unit])


def build_app(model=None, *, num_replicas: int = 2, ctk="f16", ctv="f16", n_ctx: int = 2048, parallel: int = 4,
              kv_budget=None, threads: int = 1, max_queue: int = 256, prefix_cache: bool = True,
              model_name: str | None = None, api_key: str | None = None, num_cpus: float | None = None,
              num_gpus: float = 0, max_ongoing_requests: int | None = None, deployment_name: str = "pykv",
              app_kw: dict | None = None, **load_kw):
    """A Ray Serve Application of `num_replicas` replicas, each serving `model` (a GGUF path or registry
    name that resolves on every node; None: the default model) with its own Engine of `parallel` slots.
    ctk / ctv / n_ctx / kv_budget (bytes or '2GiB') / threads and load_kw go to pykv.load; max_queue /
    prefix_cache to the Engine; api_key and app_kw (max_tokens_limit, ...) to create_app. Each replica
    asks Ray for num_cpus CPUs (default: threads) and num_gpus GPUs. max_ongoing_requests: the most
    requests Ray sends one replica at once (default 2 x parallel: the slots, and as many waiting; the
    rest wait in Ray's proxy for the least loaded replica). Run it with serve.run(app, route_prefix=...)
    or run() below."""
    from ray import serve
    if num_replicas < 1 or parallel < 1:
        raise ValueError("num_replicas and parallel must be at least 1")
    kw = dict(app_kw or {})
    if api_key:
        kw["api_key"] = api_key
    asgi = PykvASGI(model, ctk=ctk, ctv=ctv, n_ctx=n_ctx, parallel=parallel, kv_budget=kv_budget, threads=threads,
                    max_queue=max_queue, prefix_cache=prefix_cache, model_name=model_name, app_kw=kw, **load_kw)

    @serve.ingress(asgi)
    class PykvReplica:
        """One pykv server: the model and Engine live in the ingress app (self.app)."""

        def check_health(self):                  # Ray calls it every few seconds: a dead engine -> a new replica
            inner = getattr(self, "app", None) or getattr(self, "_asgi_app", None)    # (Ray 2.9: _asgi_app)
            err = inner.engine_error() if isinstance(inner, PykvASGI) else None
            if err is not None:
                raise RuntimeError(f"pykv replica unhealthy: {err}")

    opts = dict(name=deployment_name, num_replicas=int(num_replicas),
                ray_actor_options={"num_cpus": float(threads or 1) if num_cpus is None else float(num_cpus),
                                   "num_gpus": float(num_gpus)})
    # Ray >= 2.10 calls it max_ongoing_requests; 2.9, max_concurrent_queries
    limit = max_ongoing_requests or 2 * int(parallel)
    params = inspect.signature(serve.deployment).parameters
    opts["max_ongoing_requests" if "max_ongoing_requests" in params else "max_concurrent_queries"] = int(limit)
    return serve.deployment(**opts)(PykvReplica).bind()


def connect(address: str | None = None, **init_kw):
    """ray.init: `address` (or $RAY_ADDRESS), else the cluster `ray start` runs on this machine, else a
    new local Ray. Returns True when it started a local Ray (so the caller shuts it down)."""
    import ray
    if ray.is_initialized():
        return False
    address = address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, **init_kw)
        return False
    try:
        ray.init(address="auto", **init_kw)
        return False
    except ConnectionError:
        ray.init(**init_kw)
        return True


def run(model=None, *, host: str = "127.0.0.1", port: int = 8000, route_prefix: str = "/", name: str = "pykv",
        **build_kw):
    """Deploy build_app(model, **build_kw) as Serve application `name` at route_prefix, Ray's HTTP
    proxy listening on host:port (a Serve already running on the cluster keeps its own proxy settings).
    Returns once every replica is ready; needs ray.init (connect) first."""
    from ray import serve
    serve.start(http_options={"host": host, "port": int(port)})
    return serve.run(build_app(model, **build_kw), name=name, route_prefix=route_prefix)


class _Stopped(Exception):
    pass


def _stopped(signum, frame):
    raise _Stopped


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m pykv.server.ray_app",
                                description="pykv's OpenAI-compatible server as Ray Serve replicas behind Ray's "
                                            "HTTP proxy")
    p.add_argument("model", nargs="?", default=None, metavar="MODEL",
                   help="GGUF path or registry name, the same on every node (default: the default model)")
    p.add_argument("--replicas", type=int, default=2, help="replicas, each with its own model and engine (default 2)")
    p.add_argument("--host", default="127.0.0.1",
                   help="where Ray's proxy listens (default 127.0.0.1; 0.0.0.0 opens it to the network)")
    p.add_argument("--port", type=int, default=8000, help="the proxy's port (default 8000)")
    p.add_argument("--route-prefix", default="/", help="URL prefix of the app (default /)")
    p.add_argument("--name", default="pykv", help="Serve application name (default pykv)")
    p.add_argument("--address", default=None,
                   help="Ray cluster address (default: $RAY_ADDRESS, else a running `ray start`, else a local Ray)")
    p.add_argument("-c", "--ctx-size", type=int, default=2048, help="context size (default 2048)")
    p.add_argument("-ctk", "--cache-type-k", default="f16", help="K cache type (default f16)")
    p.add_argument("-ctv", "--cache-type-v", default="f16", help="V cache type (default f16)")
    p.add_argument("--kv-budget", default=None, help="KV pool bytes per replica, e.g. 2GiB (default: parallel "
                                                     "full contexts)")
    p.add_argument("--parallel", "-np", type=int, default=4, help="requests decoded at once per replica (default 4)")
    p.add_argument("--queue", type=int, default=256, help="requests waiting in a replica's engine (default 256)")
    p.add_argument("-t", "--threads", type=int, default=1, help="threads per replica (default 1)")
    p.add_argument("--num-cpus", type=float, default=None, help="CPUs Ray reserves per replica (default: threads)")
    p.add_argument("--num-gpus", type=float, default=0, help="GPUs Ray reserves per replica (default 0)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: pykv's choice)")
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1/*")
    p.add_argument("--alias", default=None, help="the model id clients use (default: the file name less .gguf)")
    p.add_argument("--no-prefix-cache", action="store_true", help="do not reuse earlier prompts' KV pages")
    args = p.parse_args(argv)
    try:
        import ray  # noqa: F401
        from ray import serve
    except ImportError as e:
        print(f"pykv: Ray Serve is missing ({e.name}): pip install 'pykv[distributed]'", file=sys.stderr)
        return 2
    from pykv.files.config import PykvError
    for name in ("replicas", "parallel", "threads", "ctx_size"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    try:
        budget = _bytes(args.kv_budget)
    except PykvError as e:
        p.error(str(e))
    extra = {"device": args.device} if args.device else {}
    local = connect(args.address)
    if local:          # a bad name fails here, not in each replica's retries; the default model is fetched once
        from pykv.models import ModelFetchError, resolve_model
        try:
            resolve_model(args.model)
        except (PykvError, ModelFetchError) as e:
            print(f"pykv: {e}", file=sys.stderr)
            ray.shutdown()
            return 1
    old = signal.signal(signal.SIGTERM, _stopped) if threading.current_thread() is threading.main_thread() else None
    rc = 0
    try:
        run(args.model, host=args.host, port=args.port, route_prefix=args.route_prefix, name=args.name,
            num_replicas=args.replicas, ctk=args.cache_type_k, ctv=args.cache_type_v, n_ctx=args.ctx_size,
            parallel=args.parallel, kv_budget=budget, threads=args.threads, max_queue=args.queue,
            prefix_cache=not args.no_prefix_cache, model_name=args.alias, api_key=args.api_key,
            num_cpus=args.num_cpus, num_gpus=args.num_gpus, **extra)
        host = f"[{args.host}]" if ":" in args.host else args.host
        print(f"pykv: {args.replicas} replicas serving on http://{host}:{args.port}{args.route_prefix.rstrip('/')}"
              f" (Ray Serve application {args.name!r}; Ctrl-C stops it)", file=sys.stderr, flush=True)
        while True:
            time.sleep(1)
    except (KeyboardInterrupt, _Stopped):
        pass
    except Exception as e:                    # noqa: BLE001 (a replica that failed to start: its log says why)
        print(f"pykv: {e} (see the replicas' log lines for why)", file=sys.stderr, flush=True)
        rc = 1
    finally:
        if old is not None:
            signal.signal(signal.SIGTERM, old)
        try:
            serve.delete(args.name)
        except Exception:                     # noqa: BLE001 (never deployed, or Ray already gone)
            pass
        if local:
            serve.shutdown()
            ray.shutdown()
    print("pykv: stopped", file=sys.stderr, flush=True)
    return rc


if __name__ == "__main__":
    sys.exit(main())
