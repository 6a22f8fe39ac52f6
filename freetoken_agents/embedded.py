"""The embedded default model: a small Qwen3-MoE trained by `freetoken_agents.recipes.tiny.train`
and shipped inside the package as an FTW file, so `freetoken demo` runs without any download."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from freetoken_agents.engine import EngineError

DEFAULT_MODEL_FILE = "freetoken-tiny.ftw"


class EmbeddedModelMissing(EngineError):
    """The package was installed without its embedded model file (a broken or stripped install)."""


def default_model() -> Path:
    """Path of the embedded default model (an FTW file inside the installed package).

    Raises EmbeddedModelMissing when the file is not there."""
    path = Path(str(resources.files("freetoken_agents") / "data" / DEFAULT_MODEL_FILE))
    if not path.is_file():
        raise EmbeddedModelMissing(
            f"the embedded model {path} is missing: reinstall freetoken-agents, or pass --model "
            "with a Hugging Face checkpoint folder or an .ftw file"
        )
    return path


def is_default_model(source: str | Path | None) -> bool:
    """Whether `source` (a model's path) is the embedded model file."""
    if source is None:
        return False
    try:
        return Path(source).resolve() == default_model().resolve()
    except (EmbeddedModelMissing, OSError):
        return False
