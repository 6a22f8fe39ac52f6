"""What the subcommands share: the CLI's error type, stdout writing and prefill with a progress
bar (long prompts are prefilled in chunks, with a tqdm bar on stderr)."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

PREFILL_CHUNK = 512
"""Tokens per prefill chunk; prompts longer than this get a progress bar."""


class CLIError(Exception):
    """A user-facing command-line error (bad arguments, missing files, an unknown bench script).
    `main()` prints it as one line and returns exit code 1."""


def write(text: str) -> None:
    """CLI output: stdout, flushed at once (streamed tokens show as they come)."""
    sys.stdout.write(text)
    sys.stdout.flush()


def model_label(model: str | None, path: Path) -> str:
    """How a command names its model: a Hugging Face Hub id as given (``org/name[@revision]``),
    else the file or folder name of `path` (what `model` resolved to locally)."""
    from ..engine import is_hub_id

    return model if model is not None and is_hub_id(model) else path.name


def show_progress(no_progress: bool = False) -> bool:
    """Progress bars only on a terminal (and not with --no-progress)."""
    return not no_progress and sys.stderr.isatty()


def _bar(total: int, progress: bool) -> Any:
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="prefill", unit="tok", file=sys.stderr, leave=False, disable=not progress)


def prefill_session(
    session: Any, ids: Sequence[int], *, chunk: int = PREFILL_CHUNK, progress: bool = True
) -> None:
    """Prefill `ids` into an engine Session in chunks of `chunk` tokens, with a bar when there is
    more than one chunk. Same result as one `session.prefill(ids)`, up to float rounding."""
    ids = list(ids)
    with _bar(len(ids), progress and len(ids) > chunk) as bar:
        for start in range(0, len(ids), chunk):
            session.prefill(ids[start : start + chunk], last_only=True)
            bar.update(len(ids[start : start + chunk]))


def sync_with_progress(
    model: Any, ids: Sequence[int], *, chunk: int = PREFILL_CHUNK, progress: bool = True
) -> None:
    """`model.sync(ids)` (FreeTokenModel: keep the common prefix, prefill the rest), the new
    tokens in chunks of `chunk` with a bar when there are more than `chunk` of them."""
    ids, current = list(ids), model.token_ids
    keep = 0
    for a, b in zip(current, ids, strict=False):
        if a != b:
            break
        keep += 1
    new = len(ids) - keep
    if new <= chunk:
        model.sync(ids)
        return
    with _bar(new, progress) as bar:
        done = keep
        for stop in range(keep + chunk, len(ids) + chunk, chunk):
            stop = min(stop, len(ids))
            model.sync(ids[:stop])
            bar.update(stop - done)
            done = stop
