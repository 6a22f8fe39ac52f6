"""What the tests of `freetoken serve` share: the embedded model's engine (loaded once per run) and
a real server (uvicorn in a thread, on a free loopback port) over it, driven over HTTP.

Several servers may run over the one engine at a time (each has its own session and worker): the
engine serialises their steps under `engine.lock`, which a test may hold to keep the worker
waiting at a known point (a queue that fills, a client that leaves before its first token).
"""

from __future__ import annotations

import contextlib
import functools
import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import httpx
import uvicorn

from freetoken_agents import default_model
from freetoken_agents.engine import Engine
from freetoken_agents.integrations.openai_server import ServerConfig, create_app, server_config
from freetoken_agents.recipes.tiny.world import add, get_weather, lookup_capital, multiply

MODEL = "freetoken-tiny"


@functools.cache
def shared_engine() -> Engine:
    return Engine.from_pretrained(default_model())


@dataclass
class RunningServer:
    base_url: str  # ".../v1"
    app: Any
    engine: Engine

    @property
    def root(self) -> str:
        return self.base_url.removesuffix("/v1")

    def health(self) -> dict[str, Any]:
        return httpx.get(f"{self.root}/health", timeout=30).json()

    def queue(self) -> dict[str, Any]:
        return self.health()["queue"]

    def client(self, **kwargs: Any) -> Any:
        import openai

        kwargs.setdefault("api_key", "unused")
        kwargs.setdefault("max_retries", 0)
        kwargs.setdefault("timeout", 120)
        return openai.OpenAI(base_url=self.base_url, **kwargs)


@contextlib.contextmanager
def running_server(
    engine: Engine | None = None, family: str | None = None, **config: Any
) -> Iterator[RunningServer]:
    """A server over `engine` (default: the shared one; `family`: its tool-call format) with
    `ServerConfig(model_name=MODEL, **config)`."""
    engine = engine or shared_engine()
    app = create_app(engine, ServerConfig(model_name=MODEL, **config), family=family)
    server = uvicorn.Server(server_config(app, port=0, log_level="warning"))  # what `serve` runs
    thread = threading.Thread(target=server.run, name="uvicorn", daemon=True)
    thread.start()
    wait_until(lambda: server.started or not thread.is_alive(), "the server to start")
    assert server.started, "uvicorn did not start"
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield RunningServer(f"http://127.0.0.1:{port}/v1", app, engine)
    finally:
        server.should_exit = True
        thread.join(timeout=60)


def wait_until(condition: Callable[[], bool], what: str, *, limit: float = 120.0) -> None:
    """Poll `condition` until it holds. `limit` only keeps a broken server from hanging the run:
    the tests assert what happened, never how long it took."""
    deadline = time.monotonic() + limit
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"gave up waiting for {what}")
        time.sleep(0.02)


# The embedded model's four tools (it was trained with these in its prompt), as OpenAI tool dicts.
TOOLS: list[dict[str, Any]] = [t.json_schema() for t in (add, multiply, get_weather, lookup_capital)]


def send_raw(base_url: str, body: dict) -> socket.socket:
    """POST a chat completion on a raw socket (the test closes it to disconnect)."""
    url = urlsplit(base_url)
    payload = json.dumps(body).encode()
    sock = socket.create_connection((url.hostname, url.port))
    head = (
        f"POST {url.path}/chat/completions HTTP/1.1\r\nHost: {url.hostname}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n"
    )
    sock.sendall(head.encode() + payload)
    return sock


def first_difference(model: Any, name: str) -> int:
    """The token where `name`'s call prefix (in `model`'s tool-call family) leaves the prefix of
    every other tool of TOOLS: biasing it makes the model choose `name`."""
    names = [t["function"]["name"] for t in TOOLS]

    def encode(n: str) -> list[int]:
        return model.tokenizer.encode(model.parser.call_prefix(n), add_special_tokens=False)

    mine, others = encode(name), [encode(n) for n in names if n != name]
    k = 0
    while any(o[: k + 1] == mine[: k + 1] for o in others):
        k += 1
    return mine[k]
