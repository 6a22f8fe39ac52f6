"""What a Hub fetch accepts from the id and from the server before a byte reaches the disk.

huggingface_hub builds cache paths from values it does not check: the revision the id spells
(``refs/<revision>``), the commit the server names (``snapshots/<X-Repo-Commit>``,
``.no_exist/<X-Repo-Commit>``, ``trees/<sha>.json``) and the ETag of its metadata request
(``blobs/<ETag>``, ``.locks/.../<ETag>.lock``). A hostile ``HF_ENDPOINT`` answering
``ETag: "../../../x"`` would have the download written outside the cache. Checking afterwards is
too late, and checking with a request of our own is racy (the server may answer that one honestly
and the download's own request not), so the server's headers are checked on the very response
huggingface_hub reads: a response hook on its shared HTTP client (`guard_hub_client`) refuses a
``/resolve/`` answer whose commit is not 40 hex digits or whose ETag is no sha1/sha256 digest.
The commit the model info names is checked by the caller (`is_commit`), which then pins every
download to it.
"""

from __future__ import annotations

import os
import re
import threading
import uuid
from pathlib import Path
from typing import Any

COMMIT = re.compile(r"[0-9a-f]{40}")
"""A git commit id, as the Hub spells it (and as huggingface_hub names ``snapshots/<commit>``)."""
_ETAG = re.compile(r'(?:W/)?"?(?:[0-9a-fA-F]{40}|[0-9a-fA-F]{64})"?')
"""An ETag header huggingface_hub turns into a blob name: a git blob sha1 or an LFS sha256, quoted or
weak; after its normalisation (strip ``W/`` and quotes) only the hex digits are left."""
_COMMIT_HEADER, _ETAG_HEADERS = "X-Repo-Commit", ("X-Linked-Etag", "ETag")
_lock = threading.Lock()


class UnsafeHubAnswer(Exception):
    """The Hub (or what answers at HF_ENDPOINT) sent a value that would name a path outside the
    cache, or is no value a Hub sends. Raised inside huggingface_hub's HTTP client, so that the
    download stops before it writes anything; `hub.resolve_model` reports it as a one-line
    `ModelNotFoundError`. The message is one line."""


def is_commit(value: object) -> bool:
    return isinstance(value, str) and COMMIT.fullmatch(value) is not None


def unsafe_revision(revision: str) -> str | None:
    """Why `revision` (a branch, tag or commit; ``refs/pr/1`` included) cannot name a file under
    the cache's ``refs/`` folder, or None when it can: absolute, a backslash, an empty, ``.`` or
    ``..`` part, or a control character."""
    if revision.startswith("/") or "\\" in revision:
        return "is a path (a leading '/' or a backslash)"
    if any(part in ("", ".", "..") for part in revision.split("/")):
        return "has an empty, '.' or '..' part"
    if any(ord(char) < 32 or ord(char) == 127 for char in revision):
        return "has a control character"
    return None


def unsafe_filename(name: str) -> bool:
    """Whether a listed repo file name could leave the snapshot folder (absolute, ``..``, a
    backslash or a drive): huggingface_hub refuses those too, with a ValueError."""
    parts = name.split("/")
    return name.startswith("/") or "\\" in name or ":" in parts[0] or any(p in ("", ".", "..") for p in parts)


def inside(path: str | os.PathLike[str], root: Path) -> bool:
    """Whether `path`, links resolved, lies under `root` (links resolved too)."""
    return Path(path).resolve().is_relative_to(root.resolve())


def write_ref(storage: Path, revision: str, commit: str) -> None:
    """Record ``refs/<revision>`` -> `commit` in a repo's cache folder (huggingface_hub's layout),
    atomically, so an offline run finds the branch or tag; `revision` and `commit` are checked."""
    if revision == commit:
        return
    ref = storage / "refs" / revision
    if ref.is_file() and ref.read_text().strip() == commit:
        return
    ref.parent.mkdir(parents=True, exist_ok=True)
    tmp = ref.with_name(f"{ref.name}.{uuid.uuid4().hex[:8]}.tmp")
    tmp.write_text(commit)
    os.replace(tmp, ref)


def guard_hub_client() -> None:
    """Make huggingface_hub's shared HTTP client check every answer's commit and ETag headers
    (`_check_answer`) before huggingface_hub reads them. Called before each fetch: the client is
    replaced when someone calls `set_client_factory`, and the new one needs the hook too. On a real
    Hub the check never fires (it sends hex digests only), so other users of the client keep
    working."""
    from huggingface_hub.utils import get_session

    session = get_session()
    with _lock:
        hooks = session.event_hooks
        if _check_answer not in hooks["response"]:
            session.event_hooks = {**hooks, "response": [*hooks["response"], _check_answer]}


def _check_answer(response: Any) -> None:
    """Refuse an answer whose ``X-Repo-Commit`` is not a commit id, or, for a metadata request
    (HEAD, where huggingface_hub takes the blob's name), whose ETag is not a digest. Answers without
    ``X-Repo-Commit`` are left alone: huggingface_hub uses no ETag without a commit."""
    commit = response.headers.get(_COMMIT_HEADER)
    if commit is None:
        return
    host = f"{response.request.url.scheme}://{response.request.url.netloc.decode()}"
    if not COMMIT.fullmatch(commit):
        raise UnsafeHubAnswer(f"{host} answered commit {commit[:80]!r}, which is no 40-hex-digit commit id")
    if response.request.method != "HEAD":
        return  # a download's own ETag names nothing: the HEAD's does
    for name in _ETAG_HEADERS:
        value = response.headers.get(name)
        if value and not _ETAG.fullmatch(value):
            raise UnsafeHubAnswer(f"{host} answered {name} {value[:80]!r}, which is no sha1/sha256 ETag")
