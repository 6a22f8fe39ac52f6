"""`freetoken serve`: an OpenAI-compatible chat-completions server over one FreeToken engine.

    from freetoken_agents.engine import Engine
    from freetoken_agents.integrations.openai_server import ServerConfig, create_app, serve

    engine = Engine.from_pretrained("path/to/model")
    serve(create_app(engine, ServerConfig(model_name="my-model")), host="127.0.0.1", port=8000)

Needs `fastapi` and `uvicorn` (dependencies of freetoken-agents). See `app.py` for the routes,
`queue.py` for how one engine serves many clients, `completion.py` for one reply.
"""

from __future__ import annotations

from typing import Any

from .app import ServerConfig, ServerState, create_app
from .errors import OpenAIError

__all__ = ["OpenAIError", "ServerConfig", "ServerState", "create_app", "serve"]


def serve(app: Any, *, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info") -> None:
    """Run `app` with uvicorn until interrupted (one process: the engine is in it)."""
    import uvicorn

    uvicorn.run(app, host=host, port=port, log_level=log_level, workers=1)
