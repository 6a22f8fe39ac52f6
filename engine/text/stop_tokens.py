"""Which token ids end a turn: every end-of-sequence id the checkpoint declares.

A checkpoint names them in up to three places, and real ones disagree: Qwen3's config.json says
`<|im_end|>` while its generation_config.json lists `<|im_end|>` and `<|endoftext|>`; gpt-oss's
generation_config.json adds `<|call|>` and `<|return|>`. `transformers`' `generate` stops at every
id of generation_config.json's `eos_token_id`, so a model that emits any of them must stop here too
(else it runs on to the length limit). The order is config.json's, then generation_config.json's,
then the tokenizer's: the first id is the one appended to close a turn the engine ends itself.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import CheckpointError

if TYPE_CHECKING:
    from ..ftw.reader import FTWFile

logger = logging.getLogger(__name__)

GENERATION_CONFIG = "generation_config.json"


def stop_token_ids(hf_config: Any, tokenizer: Any | None, generation_eos: Any = None) -> tuple[int, ...]:
    """config.json's eos ids, then generation_config.json's (`generation_eos`, as
    `read_generation_eos` found it), then the tokenizer's, each once."""
    ids: list[int] = []
    for eos in (
        getattr(hf_config, "eos_token_id", None),
        generation_eos,
        getattr(tokenizer, "eos_token_id", None) if tokenizer is not None else None,
    ):
        for token in _as_ids(eos):
            if token not in ids:
                ids.append(token)
    return tuple(ids)


def _as_ids(eos: Any) -> list[int]:
    if eos is None:
        return []
    return [int(t) for t in eos] if isinstance(eos, (list, tuple)) else [int(eos)]


def read_generation_eos(source: Path, ftw: FTWFile | None = None) -> int | list[int] | None:
    """generation_config.json's eos_token_id: the one `ftw` (the engine's open FTW file) embeds, else
    the `source` folder's; None when there is no such file or field. CheckpointError for a file
    that is not JSON or whose eos_token_id is not an int or a list of ints."""
    if ftw is not None:
        data = ftw.tokenizer_files.get(GENERATION_CONFIG)
        text = data.decode("utf-8") if data is not None else None
    else:
        path = source / GENERATION_CONFIG
        text = path.read_text(encoding="utf-8") if source.is_dir() and path.is_file() else None
    if text is None:
        return None
    try:
        config = json.loads(text)
    except ValueError as e:
        raise CheckpointError(f"{source}: {GENERATION_CONFIG} is not valid JSON: {e}") from None
    eos = config.get("eos_token_id") if isinstance(config, dict) else None
    valid = eos is None or (type(eos) is int) or (isinstance(eos, list) and all(type(t) is int for t in eos))
    if not valid:
        raise CheckpointError(f"{source}: {GENERATION_CONFIG} eos_token_id must be an int or a list of ints")
    return eos
