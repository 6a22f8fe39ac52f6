"""Hugging Face Hub ids as model paths: `resolve_model("org/name[@revision][:QUANT]")` -> local path.

Every entry point that loads a model (`Engine.from_options`, and through it FreeTokenModel,
ChatFreeToken, the CLI and the server) accepts, besides a checkpoint folder or an FTW file, a Hub
id. It is resolved here, once, to files in the huggingface_hub cache:

- A string or path that names an existing local path stays local: a local folder always wins
  over an id of the same spelling. A name ending in a weights-file suffix (``.ftw``, ``.gguf``) is
  a local path too (a missing one keeps the loader's own error).
- ``org/name`` (validated by `huggingface_hub.utils.validate_repo_id`), optionally ``@revision``
  (a branch, tag or commit) and ``:QUANT``.
- A repo with ``*.safetensors``: only the files the engine reads are fetched (`WEIGHT_FILES`,
  `TOKENIZER_FILES`: config, generation config, the shards the safetensors index names, the
  tokenizer and chat template), never the other formats a repo may also hold (``*.bin``,
  ``original/``, ``consolidated.*``). The result is the snapshot folder, which is stable per
  commit (so the FTW conversion cache, keyed on folder path and content, reuses its entries).
- A repo with no safetensors but one ``.ftw`` file: that file.
- ``:QUANT`` picks the one ``.gguf`` (or ``.ftw``) file whose name contains QUANT, case-insensitive
  (llama.cpp's ``-hf org/name:Q4_K_M``); the parts of a split GGUF are fetched together and the
  first is returned. A repo with only GGUF files needs ``:QUANT``; the error lists them.

Settings are read when called, with the environment variables huggingface_hub documents:
``HF_ENDPOINT``, ``HF_HUB_CACHE`` (else ``HUGGINGFACE_HUB_CACHE``, else ``$HF_HOME/hub``),
``HF_HUB_OFFLINE`` (or ``TRANSFORMERS_OFFLINE``), so a process that changes them after import gets
what it set; where one is unset, huggingface_hub's own value (`huggingface_hub.constants`) holds.
Offline, or when the Hub cannot be reached, what the cache holds is used without any request.
Authentication is huggingface_hub's (``HF_TOKEN``, ``hf auth login``).

Nothing is written outside the cache, whatever the id or the server (`hub_safety`): a revision
that is a path (``..``, absolute, a backslash) is refused before any request, the commit the Hub
names must be 40 hex digits and pins every download, the server's ETag and commit headers are
checked on the answer huggingface_hub reads, before it writes, and every fetched file must resolve
inside the cache.

Every failure is a `ModelNotFoundError` with one line naming the id and what to do; nothing from
inside huggingface_hub reaches the caller as a traceback.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from ..errors import ModelNotFoundError
from ..text.stop_tokens import GENERATION_CONFIG
from ..text.tokenizer_files import TOKENIZER_FILES
from .hub_ids import LOCAL_SUFFIXES, HubId, HubSettings, is_hub_id, parse_hub_id
from .hub_safety import (
    UnsafeHubAnswer,
    guard_hub_client,
    inside,
    is_commit,
    unsafe_filename,
    unsafe_revision,
    write_ref,
)

__all__ = [
    "CHAT_TEMPLATE_DIR",
    "LOCAL_SUFFIXES",
    "SAFETENSORS_INDEX",
    "WEIGHT_FILES",
    "HubId",
    "HubSettings",
    "is_hub_id",
    "parse_hub_id",
    "resolve_model",
]
logger = logging.getLogger(__name__)

SAFETENSORS_INDEX = "model.safetensors.index.json"
WEIGHT_FILES = ("config.json", GENERATION_CONFIG, SAFETENSORS_INDEX)
"""Besides the safetensors shards: what `hf_folder` / `checkpoint` read of a checkpoint folder."""
CHAT_TEMPLATE_DIR = "additional_chat_templates"
"""transformers' folder of named chat templates (``<name>.jinja``), read by AutoTokenizer."""
_SPLIT_GGUF = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$", re.IGNORECASE)
_QUANT_NAME = re.compile(
    r"(?<![A-Za-z0-9])((?:UD-)?(?:I?Q\d+(?:_[A-Z0-9]+)*|BF16|F16|FP16|F32|MXFP4(?:_MOE)?))(?![A-Za-z0-9])",
    re.IGNORECASE,
)
_MAX_WORKERS = 8  # parallel file downloads, as huggingface_hub's snapshot_download
_LOGIN_HINT = "log in with `hf auth login` (or set HF_TOKEN) with an account that has been granted access"


def resolve_model(path_or_id: str | os.PathLike[str], *, progress: bool = True) -> Path:
    """A local path for `path_or_id`: an existing local path as given (a missing one that is no
    Hub id too, for the loader to report), else the Hub id's files fetched into (or found in)
    the huggingface_hub cache: the snapshot folder of a safetensors checkpoint, or the one
    ``.ftw`` / ``.gguf`` file. `progress`: huggingface_hub's download bars (False: silent).

    Raises ModelNotFoundError (a CheckpointError): the repo or revision does not exist or is
    private, a gated repo without access, offline (or the Hub unreachable) with nothing cached,
    no weights the engine reads, a ``:QUANT`` that matches no file or several, a revision that
    is a path, a server answer that would name a file outside the cache. One line, naming the id
    and what to do.
    """
    local = Path(path_or_id).expanduser()
    if local.exists():
        return Path(path_or_id)
    hub_id = parse_hub_id(path_or_id)
    if hub_id is None:
        return Path(path_or_id)
    path = _Fetch(hub_id, HubSettings.from_env(), progress).run()
    logger.info("Hugging Face model %s: %s", hub_id, path)
    return path


class _Fetch:
    """One resolution: list the repo's files (the Hub, else the cache), choose, download."""

    def __init__(self, hub_id: HubId, settings: HubSettings, progress: bool) -> None:
        self.id, self.settings, self.progress = hub_id, settings, progress
        self.local_only = settings.offline  # set when the Hub turns out to be unreachable too
        self.unreachable: str | None = None  # why the Hub could not be used, when it could not
        self.commit = ""  # the listed commit (40 hex): every download is pinned to it
        from huggingface_hub.file_download import repo_folder_name

        # resolved, as huggingface_hub resolves it: the paths it returns are under this folder
        cache = settings.cache_dir.expanduser().resolve()
        self.storage = cache / repo_folder_name(repo_id=hub_id.repo_id, repo_type="model")

    def run(self) -> Path:
        if self.id.revision is not None and (why := unsafe_revision(self.id.revision)):
            # refs/<revision> is a file of the cache: a revision that is a path would leave it
            raise self._error(
                f"has an invalid revision {self.id.revision!r}: it {why}; name a branch, tag or commit"
            )
        files = self._list_files()
        if self.id.quant is not None:
            return self._quant_file(files)
        shards = [f for f in files if "/" not in f and f.endswith(".safetensors")]
        if shards:
            return self._checkpoint_folder(files, shards)
        ftw = [f for f in files if f.endswith(".ftw")]
        if len(ftw) == 1:
            return self._download_one(ftw[0])
        gguf = [f for f in files if f.lower().endswith(".gguf")]
        if ftw or gguf:
            kind = "several .ftw files" if ftw else "GGUF files only"
            choices = ", ".join(_quant_names(ftw or gguf))
            raise self._error(f"has {kind}: pick one with {self.id}:QUANT, QUANT one of: {choices}")
        raise self._error("has no weights the engine loads (*.safetensors, one .ftw file, .gguf with :QUANT)")

    # ---- listing ------------------------------------------------------------------------------
    def _list_files(self) -> list[str]:
        """The repo's file names at the revision: from the Hub, or (offline, or when the Hub
        cannot be reached) from the cached snapshot."""
        from huggingface_hub import HfApi

        if not self.local_only:
            try:
                # model_info (one request, with the file list), not list_repo_files: the paginated
                # tree listing retries a refused connection for ~20 s before the cache is tried
                guard_hub_client()
                api = HfApi(endpoint=self.settings.endpoint)
                info = api.model_info(self.id.repo_id, revision=self.id.revision)
            except Exception as e:  # noqa: BLE001 - mapped below, or the cache is tried
                self.unreachable = self._unreachable(e)
            else:
                if not is_commit(info.sha):  # it names snapshots/<sha>: never a path
                    raise self._refused(
                        f"{self.settings.endpoint} answered commit {str(info.sha)[:80]!r}, "
                        "which is no 40-hex-digit commit id"
                    )
                self.commit = str(info.sha)
                return sorted(s.rfilename for s in info.siblings or ())
            self.local_only = True
        files = self._cached_files()
        if files is None:
            raise self._error(self._not_cached())
        return files

    def _unreachable(self, error: Exception) -> str:
        """Why the Hub gave no listing, when the cache may still serve: a network failure or a
        server error. Anything else (missing, gated, private, bad revision) raises now."""
        from huggingface_hub.errors import HfHubHTTPError, OfflineModeIsEnabled

        if isinstance(error, OfflineModeIsEnabled):
            return "offline"
        if isinstance(error, UnsafeHubAnswer):
            raise self._refused(str(error)) from None
        if isinstance(error, HfHubHTTPError):
            status = error.response.status_code if error.response is not None else None
            if status is not None and status < 500 and status != 429:
                raise self._hub_error(error) from None
            return f"the Hub at {self.settings.endpoint} answered {status}"
        if _is_network_error(error):
            return f"cannot reach {self.settings.endpoint} ({type(error).__name__})"
        raise self._error(f"could not be listed ({type(error).__name__}: {_first_line(error)})") from None

    def _cached_files(self) -> list[str] | None:
        """File names in the cached snapshot of the revision (huggingface_hub's cache layout:
        models--org--name/refs/<revision> -> snapshots/<commit>/...), None if not cached."""
        revision = self.id.revision or "main"
        commit = revision
        if not is_commit(revision):
            ref = self.storage / "refs" / revision
            if not ref.is_file():
                return None
            commit = ref.read_text().strip()
        snapshot = self.storage / "snapshots" / commit
        if not is_commit(commit) or not snapshot.is_dir():  # a ref naming a path is not followed
            return None
        self.commit = commit
        return sorted(p.relative_to(snapshot).as_posix() for p in snapshot.rglob("*") if p.is_file())

    # ---- choosing ---------------------------------------------------------------------------
    def _checkpoint_folder(self, files: Sequence[str], shards: list[str]) -> Path:
        """The snapshot folder with only what the engine reads: the shards the safetensors index
        names (all top-level shards without one), config, generation config, tokenizer."""
        if SAFETENSORS_INDEX in files:
            shards = self._index_shards() or shards
        present = set(files)
        wanted = [f for f in (*WEIGHT_FILES, *TOKENIZER_FILES) if f in present]
        wanted += [f for f in files if f.startswith(f"{CHAT_TEMPLATE_DIR}/") and f.endswith(".jinja")]
        missing = sorted(set(shards) - present)
        if missing:  # fetched by name, never by pattern: only what the listing holds
            shown = ", ".join(repr(name[:80]) for name in missing[:3])
            raise self._error(f"is incomplete: its {SAFETENSORS_INDEX} names shards the repo lacks ({shown})")
        self._download([*wanted, *shards])
        return self.storage / "snapshots" / self.commit

    def _index_shards(self) -> list[str]:
        """The shard names the safetensors index maps weights to (none: no or an empty map)."""
        try:
            index = json.loads(self._download_one(SAFETENSORS_INDEX).read_text(encoding="utf-8"))
        except ValueError as e:  # not JSON, not UTF-8
            raise self._error(f"has an unreadable {SAFETENSORS_INDEX} ({_first_line(e)})") from None
        weight_map = index.get("weight_map", {}) if isinstance(index, dict) else None
        names = list(weight_map.values()) if isinstance(weight_map, dict) else None
        if names is None or not all(isinstance(name, str) for name in names):
            raise self._error(f"has a {SAFETENSORS_INDEX} with no weight_map of tensor -> file name")
        return sorted(set(names))

    def _quant_file(self, files: Sequence[str]) -> Path:
        """The one .gguf (else .ftw) file whose name contains the quant; every part of a split GGUF."""
        quant = (self.id.quant or "").lower()
        gguf = [f for f in files if f.lower().endswith(".gguf")]
        weights = gguf or [f for f in files if f.endswith(".ftw")]
        matches = [f for f in weights if quant in Path(f).name.lower()]
        if len(matches) > 1:  # prefer whole-word matches: Q8_0 in "model-Q8_0.gguf"
            word = re.compile(rf"(?<![a-z0-9]){re.escape(quant)}(?![a-z0-9])")
            matches = [f for f in matches if word.search(Path(f).name.lower())] or matches
        if len(matches) > 1 and _one_split_set(matches):
            return self._download(sorted(matches))[0]
        if len(matches) == 1:
            return self._download_one(matches[0])
        choices = ", ".join(_quant_names(weights)) or "none"
        if not matches:
            raise self._error(f"has no .gguf or .ftw file matching {self.id.quant!r}; quants: {choices}")
        raise self._error(
            f"has several files matching {self.id.quant!r} ({', '.join(matches)}); give a longer quant"
        )

    # ---- downloading ------------------------------------------------------------------------
    def _download_one(self, name: str) -> Path:
        return self._download([name])[0]

    def _download(self, names: Sequence[str]) -> list[Path]:
        """`names` of the listed commit, fetched (a few at a time) into, or found in, the cache:
        their paths in its ``snapshots/<commit>`` folder. File by file through
        `hf_hub_download` (not `snapshot_download`, which would take the commit and the blob
        names from a listing of the server's that nothing here checks)."""
        for name in names:
            if unsafe_filename(name):
                raise self._refused(f"{self.settings.endpoint} listed the file name {name[:80]!r}, a path")
        if not self.local_only:
            guard_hub_client()  # again: the client may have been replaced since the listing
        with ThreadPoolExecutor(max_workers=max(1, min(_MAX_WORKERS, len(names)))) as pool:
            paths = list(pool.map(self._fetch_file, names))
        if not self.local_only:  # as snapshot_download did: offline runs find the branch or tag
            try:
                write_ref(self.storage, self.id.revision or "main", self.commit)
            except OSError as e:
                logger.warning("could not record %s in the cache: %s", self.id, e)
        return paths

    def _fetch_file(self, name: str) -> Path:
        from huggingface_hub import hf_hub_download

        tqdm_class = None if self.progress else _SilentTqdm
        path = Path(self._call(hf_hub_download, self.id.repo_id, name, tqdm_class=tqdm_class))
        expected = self.storage / "snapshots" / self.commit / name
        if path != expected or not inside(path, self.settings.cache_dir):
            raise self._refused(f"{name} was fetched to {path}, not to {expected} in the cache")
        return path

    def _call(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """`fn` (a huggingface_hub download) with this resolution's commit, cache, endpoint and
        offline choice, its errors mapped to one ModelNotFoundError line."""
        from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

        try:
            return fn(
                *args,
                revision=self.commit,
                cache_dir=self.settings.cache_dir,
                endpoint=self.settings.endpoint,
                local_files_only=self.local_only,
                **kwargs,
            )
        except UnsafeHubAnswer as e:
            raise self._refused(str(e)) from None
        except LocalEntryNotFoundError:
            raise self._error(self._not_cached()) from None
        except HfHubHTTPError as e:
            raise self._hub_error(e) from None
        except Exception as e:  # noqa: BLE001 - a network or disk failure mid-download
            if _is_network_error(e):
                raise self._error(
                    f"could not be downloaded from {self.settings.endpoint} ({type(e).__name__}): "
                    "check the network connection (and HF_ENDPOINT), then try again"
                ) from None
            if isinstance(e, OSError):
                raise self._error(
                    f"could not be written to the cache {self.settings.cache_dir} ({_first_line(e)})"
                ) from None
            raise

    # ---- errors -----------------------------------------------------------------------------
    def _error(self, what: str) -> ModelNotFoundError:
        return ModelNotFoundError(f"Hugging Face model '{self.id}' {what}", model_id=str(self.id))

    def _refused(self, what: str) -> ModelNotFoundError:
        return self._error(f"was refused: {what}; check HF_ENDPOINT")

    def _not_cached(self) -> str:
        where = f"the cache {self.settings.cache_dir}"
        reason = self.unreachable or "the download failed"
        if self.settings.offline or reason == "offline":
            return (
                f"is not in {where} and HF_HUB_OFFLINE=1 forbids downloading it: "
                "unset HF_HUB_OFFLINE (or set it to 0) to download it, or check the id and HF_HUB_CACHE"
            )
        return (
            f"is not in {where} and the Hub cannot be used ({reason}): "
            "check the network connection (and HF_ENDPOINT), then try again"
        )

    def _hub_error(self, error: Any) -> ModelNotFoundError:
        from huggingface_hub.errors import (
            EntryNotFoundError,
            GatedRepoError,
            RepositoryNotFoundError,
            RevisionNotFoundError,
        )

        status = error.response.status_code if getattr(error, "response", None) is not None else None
        if isinstance(error, GatedRepoError):
            return self._error(f"is gated and this account has no access: {_LOGIN_HINT}, then try again")
        if isinstance(error, EntryNotFoundError):  # listed, then gone: the repo changed meanwhile
            return self._error(f"lacks a file its listing named ({_first_line(error)}); try again")
        if isinstance(error, RevisionNotFoundError):
            return self._error(f"has no revision {self.id.revision or 'main'!r}: check the @revision")
        if isinstance(error, RepositoryNotFoundError) or status in (401, 404):
            return self._error(
                f"was not found on {self.settings.endpoint} (nor is it a local path): check the id; "
                f"if the repo is private, {_LOGIN_HINT}"
            )
        if status == 403:
            return self._error(f"is not accessible (403): {_LOGIN_HINT}")
        return self._error(f"could not be fetched: the Hub answered {status}; try again later")


def _is_network_error(error: BaseException) -> bool:
    """A connection, timeout or transport failure of huggingface_hub's HTTP client."""
    try:
        import httpx2

        transport: tuple[type[BaseException], ...] = (httpx2.TransportError,)
    except ImportError:  # another huggingface_hub major: its client's errors are not known here
        transport = ()
    return isinstance(error, (*transport, ConnectionError, TimeoutError))


def _one_split_set(names: Sequence[str]) -> bool:
    """Whether `names` are exactly the parts of one split GGUF (``x-00001-of-00003.gguf``, ...)."""
    parts = [_SPLIT_GGUF.search(n) for n in names]
    if not all(parts):
        return False
    stems = {_SPLIT_GGUF.sub("", n) for n in names}
    totals = {int(p[2]) for p in parts if p}
    return len(stems) == 1 and totals == {len(names)}


def _quant_names(files: Sequence[str]) -> list[str]:
    """The quant each weight file's name carries (``Q4_K_M``), else its file name; unique, in order."""
    names = []
    for f in files:
        match = _QUANT_NAME.search(Path(f).name)
        names.append(match[1] if match else Path(f).name)
    return list(dict.fromkeys(names))


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


class _SilentTqdm(tqdm):  # type: ignore[misc]
    """huggingface_hub's bars with progress off: created (it calls their methods), never shown."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.pop("name", None)
        kwargs["disable"] = True
        super().__init__(*args, **kwargs)
