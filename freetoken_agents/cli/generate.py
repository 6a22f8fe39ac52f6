"""`freetoken generate MODEL --prompt TEXT`: stream a completion to stdout."""

from __future__ import annotations

import argparse
import sys

import torch

from ..engine import Engine

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate text from a prompt, streaming tokens to stdout")
    p.add_argument("model", help="Hugging Face checkpoint folder or .ftw file")
    p.add_argument("--prompt", required=True, help="prompt text")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.add_argument("--dtype", choices=sorted(_DTYPES), default="float32")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    engine = Engine.from_pretrained(args.model, dtype=_DTYPES[args.dtype])
    tok = engine.tokenizer
    if args.chat:
        ids = engine.apply_chat_template([{"role": "user", "content": args.prompt}])
    else:
        ids = tok.encode(args.prompt, add_special_tokens=False) or [tok.bos_token_id or 0]
    for event in engine.stream(
        ids,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
    ):
        sys.stdout.write(event.text)
        sys.stdout.flush()
    sys.stdout.write("\n")
    return 0
