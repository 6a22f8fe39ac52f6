"""What the tests of saved anchors share: anchors of random prompts to save, and what loads back."""

from __future__ import annotations

from pathlib import Path

import torch

from freetoken_agents.engine import Anchor, Engine
from freetoken_agents.engine.anchors.persist import load_anchors


def anchors_of(engine: Engine, prompts: tuple[tuple[int, int], ...]) -> list[Anchor]:
    """One manual anchor at the end of each (length, seed) random prompt, each in its own session."""
    made = []
    for n, seed in prompts:
        ids = torch.randint(0, 480, (n,), generator=torch.Generator().manual_seed(seed)).tolist()
        with engine.new_session() as s:
            s.prefill(ids)
            made.append(s.anchor("manual"))
    return made


def loaded_ids(engine: Engine, folder: Path) -> set[str]:
    """The ids of the anchors `folder` holds (their KV released again)."""
    anchors, _ = load_anchors(engine.anchors.host, folder)
    for a in anchors:
        a.table.release()
    return {a.id for a in anchors}
