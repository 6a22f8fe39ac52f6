"""`freetoken serve`: an OpenAI-compatible chat-completions server over one FreeToken engine.

    from freetoken_agents.engine import Engine
    from freetoken_agents.integrations.openai_server import ServerConfig, create_app, serve

    engine = Engine.from_pretrained("path/to/model")
    serve(create_app(engine, ServerConfig(model_name="my-model")), host="127.0.0.1", port=8000)

Needs `fastapi` and `uvicorn` (dependencies of freetoken-agents). See `app.py` for the routes,
`queue.py` for how one engine serves many clients, `completion.py` for one reply;
`completions_api.py` (POST /v1/completions) and `responses_api.py` (POST /v1/responses).
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from typing import Any

from .app import ServerConfig, ServerState, create_app
from .cors import InvalidOrigin, check_origin
from .errors import OpenAIError

__all__ = [
    "InvalidOrigin",
    "OpenAIError",
    "ServerConfig",
    "ServerState",
    "check_origin",
    "create_app",
    "serve",
    "server_config",
]


def serve(app: Any, **settings: Any) -> None:
    """Run `app` with uvicorn (one process: the engine is in it) until SIGINT or SIGTERM, then
    shut down gracefully (the running request finishes, waiting ones are cancelled) and return.
    `settings`: `server_config`'s (host, port, log_level, timeout_keep_alive, limit_concurrency,
    header_timeout)."""
    import uvicorn

    class Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            # uvicorn re-raises a captured signal after shutting down, which ends asyncio's runner
            # with a KeyboardInterrupt and logs a traceback from the lifespan; a server stopped on
            # purpose should just return.
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for sig, handler in previous.items():
                    signal.signal(sig, handler)

    Server(server_config(app, **settings)).run()


def server_config(
    app: Any,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    log_level: str = "info",
    timeout_keep_alive: int = 5,
    limit_concurrency: int = 256,
    header_timeout: float = 10.0,
) -> Any:
    """uvicorn's settings for `app`, hardened against idle and half-open clients.
    `timeout_keep_alive`: seconds an idle connection is kept; `limit_concurrency`: connections and
    tasks past which uvicorn answers 503 at once (so idle or stalled clients cannot use up every
    file descriptor); headers are capped at 16 KiB. uvicorn only
    times out a connection between requests, so one that connects and never finishes its request
    head would hold a file descriptor forever; here it is closed after `header_timeout` seconds."""
    import uvicorn
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class Protocol(H11Protocol):
        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            self._head_timer = self.loop.call_later(header_timeout, self._head_timed_out)

        def _head_timed_out(self) -> None:
            if self.cycle is None and not self.transport.is_closing():  # no complete request head yet
                self.transport.close()

        def connection_lost(self, exc: Exception | None) -> None:
            self._head_timer.cancel()
            super().connection_lost(exc)

    return uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        workers=1,
        http=Protocol,
        timeout_keep_alive=timeout_keep_alive,
        limit_concurrency=limit_concurrency,
        h11_max_incomplete_event_size=16 * 1024,
    )
