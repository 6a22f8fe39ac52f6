"""Half-open connections (a request head that never finishes) are closed by the server, and a
normal client is served while several are open."""

from __future__ import annotations

import socket
import threading

import httpx
import pytest
import uvicorn
from serve_harness import MODEL, shared_engine, wait_until

from freetoken_agents.integrations.openai_server import ServerConfig, create_app, server_config

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def port():
    app = create_app(shared_engine(), ServerConfig(model_name=MODEL))
    server = uvicorn.Server(server_config(app, port=0, log_level="warning", header_timeout=1.0))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    wait_until(lambda: server.started or not thread.is_alive(), "the server to start")
    yield server.servers[0].sockets[0].getsockname()[1]
    server.should_exit = True
    thread.join(timeout=60)


def closed_by_server(sock: socket.socket) -> bool:
    """True once the server closed `sock` (recv returns EOF); the generous timeout only keeps a
    broken server from hanging the test."""
    sock.settimeout(60)
    try:
        return sock.recv(1024) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def test_a_stalled_request_head_is_closed_and_others_are_served(port):
    stalled = [socket.create_connection(("127.0.0.1", port)) for _ in range(8)]
    for sock in stalled:
        sock.sendall(b"POST /v1/chat/com")
    r = httpx.get(f"http://127.0.0.1:{port}/health", timeout=60)
    assert r.status_code == 200
    assert all(closed_by_server(sock) for sock in stalled)
    for sock in stalled:
        sock.close()
