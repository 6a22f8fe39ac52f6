"""Real chat templates for tests, from the llama.cpp sources on the package index (the
`llama-cpp-python` sdist holds `vendor/llama.cpp/models/templates/*.jinja`). Fetched once into a
per-user cache, never vendored; a test that needs one is skipped, with the reason, when the index
cannot be reached."""

from __future__ import annotations

import io
import json
import tarfile
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import platformdirs
import pytest

PACKAGE = "llama-cpp-python"
VERSION = "0.3.36"
INDEX = f"https://pypi.org/pypi/{PACKAGE}/json"
CACHE = Path(platformdirs.user_cache_dir("freetoken-tests")) / f"llama.cpp-templates-{VERSION}"
VOCABS = ("ggml-vocab-qwen2.gguf", "ggml-vocab-deepseek-llm.gguf", "ggml-vocab-llama-spm.gguf")
"""The sdist's real tokenizer vocabularies kept beside the templates (`real_tokenizers.py`)."""


def model_with_template(name: str, family: str | None = None) -> Any:
    """A FreeTokenModel over the embedded model's weights whose tokenizer renders with the real
    template `name` (its own engine and tokenizer object; the tool-call family guessed from the
    template unless `family` names one)."""
    from serve_harness import shared_engine

    from freetoken_agents import FreeTokenModel
    from freetoken_agents.engine import Engine

    engine = Engine.from_pretrained(shared_engine().source)
    engine.tokenizer.chat_template = real_template(name)
    return FreeTokenModel(engine, family=family)


def real_template(name: str) -> str:
    """The text of `models/templates/{name}.jinja` (skips the test when it cannot be fetched)."""
    path = CACHE / f"{name}.jinja"
    if not path.is_file():
        _fetch()
    if not path.is_file():
        pytest.skip(f"{name}.jinja is not in {PACKAGE} {VERSION}")
    return path.read_text(encoding="utf-8")


def real_vocab(name: str) -> Path:
    """The path of the sdist's `models/{name}` vocabulary GGUF (skips the test when unavailable)."""
    path = CACHE / name
    if not path.is_file():
        _fetch()
    if not path.is_file():
        pytest.skip(f"{name} is not in {PACKAGE} {VERSION}")
    return path


def _fetch() -> None:
    try:
        meta = json.load(urllib.request.urlopen(INDEX, timeout=30))
        files = meta.get("releases", {}).get(VERSION) or []
        sdist = next(u for u in files if u["packagetype"] == "sdist")
        data = urllib.request.urlopen(urllib.parse.urljoin(INDEX, sdist["url"]), timeout=300).read()
    except (OSError, ValueError, StopIteration, KeyError) as e:
        pytest.skip(f"real chat templates need {PACKAGE} {VERSION} from the package index: {e}")
    CACHE.mkdir(parents=True, exist_ok=True)
    with tarfile.open(fileobj=io.BytesIO(data)) as archive:
        for member in archive.getmembers():
            name = Path(member.name).name
            wanted = name.endswith(".jinja") and "/models/templates/" in member.name
            if member.isfile() and (wanted or name in VOCABS):
                text = archive.extractfile(member).read()  # type: ignore[union-attr]
                (CACHE / name).write_bytes(text)
