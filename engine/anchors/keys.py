"""The per-user key that authenticates saved anchors (HMAC-SHA256 in `persist.py`).

Saved anchors are KV data and token ids that a later process restores without recomputing, so a
file that anyone could write must not be trusted: every saved folder carries an HMAC made with
this key, and loading refuses a folder whose HMAC does not verify. A writer without the key
cannot forge one, whatever unkeyed hashes it recomputes.

Where the key lives, first found wins: the `key_file` given to `AnchorStore`; the file named by
$FREETOKEN_ANCHOR_KEY_FILE; `anchor.key` in $FREETOKEN_CONFIG_DIR; `anchor.key` in the user's
config dir (`platformdirs.user_config_dir("freetoken")`, e.g. ~/.config/freetoken). It is created
on first save: 32 random bytes as 64 hex characters, mode 0600 (directory 0700), created
exclusively so concurrent processes end up with the same key. A key file that others may read or
write (any group/other permission bit), that is not a regular file, that belongs to another user
or that holds fewer than 32 bytes of hex is refused with AnchorError: it would not authenticate.
"""

from __future__ import annotations

import os
import secrets
import stat
from pathlib import Path

from ..errors import AnchorError, AnchorFileError

KEY_FILE_ENV = "FREETOKEN_ANCHOR_KEY_FILE"
CONFIG_DIR_ENV = "FREETOKEN_CONFIG_DIR"
KEY_NAME = "anchor.key"
KEY_BYTES = 32


def key_path(key_file: str | os.PathLike[str] | None = None) -> Path:
    """Where the anchor key is (see the module docstring); the file may not exist yet."""
    if key_file is not None:
        return Path(key_file).expanduser()
    if os.environ.get(KEY_FILE_ENV):
        return Path(os.environ[KEY_FILE_ENV]).expanduser()
    if os.environ.get(CONFIG_DIR_ENV):
        return Path(os.environ[CONFIG_DIR_ENV]).expanduser() / KEY_NAME
    from platformdirs import user_config_dir

    return Path(user_config_dir("freetoken")) / KEY_NAME


def load_key(key_file: str | os.PathLike[str] | None = None, *, create: bool) -> bytes:
    """The anchor key's bytes. `create`: make the key file when it does not exist (saving);
    otherwise its absence is an AnchorFileError (loading: nothing here can verify the folder)."""
    path = key_path(key_file)
    if not path.exists():
        if not create:
            raise AnchorFileError(
                f"no anchor key at {path}: saved anchors are verified with the key of the user who saved "
                f"them (set {KEY_FILE_ENV} to use another key file)"
            )
        _create(path)
    try:  # O_NONBLOCK: a FIFO in place of the key must be refused below, not block the open
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
    except OSError as e:
        raise AnchorError(f"cannot read the anchor key {path}: {e}") from e
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise AnchorError(f"the anchor key {path} is not a regular file")
        if st.st_mode & 0o077:
            raise AnchorError(
                f"the anchor key {path} has mode {stat.S_IMODE(st.st_mode):04o}: others could forge saved "
                f"anchors with it; chmod 600 it (or remove it to make a new one)"
            )
        if hasattr(os, "getuid") and st.st_uid != os.getuid():
            raise AnchorError(f"the anchor key {path} belongs to uid {st.st_uid}, not to this user")
        text = f.read(4096)
    try:
        key = bytes.fromhex(text.decode("ascii").strip())
    except (UnicodeDecodeError, ValueError):
        key = b""
    if len(key) < KEY_BYTES:
        raise AnchorError(f"the anchor key {path} holds no {KEY_BYTES}-byte hex key; remove it for a new one")
    return key


def _create(path: Path) -> None:
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return  # another process made it first: use theirs
    except OSError as e:
        raise AnchorError(f"cannot create the anchor key {path}: {e}") from e
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(KEY_BYTES) + "\n")
        f.flush()
        os.fsync(f.fileno())
