"""CORS for browser apps: off unless origins are named (`ServerConfig.cors_origins`,
`freetoken serve --cors-origin ORIGIN`), then Starlette's CORSMiddleware answers preflights
(OPTIONS) for those origins and marks their responses readable by them.

Credentials (cookies) are never allowed: the API key travels in the Authorization header, which a
browser app sets itself. Any request header may be sent (the openai JS client adds its own
`x-stainless-*` headers), and `Retry-After` is exposed so a browser app can honour a 429.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from fastapi import FastAPI
from starlette.middleware.cors import CORSMiddleware

_ORIGIN = re.compile(r"^[a-z][a-z0-9+.-]*://(\[[0-9a-f:.]+\]|[a-z0-9.-]+)(:\d{1,5})?$", re.IGNORECASE)


class InvalidOrigin(ValueError):
    """A CORS origin that no browser sends: not `*` and not `scheme://host[:port]`."""


def check_origin(origin: str) -> str:
    """`origin` as browsers send it in the Origin header, or InvalidOrigin (one line). A trailing
    slash or a path is the usual slip: the browser's Origin never has one, so it would never match."""
    if origin == "*" or _ORIGIN.match(origin):
        return origin
    hint = " (no path or trailing slash)" if "://" in origin else ""
    raise InvalidOrigin(
        f"CORS origin {origin!r} is not '*' or scheme://host[:port]{hint}, e.g. http://localhost:3000"
    )


def add_cors(app: FastAPI, origins: Iterable[str]) -> None:
    """Answer CORS preflights and mark responses for `origins` (each checked by `check_origin`)."""
    app.add_middleware(
        CORSMiddleware,
        allow_origins=[check_origin(origin) for origin in origins],
        allow_methods=["GET", "POST", "OPTIONS"],
        allow_headers=["*"],
        allow_credentials=False,
        expose_headers=["Retry-After"],
        max_age=600,
    )
