"""The checkpoint a training run resumes from (`--save-every`, `--resume`): weights, tokenizer,
optimizer, scheduler, RNG state and the place in the batch order, replaced only once complete."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)


def save_progress(last: Path, model: Any, tokenizer: Any, opt: Any, sched: Any, progress: dict) -> None:
    """Write the checkpoint a run resumes from, replacing the previous one only once complete (a run
    killed while saving keeps the last whole checkpoint)."""
    tmp = last.with_name(last.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    state = {"optimizer": opt.state_dict(), "scheduler": sched.state_dict(), "rng": torch.get_rng_state()}
    torch.save({**state, **progress}, tmp / "progress.pt")
    old = last.with_name(last.name + ".old")
    shutil.rmtree(old, ignore_errors=True)
    if last.exists():
        last.rename(old)
    tmp.rename(last)
    shutil.rmtree(old, ignore_errors=True)


def load_progress(last: Path) -> dict | None:
    """The saved progress in `last` (finishing a save killed between its two renames); None when
    there is none: the run starts from the beginning."""
    if not (last / "progress.pt").is_file():
        old = last.with_name(last.name + ".old")  # killed between the two renames
        if not (old / "progress.pt").is_file():
            logger.info("no checkpoint in %s: starting from the beginning", last)
            return None
        old.rename(last)
    return torch.load(last / "progress.pt", weights_only=False)
