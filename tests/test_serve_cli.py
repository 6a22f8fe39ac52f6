"""`freetoken serve` as a user starts it: a real process on a free loopback port, ready when
GET /v1/models answers, requiring its API key, stopped cleanly by a signal."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys

import httpx
import pytest
from serve_harness import wait_until

from freetoken_agents.cli import main
from freetoken_agents.cli.serve import api_keys


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def answers(url: str, **kwargs) -> bool:
    try:
        httpx.get(url, timeout=5, **kwargs)
    except httpx.TransportError:
        return False
    return True


def test_freetoken_serve_starts_requires_its_key_answers_and_stops():
    port = free_port()
    env = {**os.environ, "FREETOKEN_API_KEY": "sesame"}  # the key from the environment, not argv
    cmd = [sys.executable, "-m", "freetoken_agents.cli", "--threads", "1", "serve", "--port", str(port)]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}/v1"
    try:
        wait_until(lambda: proc.poll() is not None or answers(f"{base}/models"), "the server to answer")
        assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
        assert httpx.get(f"{base}/models", timeout=30).status_code == 401
        auth = {"authorization": "Bearer sesame"}
        models = httpx.get(f"{base}/models", headers=auth, timeout=30).json()
        assert [m["id"] for m in models["data"]] == ["freetoken-tiny"]  # the embedded model by default
        body = {"model": "freetoken-tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
        reply = httpx.post(f"{base}/chat/completions", json=body, headers=auth, timeout=60)
        assert reply.status_code == 200 and reply.json()["choices"][0]["message"]["role"] == "assistant"
        assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=30).json()["queue"]["completed"] == 1
    finally:
        proc.send_signal(signal.SIGINT)
        output, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, output
    assert f"http://127.0.0.1:{port}" in output  # uvicorn says where it listens
    assert "Traceback" not in output and "Application shutdown complete" in output  # a clean stop


def test_a_bad_port_is_one_error_line(capsys):
    assert main(["serve", "--port", "70000"]) == 1
    err = capsys.readouterr().err.strip()
    assert err == "freetoken serve: error: --port must be in 0..65535, got 70000"


@pytest.mark.parametrize("flag", ["--fast-mem", "--host-mem"])
def test_engine_options_are_the_other_commands(flag, capsys):
    # The same engine arguments and errors as every command that loads a model.
    assert main(["serve", flag, "8 gigs"]) == 1
    assert f"{flag}: cannot read '8 gigs' as a size" in capsys.readouterr().err


def test_several_api_keys_one_per_tenant():
    assert api_keys(["team-a", "team-b"], "ignored") == ("team-a", "team-b")
    assert api_keys(None, " team-a, team-b ,") == ("team-a", "team-b")
    assert api_keys(None, None) is None and api_keys(None, "") is None


def test_an_empty_api_key_is_one_error_line(capsys):
    assert main(["serve", "--api-key", "", "--port", "0"]) == 1
    assert capsys.readouterr().err.strip() == "freetoken serve: error: --api-key must not be empty"


@pytest.mark.parametrize("value", [" , ", ",", "   ", " ,, , "])
def test_an_api_key_variable_with_no_key_is_one_error_line(value, monkeypatch, capsys):
    # Set but blank once split: refused like `--api-key ""`, never served without authentication.
    import freetoken_agents.integrations.openai_server as server

    served: list[object] = []
    monkeypatch.setattr(server, "serve", lambda app, **kwargs: served.append(app))  # never listen
    monkeypatch.setenv("FREETOKEN_API_KEY", value)
    assert main(["--threads", "1", "serve", "--port", "0"]) == 1
    err = capsys.readouterr().err.strip()
    assert err == (
        "freetoken serve: error: $FREETOKEN_API_KEY holds no key (only commas and blanks): set one, "
        "or unset it"
    )
    assert not served
