"""The tools a model was trained to call, as its file says: relevant calls leave the decision on
them to the model (`relevance.py`; FreeTokenModel.trained_tools)."""

from __future__ import annotations

from pathlib import Path


def trained_tools(source: str | Path | None) -> frozenset[str]:
    """The tools a model file says it was trained to call (an FTW file's metadata
    "trained_tools", which `recipes/tiny/train.py` writes); none for any other source."""
    if source is None or Path(source).suffix != ".ftw" or not Path(source).is_file():
        return frozenset()
    from freetoken_agents.engine.ftw import FTWFile

    with FTWFile(source) as f:
        names = f.metadata.get("trained_tools")
    return frozenset(n for n in names if isinstance(n, str)) if isinstance(names, list) else frozenset()
