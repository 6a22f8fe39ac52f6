"""Half-open connections (a request head that never finishes, or a body that stalls) are closed by
the server, and a normal client is served while several are open."""

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
    app = create_app(shared_engine(), ServerConfig(model_name=MODEL, body_idle_s=1.0, body_timeout_s=3.0))
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


def answer_of(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes `sock` (the timeout only guards a hang)."""
    sock.settimeout(60)
    data = b""
    try:
        while chunk := sock.recv(4096):
            data += chunk
    except (TimeoutError, ConnectionResetError):
        pass
    return data


@pytest.mark.parametrize("drip", [False, True], ids=["stalled", "dripping"])
def test_a_stalled_or_dripping_body_gets_a_408_and_its_connection_closed(port, drip):
    # The old server waited for the rest of the body forever, holding the connection and its handler.
    sock = socket.create_connection(("127.0.0.1", port))
    head = (
        "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        "Content-Length: 1000\r\n\r\n"
    )
    sock.sendall(head.encode() + b'{"model": ')
    done = threading.Event()

    def dripper() -> None:  # a byte well within the idle limit, never the whole body in time
        while drip and not done.wait(0.2):
            try:
                sock.sendall(b" ")
            except OSError:
                return

    thread = threading.Thread(target=dripper, daemon=True)
    thread.start()
    try:
        answer = answer_of(sock)
    finally:
        done.set()
        thread.join()
        sock.close()
    status, _, rest = answer.partition(b"\r\n")
    assert status.startswith(b"HTTP/1.1 408"), answer[:300]
    assert b"request_timeout" in rest and b"did not arrive in time" in rest
    assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=60).status_code == 200
