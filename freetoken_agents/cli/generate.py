"""`freetoken generate [MODEL] --prompt TEXT`: stream a completion to stdout."""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from typing import TYPE_CHECKING

from ..engine.flags import add_engine_arguments, engine_options
from ..recipes._common import positive_int, use_threads
from .argtypes import non_negative_float, probability
from .common import PREFILL_CHUNK, CLIError, prefill_session, show_progress, write

if TYPE_CHECKING:
    from ..engine import Engine, SamplingParams, TokenEvent

# The engine and its torch load inside `run`, never for `freetoken --help` (issue 65).


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate text from a prompt, streaming tokens to stdout")
    p.add_argument(
        "model",
        nargs="?",
        help="Hugging Face checkpoint folder, .ftw file, or Hub id org/name[@revision] (default: embedded)",
    )
    p.add_argument("--prompt", required=True, help="prompt text")
    p.add_argument("--max-new-tokens", type=positive_int, default=64)
    p.add_argument("--temperature", type=non_negative_float, default=0.0, help="0 = greedy")
    p.add_argument("--top-k", type=positive_int, default=None)
    p.add_argument("--top-p", type=probability, default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.add_argument("--no-progress", action="store_true", help="no prefill progress bar")
    add_engine_arguments(p)
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from ..embedded import default_model
    from ..engine import Engine

    use_threads(args.threads, args.model)
    options = engine_options(args, progress=show_progress(args.no_progress))
    with Engine.from_options(args.model or default_model(), options) as engine:  # closed: traces written
        return _generate(engine, args)


def _generate(engine: Engine, args: argparse.Namespace) -> int:
    tok = engine.tokenizer
    if args.chat:
        ids = engine.apply_chat_template([{"role": "user", "content": args.prompt}])
    else:
        ids = tok.encode(args.prompt, add_special_tokens=False) or [tok.bos_token_id or 0]
    if len(ids) + 1 > engine.max_context:
        raise CLIError(f"the prompt has {len(ids)} tokens; the model's context is {engine.max_context}")
    params = dict(
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
    )
    if len(ids) <= PREFILL_CHUNK:
        events = engine.stream(ids, **params)
    else:  # a long prompt: prefill all but its last token in chunks, with a bar
        from ..engine import SamplingParams

        sampling = SamplingParams(**params, stop_token_ids=engine.default_stop_token_ids())
        events = _stream_long(engine, ids, sampling, show_progress(args.no_progress))
    for event in events:
        write(event.text)
    write("\n")
    return 0


def _stream_long(
    engine: Engine, ids: list[int], sampling: SamplingParams, progress: bool
) -> Iterator[TokenEvent]:
    from ..engine.runtime.generate import stream_tokens

    with engine.new_session() as session:
        prefill_session(session, ids[:-1], progress=progress)
        yield from stream_tokens(session, ids[-1:], sampling, engine.tokenizer)
