"""Hugging Face Hub ids (``org/name[@revision][:QUANT]``) at every entry point, with no network:
a local stand-in of the Hub's file API (`hub_server.HubServer`, set as HF_ENDPOINT) and caches it
populated through huggingface_hub itself.

- From the endpoint into an empty cache: only the files the engine reads are fetched, the model
  loads and equals the local folder's; ``@revision``; ``:QUANT`` picks one .gguf; a one-.ftw repo.
- Offline (HF_HUB_OFFLINE=1, the endpoint unreachable): a populated cache serves every entry point
  (Engine, FreeTokenModel, ChatFreeToken, `freetoken chat`, `freetoken generate` in a process that
  imports huggingface_hub with the variable set).
- Errors are one `ModelNotFoundError` line naming the id: missing repo or revision, gated,
  offline with nothing cached, the Hub unreachable.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from gguf_models import write_gguf
from hub_server import FakeRepo, HubServer, folder_files
from tiny_models import fresh_logits

from freetoken_agents import FreeTokenModel
from freetoken_agents.cli import main
from freetoken_agents.engine import (
    CheckpointError,
    Engine,
    HubId,
    ModelNotFoundError,
    TieringOptions,
    is_hub_id,
    parse_hub_id,
    resolve_model,
)
from freetoken_agents.engine.loading.convert import convert_checkpoint
from freetoken_agents.engine.loading.hub import SAFETENSORS_INDEX, HubSettings
from freetoken_agents.integrations.langchain import ChatFreeToken, clear_engines
from freetoken_agents.integrations.langchain.engines import engine_key

pytestmark = pytest.mark.usefixtures("one_thread")

HUB_VARS = (
    "HF_ENDPOINT",
    "HF_HUB_CACHE",
    "HUGGINGFACE_HUB_CACHE",
    "HF_HOME",
    "HF_HUB_OFFLINE",
    "TRANSFORMERS_OFFLINE",
)
UNREACHABLE = "http://127.0.0.1:9"  # the discard port: nothing listens, a request fails at once
DECOYS = {
    "original/consolidated.pth": b"\0" * 4096,
    "pytorch_model.bin": b"\1" * 4096,
    "README.md": b"# tiny\n",
}
ENGINE_FILES = {
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
}
IDS = [3, 17, 42, 5, 99, 8]


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint) -> Path:
    return tiny_checkpoint("mixtral")


@pytest.fixture(scope="module")
def reference(checkpoint) -> torch.Tensor:
    """Next-token logits of the folder loaded directly."""
    return fresh_logits(Engine.from_pretrained(checkpoint), IDS)


@pytest.fixture(scope="module")
def repos(checkpoint, tmp_path_factory) -> dict[str, FakeRepo]:
    files = folder_files(checkpoint)
    assert set(files) == ENGINE_FILES  # what save_pretrained writes; the decoys come on top
    tiny = FakeRepo()
    old = {**files, "generation_config.json": b'{"eos_token_id": 2, "_from": "v1"}'}
    v1 = tiny.add_commit(old, ref="v1")
    tiny.add_commit({**files, **DECOYS}, ref="main")
    tiny.refs["v1"] = v1
    ftw = tmp_path_factory.mktemp("hub-ftw") / "tiny.ftw"
    convert_checkpoint(checkpoint, ftw, quant="fp32", progress=False)
    one_ftw = FakeRepo()
    one_ftw.add_commit({"tiny.ftw": ftw.read_bytes(), "README.md": b"# tiny ftw\n"})
    gguf = FakeRepo()
    gguf.add_commit(
        {
            "tiny-Q4_K_M.gguf": b"GGUF-q4km",
            "tiny-Q4_K_S.gguf": b"GGUF-q4ks",
            "tiny-Q8_0.gguf": b"GGUF-q8",
            "split/tiny-Q2_K-00001-of-00002.gguf": b"GGUF-part1",
            "split/tiny-Q2_K-00002-of-00002.gguf": b"GGUF-part2",
            "README.md": b"# gguf\n",
        }
    )
    sharded = FakeRepo()
    sharded.add_commit(_sharded(files))
    real_gguf = FakeRepo()
    real_gguf.add_commit(
        {f"tiny-{q}.gguf": _gguf(q, tmp_path_factory).read_bytes() for q in ("Q8_0", "Q4_K")}
    )
    return {
        "org/tiny-real-gguf": real_gguf,
        "org/tiny": tiny,
        "org/tiny-sharded": sharded,
        "org/tiny-ftw": one_ftw,
        "org/tiny-gguf": gguf,
        "org/gated": FakeRepo(gated=True),
    }


def _gguf(expert_type: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real tiny GGUF (qwen3moe, experts in `expert_type`), written as llama.cpp writes one."""
    return write_gguf("qwen3_moe", tmp_path_factory.mktemp("gguf"), expert_type=expert_type).path


def _sharded(files: dict[str, bytes]) -> dict[str, bytes]:
    """The checkpoint's tensors in two shards with a safetensors index, plus a top-level
    `consolidated.safetensors` (all tensors again, as Mistral repos ship) that the index does not
    name: loading it too would give every tensor twice."""
    from safetensors.torch import load, save

    tensors = load(files["model.safetensors"])
    names = sorted(tensors)
    halves = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    out = {name: data for name, data in files.items() if name != "model.safetensors"}
    for shard, keys in halves.items():
        out[shard] = save({k: tensors[k] for k in keys}, metadata={"format": "pt"})
    weight_map = {k: shard for shard, keys in halves.items() for k in keys}
    out[SAFETENSORS_INDEX] = json.dumps({"metadata": {}, "weight_map": weight_map}).encode()
    out["consolidated.safetensors"] = files["model.safetensors"]
    return out


def _hub_env(mp: pytest.MonkeyPatch, *, endpoint: str, cache: Path, offline: bool) -> None:
    for name in HUB_VARS:
        mp.delenv(name, raising=False)
    mp.setenv("HF_ENDPOINT", endpoint)
    mp.setenv("HF_HUB_CACHE", str(cache))
    if offline:
        mp.setenv("HF_HUB_OFFLINE", "1")


@pytest.fixture
def hub(repos, tmp_path, monkeypatch) -> Iterator[HubServer]:
    """The fake Hub, with HF_ENDPOINT on it and an empty HF_HUB_CACHE in tmp_path."""
    with HubServer(repos) as server:
        _hub_env(monkeypatch, endpoint=server.endpoint, cache=tmp_path / "hub-cache", offline=False)
        yield server


@pytest.fixture(scope="module")
def offline_cache(repos, tmp_path_factory) -> Path:
    """A cache populated through huggingface_hub from the fake Hub (org/tiny at main and v1)."""
    cache = tmp_path_factory.mktemp("offline-hub-cache")
    with HubServer(repos) as server, pytest.MonkeyPatch.context() as mp:
        _hub_env(mp, endpoint=server.endpoint, cache=cache, offline=False)
        resolve_model("org/tiny", progress=False)
        resolve_model("org/tiny@v1", progress=False)
    return cache


@pytest.fixture
def offline(offline_cache, monkeypatch) -> Path:
    """HF_HUB_OFFLINE=1 over the populated cache; the endpoint is unreachable besides."""
    _hub_env(monkeypatch, endpoint=UNREACHABLE, cache=offline_cache, offline=True)
    return offline_cache


def _snapshot(cache: Path, repo_id: str) -> Path:
    storage = cache / f"models--{repo_id.replace('/', '--')}"
    return storage / "snapshots" / (storage / "refs" / "main").read_text().strip()


# ---- ids ------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("org/name", HubId("org/name")),
        ("Qwen/Qwen3-30B-A3B", HubId("Qwen/Qwen3-30B-A3B")),
        ("org/name@v1.0", HubId("org/name", "v1.0")),
        ("org/name@refs/pr/1", HubId("org/name", "refs/pr/1")),
        ("org/name:Q4_K_M", HubId("org/name", None, "Q4_K_M")),
        ("org/name@abc123:q8_0", HubId("org/name", "abc123", "q8_0")),
        ("name", None),
        ("/abs/org/name", None),
        ("./org/name", None),
        ("a/b/c", None),
        ("org/model.ftw", None),
        ("org/na--me", None),
        ("org/name@", None),
        ("org/name:", None),
    ],
)
def test_what_is_a_hub_id(text, expected):
    assert parse_hub_id(text) == expected
    if expected is not None:
        assert str(expected) == text


def test_settings_follow_huggingface_hubs_variables_when_called(tmp_path):
    settings = HubSettings.from_env({"HF_ENDPOINT": "http://mirror.local/", "HF_HOME": str(tmp_path)})
    assert settings.endpoint == "http://mirror.local" and settings.cache_dir == tmp_path / "hub"
    both = {"HF_HUB_CACHE": "/c1", "HUGGINGFACE_HUB_CACHE": "/c2", "HF_HOME": "/h"}
    assert HubSettings.from_env(both).cache_dir == Path("/c1")
    assert HubSettings.from_env({"HF_HUB_OFFLINE": "1"}).offline
    assert HubSettings.from_env({"TRANSFORMERS_OFFLINE": "yes"}).offline
    # huggingface_hub's rule: HF_HUB_OFFLINE, when set, decides alone
    assert not HubSettings.from_env({"HF_HUB_OFFLINE": "0", "TRANSFORMERS_OFFLINE": "1"}).offline


def test_a_local_path_wins_over_an_id_of_the_same_spelling(checkpoint, tmp_path, monkeypatch):
    _hub_env(monkeypatch, endpoint=UNREACHABLE, cache=tmp_path / "cache", offline=False)
    shutil.copytree(checkpoint, tmp_path / "org" / "tiny")
    monkeypatch.chdir(tmp_path)
    assert not is_hub_id("org/tiny")
    assert resolve_model("org/tiny", progress=False) == Path("org/tiny")  # no request was tried
    assert Engine.from_pretrained("org/tiny").source == Path("org/tiny")
    # what is neither a local path nor an id goes to the loader, whose error it keeps
    with pytest.raises(CheckpointError, match="does not exist") as info:
        Engine.from_pretrained(tmp_path / "missing")
    assert not isinstance(info.value, ModelNotFoundError)


# ---- from the Hub (the local endpoint) --------------------------------------------------------------
def test_an_id_downloads_only_what_the_engine_reads_and_equals_the_local_load(hub, reference, tmp_path):
    engine = Engine.from_pretrained("org/tiny")
    assert sorted(hub.downloads()) == sorted(ENGINE_FILES)  # not the .bin, .pth or README
    assert engine.source == _snapshot(tmp_path / "hub-cache", "org/tiny")
    torch.testing.assert_close(fresh_logits(engine, IDS), reference, rtol=0, atol=0)
    before = len(hub.downloads())
    assert resolve_model("org/tiny", progress=False) == engine.source
    assert len(hub.downloads()) == before  # cached: nothing fetched again


def test_a_sharded_checkpoint_fetches_the_shards_its_index_names(hub, reference):
    engine = Engine.from_pretrained("org/tiny-sharded")
    fetched = set(hub.downloads())
    assert "consolidated.safetensors" not in fetched and SAFETENSORS_INDEX in fetched
    assert {"model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"} <= fetched
    torch.testing.assert_close(fresh_logits(engine, IDS), reference, rtol=0, atol=0)


def test_a_revision_picks_its_commit(hub, repos):
    v1 = repos["org/tiny"].refs["v1"]
    folder = resolve_model("org/tiny@v1", progress=False)
    assert folder.name == v1 and b"v1" in (folder / "generation_config.json").read_bytes()
    assert resolve_model(f"org/tiny@{v1}", progress=False) == folder
    assert resolve_model("org/tiny", progress=False).name == repos["org/tiny"].refs["main"]


def test_a_repo_with_one_ftw_file_resolves_to_it(hub, reference):
    engine = Engine.from_pretrained("org/tiny-ftw")
    assert engine.source.name == "tiny.ftw" and hub.downloads() == ["tiny.ftw"]
    torch.testing.assert_close(fresh_logits(engine, IDS), reference, rtol=0, atol=0)


def test_a_quant_picks_the_one_gguf_file(hub):
    path = resolve_model("org/tiny-gguf:Q8_0", progress=False)
    assert path.name == "tiny-Q8_0.gguf" and path.read_bytes() == b"GGUF-q8"
    assert hub.downloads() == ["tiny-Q8_0.gguf"]
    assert resolve_model("org/tiny-gguf:q4_k_m", progress=False).name == "tiny-Q4_K_M.gguf"  # any case
    first = resolve_model("org/tiny-gguf:Q2_K", progress=False)  # a split GGUF: every part, the first
    assert (
        first.name == "tiny-Q2_K-00001-of-00002.gguf"
        and (first.parent / "tiny-Q2_K-00002-of-00002.gguf").is_file()
    )


@pytest.mark.parametrize(
    ("model", "words"),
    [
        ("org/tiny-gguf", ["GGUF files only", "org/tiny-gguf:QUANT", "Q4_K_M", "Q4_K_S", "Q8_0", "Q2_K"]),
        ("org/tiny-gguf:Q4_K", ["several files matching 'Q4_K'", "tiny-Q4_K_M.gguf", "tiny-Q4_K_S.gguf"]),
        ("org/tiny-gguf:Q5_K_M", ["no .gguf or .ftw file matching 'Q5_K_M'", "Q8_0"]),
    ],
)
def test_gguf_quant_errors_list_the_choices(hub, model, words):
    with pytest.raises(ModelNotFoundError) as info:
        resolve_model(model, progress=False)
    _one_line_naming(info.value, model, *words)
    assert hub.downloads() == []


@pytest.mark.parametrize(
    ("model", "words"),
    [
        ("org/missing", ["was not found on http://127.0.0.1:", "check the id", "hf auth login"]),
        ("org/tiny@no-such-branch", ["has no revision 'no-such-branch'", "@revision"]),
        ("org/gated", ["is gated", "hf auth login"]),
    ],
)
def test_hub_errors_are_one_line_naming_the_id_and_what_to_do(hub, model, words):
    with pytest.raises(ModelNotFoundError) as info:
        Engine.from_pretrained(model)
    _one_line_naming(info.value, model, *words)
    assert info.value.model_id == model and info.value.__cause__ is None and info.value.__suppress_context__


def test_an_unreachable_hub_falls_back_to_the_cache(offline_cache, tmp_path, monkeypatch):
    _hub_env(monkeypatch, endpoint=UNREACHABLE, cache=offline_cache, offline=False)
    assert resolve_model("org/tiny", progress=False) == _snapshot(offline_cache, "org/tiny")
    _hub_env(monkeypatch, endpoint=UNREACHABLE, cache=tmp_path / "empty", offline=False)
    with pytest.raises(ModelNotFoundError) as info:
        resolve_model("org/tiny", progress=False)
    _one_line_naming(
        info.value, "org/tiny", "cannot reach http://127.0.0.1:9", "check the network connection"
    )


def test_progress_off_is_silent(hub, capfd):
    resolve_model("org/tiny", progress=False)
    captured = capfd.readouterr()
    assert captured.err == "" and captured.out == ""


def test_a_tiered_load_of_an_id_reuses_its_cached_conversion(hub, reference, monkeypatch, tmp_path):
    """The FTW conversion cache keys on the snapshot folder (stable per commit) and its content."""
    monkeypatch.setenv("FREETOKEN_CACHE", str(tmp_path / "ftw-cache"))
    tiering = TieringOptions(prefetch_thread=False)
    for _ in range(2):
        with Engine.from_pretrained("org/tiny", placement="qstar", tiering=tiering, progress=False) as engine:
            torch.testing.assert_close(fresh_logits(engine, IDS), reference, rtol=1e-5, atol=1e-5)
    [entry] = (tmp_path / "ftw-cache").rglob("*.ftw")
    assert entry.name.startswith("org--tiny-")  # named after the repo, not the snapshot's commit


def test_freetoken_chat_with_an_id(hub, monkeypatch, capsys):
    monkeypatch.setattr(sys, "stdin", io.StringIO("Hi\n/quit\n"))
    assert main(["chat", "--model", "org/tiny", "--max-new-tokens", "4", "--no-progress"]) == 0
    assert capsys.readouterr().out.count("assistant> ") == 1
    assert "model.safetensors" in hub.downloads()


def test_freetoken_serve_reports_the_id(hub, monkeypatch):
    from fastapi.testclient import TestClient

    import freetoken_agents.integrations.openai_server as openai_server

    apps = []
    monkeypatch.setattr(openai_server, "serve", lambda app, **kwargs: apps.append(app))
    assert main(["serve", "--model", "org/tiny@v1", "--port", "0"]) == 0
    with TestClient(apps[0]) as client:
        models = client.get("/v1/models").json()
        assert [card["id"] for card in models["data"]] == ["org/tiny@v1"]
        reply = client.post(
            "/v1/chat/completions",
            json={"model": "org/tiny@v1", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2},
        )
        assert reply.status_code == 200, reply.text


def test_a_missing_id_is_one_cli_error_line(hub, capsys):
    assert main(["generate", "org/missing", "--prompt", "hi"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("freetoken generate: error: Hugging Face model 'org/missing' was not found")
    assert "\n" not in err and "Traceback" not in err


# ---- offline, from the cache -------------------------------------------------------------------------
def test_offline_an_id_loads_from_the_cache(offline, reference):
    engine = Engine.from_pretrained("org/tiny")
    assert engine.source == _snapshot(offline, "org/tiny")
    torch.testing.assert_close(fresh_logits(engine, IDS), reference, rtol=0, atol=0)
    assert resolve_model("org/tiny@v1", progress=False).name != engine.source.name


def test_offline_with_nothing_cached_is_one_line(offline):
    with pytest.raises(ModelNotFoundError) as info:
        Engine.from_pretrained("org/never-downloaded")
    _one_line_naming(info.value, "org/never-downloaded", "HF_HUB_OFFLINE=1", "unset HF_HUB_OFFLINE")


def test_offline_freetoken_chat(offline, monkeypatch, capsys):
    monkeypatch.setattr(sys, "stdin", io.StringIO("Hi\n/quit\n"))
    assert main(["chat", "--model", "org/tiny", "--max-new-tokens", "4", "--no-progress"]) == 0
    assert capsys.readouterr().out.count("assistant> ") == 1


def test_offline_freetoken_generate_in_a_process_with_hf_hub_offline_set(offline):
    """huggingface_hub reads HF_HUB_OFFLINE at import: a fresh process has it set from the start."""
    env = {k: v for k, v in os.environ.items() if k not in HUB_VARS}
    env.update(HF_HUB_OFFLINE="1", HF_HUB_CACHE=str(offline), HF_ENDPOINT=UNREACHABLE)

    def generate(model: str) -> subprocess.CompletedProcess:
        cmd = [sys.executable, "-m", "freetoken_agents.cli", "--threads", "1", "generate", model]
        cmd += ["--prompt", "hello", "--max-new-tokens", "3", "--no-progress"]
        return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)

    done = generate("org/tiny")
    assert done.returncode == 0, done.stderr
    missing = generate("org/never-downloaded")
    assert missing.returncode == 1
    assert missing.stderr.strip().startswith(
        "freetoken generate: error: Hugging Face model 'org/never-downloaded'"
    )
    assert "HF_HUB_OFFLINE" in missing.stderr and "Traceback" not in missing.stderr


def test_offline_free_token_model_from_an_id(offline, reference):
    with FreeTokenModel.from_pretrained("org/tiny") as model:
        assert model.engine.source == _snapshot(offline, "org/tiny")
        torch.testing.assert_close(fresh_logits(model.engine, IDS), reference, rtol=0, atol=0)


def test_offline_chat_free_token_from_an_id(offline):
    clear_engines()
    try:
        llm = ChatFreeToken(model="org/tiny", max_tokens=4)
        assert engine_key("org/tiny", llm.engine_options())[0] == "org/tiny"  # an id stays an id
        reply = llm.invoke("Hi")
        assert isinstance(reply.content, str) and reply.usage_metadata["output_tokens"] >= 1
    finally:
        clear_engines()


def _one_line_naming(error: BaseException, model: str, *words: str) -> None:
    text = str(error)
    assert "\n" not in text, text
    assert f"'{model}'" in text, text
    for word in words:
        assert word in text, text


def test_a_gguf_quant_from_the_hub_loads_as_the_local_file(hub, repos, monkeypatch, tmp_path):
    monkeypatch.setenv("FREETOKEN_CACHE", str(tmp_path / "ftw-cache"))
    local = tmp_path / "local.gguf"
    repo = repos["org/tiny-real-gguf"]
    local.write_bytes(repo.commits[repo.refs["main"]]["tiny-Q4_K.gguf"])
    expected = fresh_logits(Engine.from_pretrained(local, progress=False), IDS)
    engine = Engine.from_pretrained("org/tiny-real-gguf:q4_k", progress=False)
    torch.testing.assert_close(fresh_logits(engine, IDS), expected, rtol=0, atol=0)
    assert hub.downloads() == ["tiny-Q4_K.gguf"]


def test_freetoken_chat_with_a_gguf_quant_id(hub, monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("FREETOKEN_CACHE", str(tmp_path / "ftw-cache"))
    monkeypatch.setattr(sys, "stdin", io.StringIO("Hi\n/quit\n"))
    args = ["chat", "--model", "org/tiny-real-gguf:Q8_0", "--max-new-tokens", "4", "--no-progress"]
    assert main(args) == 0
    assert capsys.readouterr().out.count("assistant> ") == 1
    assert hub.downloads() == ["tiny-Q8_0.gguf"]


def test_freetoken_convert_an_id(hub, reference, tmp_path, capsys):
    out = tmp_path / "tiny.ftw"
    assert main(["convert", "org/tiny", str(out), "--quant", "fp32", "--no-progress"]) == 0
    assert str(out) in capsys.readouterr().out
    torch.testing.assert_close(
        fresh_logits(Engine.from_pretrained(out), IDS), reference, rtol=1e-5, atol=1e-5
    )
