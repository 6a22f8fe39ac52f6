"""`freetoken serve`: an OpenAI-compatible chat-completions server over one engine.

The command only loads the engine (with the same engine options as every other command) and
starts the server from `freetoken_agents.integrations.openai_server`; it is ready when
`GET /v1/models` answers.
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
import os
from pathlib import Path

from ..engine.flags import add_engine_arguments, engine_options
from ..recipes._common import positive_int, use_threads
from .common import CLIError, model_label

# The engine, the server and their torch load inside `run`, never for `freetoken --help` (issue 65).

logger = logging.getLogger(__name__)

API_KEY_ENV = "FREETOKEN_API_KEY"
TOOL_FORMATS: tuple[str, ...] = (
    "deepseek",
    "deepseek_v31",
    "harmony",
    "hermes",
    "mistral",
    "mistral_v11",
    "qwen3_coder",
)
"""`--tool-format` choices: the names of `parsers.PARSERS`, spelled out here because importing the
parsers (pydantic) was most of what every `freetoken --help` still loaded; a test keeps them equal."""


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="serve the model over the OpenAI chat-completions API")
    p.add_argument(
        "--model",
        default=None,
        metavar="PATH",
        help="Hugging Face checkpoint folder, .ftw file, or Hub id org/name[@revision] (default: the "
        "embedded model)",
    )
    p.add_argument(
        "--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)"
    )
    p.add_argument("--port", type=int, default=8000, help="port (default 8000; 0 picks a free one)")
    p.add_argument(
        "--api-key",
        action="append",
        default=None,
        help=f"require `Authorization: Bearer KEY` on /v1 requests (default: ${API_KEY_ENV}, keys "
        "separated by commas; safer: argv is readable by other processes); repeatable: one key per "
        "tenant, prefix reuse never crosses keys",
    )
    p.add_argument(
        "--served-model-name",
        default=None,
        help="the model id clients pass (default: the Hub id as given, else the file name)",
    )
    p.add_argument(
        "--max-queue", type=positive_int, default=16, help="requests that may wait for the engine (then 429)"
    )
    p.add_argument(
        "--max-request-bytes",
        type=positive_int,
        default=4 * 1024 * 1024,
        help="largest request body accepted, counted while reading (default 4 MiB; then 413)",
    )
    p.add_argument(
        "--timeout-keep-alive",
        type=positive_int,
        default=5,
        help="seconds an idle keep-alive connection stays open (default 5)",
    )
    p.add_argument(
        "--limit-concurrency",
        type=positive_int,
        default=256,
        help="open connections past which the server answers 503 at once (default 256)",
    )
    p.add_argument(
        "--cors-origin",
        action="append",
        default=None,
        metavar="ORIGIN",
        help="let a browser app served from ORIGIN (scheme://host[:port], or * for any) call the "
        "server; repeatable (default: no CORS, browsers refuse cross-origin calls)",
    )
    p.add_argument("--no-prefix-cache", action="store_true", help="prefill every prompt from scratch")
    p.add_argument(
        "--tool-format",
        choices=TOOL_FORMATS,
        default=None,
        help="tool-call format (default: from the template)",
    )
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    add_engine_arguments(p)
    p.set_defaults(run=run)


def api_keys(flags: list[str] | None, env: str | None) -> tuple[str, ...] | None:
    """The keys the server accepts: every --api-key, else ${API_KEY_ENV} (comma-separated keys);
    None when neither gives one (the variable unset or empty). Each key is one tenant (prefix
    reuse never crosses keys).

    CLIError for an empty --api-key, and for a variable that is set but holds no key once split
    (" , "): the user asked for authentication, and serving without it would be silent."""
    if flags is not None:
        if any(not key.strip() for key in flags):
            raise CLIError("--api-key must not be empty")
        return tuple(flags)
    if not env:
        return None
    keys = tuple(k.strip() for k in env.split(",") if k.strip())
    if not keys:
        raise CLIError(f"${API_KEY_ENV} holds no key (only commas and blanks): set one, or unset it")
    return keys


def run(args: argparse.Namespace) -> int:
    from ..embedded import default_model
    from ..engine import Engine
    from ..integrations.openai_server import InvalidOrigin, ServerConfig, check_origin, create_app, serve

    if not 0 <= args.port <= 65535:
        raise CLIError(f"--port must be in 0..65535, got {args.port}")
    try:  # before the engine loads: a typo in an origin should not cost a model load
        cors_origins = tuple(check_origin(origin) for origin in args.cors_origin or ())
    except InvalidOrigin as e:
        raise CLIError(f"--cors-origin: {e}") from None
    api_key = api_keys(args.api_key, os.environ.get(API_KEY_ENV))
    if api_key is None and not _loopback(args.host):
        logger.warning("serving on %s without --api-key: anyone who can reach it can use it", args.host)
    if "*" in cors_origins and api_key is None:
        logger.warning("--cors-origin * without --api-key: any web page a browser opens can use the server")
    use_threads(args.threads, args.model)
    path = Path(args.model) if args.model is not None else default_model()
    engine = Engine.from_options(path, engine_options(args))
    name = args.served_model_name or served_name(args.model, path)
    config = ServerConfig(
        model_name=name,
        api_key=api_key,
        max_queue=args.max_queue,
        prefix_cache=not args.no_prefix_cache,
        max_request_bytes=args.max_request_bytes,
        cors_origins=cors_origins,
    )
    app = create_app(engine, config, family=args.tool_format)
    serve(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        timeout_keep_alive=args.timeout_keep_alive,
        limit_concurrency=args.limit_concurrency,
    )
    return 0


def served_name(model: str | None, path: Path) -> str:
    """The model id the server reports by default: a Hub id as given (``org/name[@revision]``),
    else the file's stem (.ftw) or the folder's name."""
    label = model_label(model, path)
    return path.stem if label == path.name and path.suffix == ".ftw" else label


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
