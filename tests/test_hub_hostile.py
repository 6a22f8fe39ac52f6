"""A hostile Hub mirror (HF_ENDPOINT) or a hostile id cannot make a fetch write outside the cache.

huggingface_hub names cache files after what the server answers (``blobs/<ETag>``,
``snapshots/<X-Repo-Commit>``, ``trees/<model info sha>.json``) and after the revision the id spells
(``refs/<revision>``). Each test runs the attack for real over 127.0.0.1 (`hub_server.HubServer`)
with the cache in tmp_path, and checks the one-line `ModelNotFoundError` and that nothing at all was
written outside the cache folder (tmp_path holds only the cache).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from pathlib import Path

import pytest
from hub_server import FakeRepo, HubServer

from freetoken_agents.cli import main
from freetoken_agents.engine import ModelNotFoundError, resolve_model

GGUF = b"GGUF" + b"\0" * 60
FILES = {
    "gguf": {"tiny-Q8_0.gguf": GGUF, "README.md": b"# tiny\n"},
    "folder": {"config.json": b"{}", "model.safetensors": b"\0" * 16, "tokenizer.json": b"{}"},
    "ftw": {"tiny.ftw": b"FTW0" + b"\0" * 12},
}
IDS = {"gguf": "org/gguf:Q8_0", "folder": "org/folder", "ftw": "org/ftw"}
TRAVERSAL = "../../../outside/PWNED"
HUB_VARS = ("HF_ENDPOINT", "HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME", "HF_HUB_OFFLINE")


def _repos() -> dict[str, FakeRepo]:
    repos = {}
    for kind, files in FILES.items():
        repo = FakeRepo()
        repo.add_commit(files)
        repos[f"org/{kind}"] = repo
    return repos


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    for name in HUB_VARS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.chdir(tmp_path)  # a relative traversal from the working folder lands in tmp_path too
    cache = tmp_path / "cache"
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    return cache


@pytest.fixture
def hub(cache, monkeypatch) -> Iterator[HubServer]:
    with HubServer(_repos()) as server:
        monkeypatch.setenv("HF_ENDPOINT", server.endpoint)
        yield server


def _outside(cache: Path) -> list[str]:
    """Every path under the cache's parent folder that is not the cache or inside it."""
    return sorted(str(p) for p in cache.parent.rglob("*") if p != cache and cache not in p.parents)


def _refused(model: str, *words: str) -> str:
    with pytest.raises(ModelNotFoundError) as info:
        resolve_model(model, progress=False)
    text = str(info.value)
    assert "\n" not in text and f"'{model}'" in text, text
    for word in words:
        assert word in text, text
    return text


@pytest.mark.parametrize("kind", sorted(FILES))
@pytest.mark.parametrize(
    ("header", "value", "word"),
    [
        ("ETag", f'"{TRAVERSAL}"', "ETag"),
        ("X-Linked-Etag", f'"{TRAVERSAL}"', "ETag"),
        ("ETag", '"not-a-digest"', "ETag"),
        ("X-Repo-Commit", "../../../outside", "commit"),
    ],
)
def test_a_mirror_answering_a_path_as_a_file_name_is_refused(hub, cache, kind, header, value, word):
    hub.resolve_headers = {header: value}
    _refused(IDS[kind], "refused", word, hub.endpoint)
    assert _outside(cache) == []
    assert not list(cache.rglob("*PWNED*"))


def test_the_etag_checked_is_the_one_that_names_the_blob(hub, cache):
    """Only the first /resolve/ answer (the download's own HEAD) is honest: the GET's hostile ETag
    names nothing, so the file is fetched, into the cache, under the honest name."""
    hub.resolve_headers, hub.hostile_from = {"ETag": f'"{TRAVERSAL}"'}, 1
    path = resolve_model(IDS["gguf"], progress=False)
    assert path.read_bytes() == GGUF
    assert cache in path.resolve().parents and cache in path.parents
    assert (path.parents[2] / "blobs" / hashlib.sha256(GGUF).hexdigest()).is_file()
    assert _outside(cache) == []


def test_an_honest_mirror_into_a_linked_cache_folder_is_served(hub, cache, tmp_path, monkeypatch):
    """The checks hold the resolved paths huggingface_hub returns against the resolved cache."""
    cache.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "link"))
    (tmp_path / "link").symlink_to(cache, target_is_directory=True)
    folder = resolve_model(IDS["folder"], progress=False)
    assert sorted(p.name for p in folder.iterdir()) == sorted(FILES["folder"])
    assert resolve_model(IDS["gguf"], progress=False).read_bytes() == GGUF
    assert cache in folder.parents


def test_a_mirror_honest_at_first_is_still_refused_when_it_turns(hub, cache):
    """The first /resolve/ answer is honest, every later one hostile: a check made by a request of
    its own before the download would pass, then the download's own HEAD would name the blob."""
    hub.resolve_headers, hub.hostile_from = {"ETag": f'"{TRAVERSAL}"'}, 1
    _refused(IDS["folder"], "refused", "ETag")
    assert _outside(cache) == []


@pytest.mark.parametrize("kind", sorted(FILES))
def test_a_mirror_naming_a_path_as_the_commit_is_refused(hub, cache, kind):
    hub.repos[f"org/{kind}"].info_sha = "../../../outside"
    _refused(IDS[kind], "refused", "commit")
    assert _outside(cache) == []


@pytest.mark.parametrize(
    "revision",
    ["../../../outside/x", "main/../../../../outside", "/tmp/outside", "..\\..\\outside", "a//b", "./a"],
)
def test_a_revision_that_is_a_path_is_refused_before_any_request(hub, cache, revision):
    for repo in hub.repos.values():  # the mirror would serve it
        repo.refs[revision] = repo.refs["main"]
    model = f"org/gguf@{revision}:Q8_0"
    _refused(model, "revision")
    assert hub.requests == []
    assert _outside(cache) == []


def test_a_listed_file_name_that_is_a_path_is_refused(hub, cache):
    hub.repos["org/gguf"].add_commit({"../../outside/evil-Q8_0.gguf": GGUF})
    _refused(IDS["gguf"], "file name")
    assert _outside(cache) == []


def test_offline_a_cached_ref_naming_a_path_is_not_followed(cache, tmp_path, monkeypatch):
    storage = cache / "models--org--gguf"
    (storage / "refs").mkdir(parents=True)
    (storage / "snapshots").mkdir()  # so that snapshots/../../../outside exists
    (storage / "refs" / "main").write_text("../../../outside")
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "x-Q8_0.gguf").write_bytes(GGUF)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    _refused(IDS["gguf"], "not in the cache")


def test_freetoken_convert_from_a_hostile_mirror_is_one_line_and_writes_nothing_outside(hub, cache, capsys):
    hub.resolve_headers = {"ETag": f'"{TRAVERSAL}"'}
    out = cache.parent / "out.ftw"  # outside the cache: must not be written either
    assert main(["convert", IDS["gguf"], str(out), "--quant", "source", "--no-progress"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("freetoken convert: error: Hugging Face model 'org/gguf:Q8_0' was refused"), err
    assert "\n" not in err and "Traceback" not in err
    assert _outside(cache) == []


@pytest.mark.parametrize(
    ("index", "words"),
    [
        (b"{not json", ("unreadable",)),
        (b"\xff\xfe", ("unreadable",)),
        (b'{"weight_map": {"w": ["model.safetensors"]}}', ("weight_map",)),
        (b'{"weight_map": ["model.safetensors"]}', ("weight_map",)),
        (b"[]", ("weight_map",)),
        (b'{"weight_map": {"w": "../../../outside/x.safetensors"}}', ("incomplete", "lacks")),
    ],
)
def test_a_bad_safetensors_index_is_one_line(hub, cache, index, words):
    hub.repos["org/folder"].add_commit({**FILES["folder"], "model.safetensors.index.json": index})
    _refused(IDS["folder"], "model.safetensors.index.json", *words)
    assert _outside(cache) == []
