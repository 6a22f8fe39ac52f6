"""`freetoken serve`: an OpenAI-compatible chat-completions server over one FreeToken engine.

    from freetoken_agents.engine import Engine
    from freetoken_agents.integrations.openai_server import ServerConfig, create_app, serve

    engine = Engine.from_pretrained("path/to/model")
    serve(create_app(engine, ServerConfig(model_name="my-model")), host="127.0.0.1", port=8000)

Needs `fastapi` and `uvicorn` (dependencies of freetoken-agents). See `app.py` for the routes,
`queue.py` for how one engine serves many clients, `completion.py` for one reply.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from typing import Any

from .app import ServerConfig, ServerState, create_app
from .errors import OpenAIError

__all__ = ["OpenAIError", "ServerConfig", "ServerState", "create_app", "serve"]


def serve(app: Any, *, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info") -> None:
    """Run `app` with uvicorn (one process: the engine is in it) until SIGINT or SIGTERM, then
    shut down gracefully (the running request finishes, waiting ones are cancelled) and return."""
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

    Server(uvicorn.Config(app, host=host, port=port, log_level=log_level, workers=1)).run()
