"""Hugging Face Hub ids (``org/name[@revision][:QUANT]``) and the settings a fetch reads.

`parse_hub_id` says whether a string spells an id (without looking at the file system),
`is_hub_id` whether `hub.resolve_model` would fetch it, `HubSettings` what huggingface_hub's
environment variables say now. See `hub` for the resolution itself.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

LOCAL_SUFFIXES = (".ftw", ".gguf")
"""A name ending so is a weights file on disk, never a Hub id."""

_HUB_ID = re.compile(r"(?P<repo>[^/@:]+/[^/@:]+)(?:@(?P<revision>[^@:]+))?(?::(?P<quant>[^/@:]+))?")


@dataclass(frozen=True)
class HubId:
    """A parsed Hub id: ``repo_id`` ("org/name"), ``revision`` (None: the default branch) and
    ``quant`` (the GGUF/FTW file selector after ':', or None)."""

    repo_id: str
    revision: str | None = None
    quant: str | None = None

    def __str__(self) -> str:
        text = self.repo_id
        if self.revision is not None:
            text += f"@{self.revision}"
        if self.quant is not None:
            text += f":{self.quant}"
        return text


@dataclass(frozen=True)
class HubSettings:
    """Where the Hub is and what may be fetched, read from the environment when asked
    (`from_env`): endpoint URL, cache folder, and whether the network may be used."""

    endpoint: str
    cache_dir: Path
    offline: bool

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> HubSettings:
        """The settings huggingface_hub documents, read now from `environ` (default os.environ);
        a variable that is unset falls back to huggingface_hub's own value."""
        from huggingface_hub import constants

        env = os.environ if environ is None else environ
        endpoint = (env.get("HF_ENDPOINT") or "").rstrip("/") or constants.ENDPOINT
        cache = env.get("HF_HUB_CACHE") or env.get("HUGGINGFACE_HUB_CACHE")
        if not cache and env.get("HF_HOME"):
            cache = os.path.join(env["HF_HOME"], "hub")
        cache_dir = Path(os.path.expandvars(os.path.expanduser(cache or constants.HF_HUB_CACHE)))
        if "HF_HUB_OFFLINE" in env or "TRANSFORMERS_OFFLINE" in env:  # huggingface_hub's rule, now
            flag = env.get("HF_HUB_OFFLINE") or env.get("TRANSFORMERS_OFFLINE") or ""
            offline = flag.upper() in constants.ENV_VARS_TRUE_VALUES
        else:
            offline = constants.HF_HUB_OFFLINE
        return cls(endpoint=endpoint, cache_dir=cache_dir, offline=offline)


def parse_hub_id(text: str | os.PathLike[str]) -> HubId | None:
    """The Hub id `text` spells (``org/name[@revision][:QUANT]``), or None when it is not one
    (huggingface_hub's `validate_repo_id` decides what a repo id is; a name ending in a local
    weights suffix is not one). Does not look at the file system."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    match = _HUB_ID.fullmatch(os.fspath(text))
    if match is None:
        return None
    repo_id = match["repo"]
    if repo_id.lower().endswith(LOCAL_SUFFIXES):
        return None
    try:
        validate_repo_id(repo_id)
    except HFValidationError:
        return None
    return HubId(repo_id, match["revision"], match["quant"])


def is_hub_id(path_or_id: str | os.PathLike[str]) -> bool:
    """Whether `resolve_model` would fetch `path_or_id` from the Hub: it spells a Hub id and
    names no existing local path. Front ends use it to name the model (an id reports as itself)."""
    return not Path(path_or_id).expanduser().exists() and parse_hub_id(path_or_id) is not None
