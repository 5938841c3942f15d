"""Running the HTTP server (pykv serve): an Engine over the model, the app (pykv.server.app) on uvicorn,
started programmatically on a socket bound here (so a busy port is a one-line error, and port 0 picks a
free one). The app's lifespan starts the engine and, at shutdown, stops it draining. SIGINT / SIGTERM:
uvicorn stops accepting connections, lets the in-flight requests (streams included) finish, then
exits; a second Ctrl-C quits at once.
"""
from __future__ import annotations

import socket

import uvicorn

from pykv.api.engine import Engine
from pykv.files.config import PykvError
from pykv.server.app import create_app


def default_model_name(model) -> str:
    """The id /v1/models lists: the GGUF file's name without .gguf."""
    import os
    name = os.path.basename(model.path)
    return name[:-5] if name.lower().endswith(".gguf") else name


def bind(host: str, port: int) -> socket.socket:
    """A TCP socket bound to host:port (0: a free port), or a one-line PykvError. It listens once the
    server starts (asyncio's create_server), so a client is refused, not kept waiting, until then."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise PykvError(f"cannot resolve host {host!r}: {e.strerror}") from None
    family = infos[0][0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        sock.bind(infos[0][4])
    except OSError as e:
        sock.close()
        raise PykvError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    return sock


class Server(uvicorn.Server):
    """uvicorn's Server on a socket bound beforehand; `engine`, `host`, `port` and `url` for callers,
    on_listen(server) called once it accepts connections."""

    def __init__(self, config: uvicorn.Config, sock: socket.socket, engine, on_listen=None):
        super().__init__(config)
        self.sock, self.engine, self.on_listen = sock, engine, on_listen
        addr = sock.getsockname()
        self.host, self.port = addr[0], addr[1]

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def run(self, sockets=None) -> None:
        return super().run(sockets=[self.sock])

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets=sockets)
        if self.started and self.on_listen is not None:
            self.on_listen(self)


def make_server(model, host: str = "127.0.0.1", port: int = 8080, parallel: int = 8, api_key: str | None = None,
                max_queue: int = 256, prefix_cache: bool = True, model_name: str | None = None, on_listen=None,
                log_level: str = "warning", drain_s: float = 300.0, sock: socket.socket | None = None,
                **app_kw) -> Server:
    """A Server (not yet running: .run() blocks until shutdown) serving `model`, which must have been
    loaded with max_seqs >= parallel, on host:port or on `sock` (from bind). app_kw: create_app's
    keywords (max_body, max_tokens_limit, ...)."""
    engine = Engine(model, parallel=parallel, max_queue=max_queue, prefix_cache=prefix_cache)
    app = create_app(engine, model_name or default_model_name(model), api_key=api_key, drain_s=drain_s, **app_kw)
    sock = bind(host, port) if sock is None else sock
    config = uvicorn.Config(app, log_level=log_level, lifespan="on", timeout_graceful_shutdown=drain_s,
                            access_log=log_level in ("debug", "trace"))
    return Server(config, sock, engine, on_listen)


def run_server(model, host: str = "127.0.0.1", port: int = 8080, parallel: int = 8, api_key: str | None = None,
               **kw) -> None:
    """Serve `model` until SIGINT / SIGTERM (see make_server for the keywords)."""
    make_server(model, host, port, parallel, api_key, **kw).run()
