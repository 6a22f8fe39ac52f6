"""Agent retries: FreeToken rollback vs re-sending the full history, in one run.

    python bench/agent_retry.py [--context 2000] [--calls 16] [--fail 0.3] [--seed 0]

Builds a tiny random Qwen3-MoE checkpoint with its own small BPE tokenizer (self-contained; the
engine's default ChatML/Hermes template), then runs the same Agent loop twice on the real engine:
a ~2,000-token context (system prompt + tools + a long document), `--calls` tool calls forced
one per turn by a tool_choice policy, and `--fail` of the tool's runs raising ValueError (a
model-caused error: roll back, note, regenerate). Failures follow a fixed schedule (run i fails
when floor((i + 1) * fail) > floor(i * fail)), so both loops see the same ones.

- freetoken: `FreeTokenModel`, native anchors; a retry rolls back to the anchor before the call
  and a new turn keeps the common prefix.
- resend: the same backend with no reuse, like a stateless server without a prefix cache: every
  model turn starts a fresh session and prefills the whole history (a retry re-sends the kept
  prefix plus the note).

Prints total prefilled tokens and wall time for both, and their ratios (target: >= 5x less
prefill with rollback).
"""

from __future__ import annotations

import argparse
import logging
import math
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Literal

import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from freetoken_agents import Agent, FreeTokenModel, GenerateRequest, RetryPolicy, tool
from freetoken_agents.anchors import AnchorHandle, RollbackOutcome
from freetoken_agents.engine import Engine
from freetoken_agents.model import GenEvent
from freetoken_agents.trace import AnchorKind

logger = logging.getLogger("bench.agent_retry")

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>"]
TEXT = (
    "The quick brown fox jumps over the lazy dog. A tool-calling agent reads the request, calls a "
    "function and answers with the result. The weather in Paris is sunny with a high of 21 degrees. "
    'Each token is routed to two experts out of eight. {"name": "lookup", "arguments": {"key": "a"}} '
    "You are a helpful assistant; call a tool when needed. <tools></tools> <tool_response> 0123456789"
)


def build_model(folder: Path, vocab: int = 512) -> Path:
    """Save a tiny random qwen3_moe checkpoint and a byte-level BPE tokenizer to `folder`."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=480, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator([TEXT] * 20, trainer)
    hf_tok = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
    hf_tok.save_pretrained(folder)
    config = transformers.AutoConfig.for_model(
        "qwen3_moe",
        vocab_size=vocab,
        hidden_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_experts=8,
        num_experts_per_tok=2,
        max_position_embeddings=8192,
        eos_token_id=SPECIALS.index("<|im_end|>"),
        pad_token_id=0,
        tie_word_embeddings=False,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.copy_(1.0 + 0.1 * torch.randn_like(p) if "norm" in name else 0.1 * torch.randn_like(p))
    model.save_pretrained(folder, safe_serialization=True)
    return folder


class ResendModel(FreeTokenModel):
    """The baseline: no reuse. Context changes only edit a token list; each model turn starts a
    fresh session and prefills all of it (a rollback is "resend the kept prefix")."""

    def __init__(self, engine: Engine) -> None:
        super().__init__(engine)
        self._history: list[int] = []
        self._in_turn = False

    @property
    def position(self) -> int:
        return self.session.position if self._in_turn else len(self._history)

    @property
    def token_ids(self) -> list[int]:
        return self.session.token_ids if self._in_turn else list(self._history)

    def sync(self, ids: Sequence[int]) -> None:
        self._history = list(ids)

    def append_text(self, text: str) -> None:
        self._history += self.tokenizer.encode(text, add_special_tokens=False)

    def reset(self) -> None:
        self._history = []

    def anchor(self, kind: AnchorKind, label: str | None = None) -> AnchorHandle:
        ids = tuple(self.token_ids)  # a record of the prefix only: nothing is kept to return to
        return AnchorHandle(f"r{len(ids)}-{kind}", kind, len(ids), label, ids)

    def rollback(self, anchor: AnchorHandle) -> RollbackOutcome:
        start = self.position
        self._history = list(anchor.prefix)
        return RollbackOutcome(start, anchor.position, rebuilt=True)  # recomputed, nothing saved

    def generate(self, request: GenerateRequest) -> Iterator[GenEvent]:
        self.session.close()
        self.session = self.engine.new_session()
        self.prefill(self._history)  # the whole history, every turn
        self._in_turn = True
        try:
            yield from super().generate(request)
        finally:
            self._in_turn = False
            self._history = self.session.token_ids


def run_loop(model: FreeTokenModel, context_tokens: int, calls: int, fail: float, seed: int) -> dict:
    """The agent loop; returns prefill/decode totals, wall time and what happened."""
    stats = {"runs": 0, "failed": 0}

    @tool
    def lookup(key: Literal["alpha", "beta", "gamma"]) -> str:
        "Look a key up in the document."
        i = stats["runs"]
        stats["runs"] += 1
        if math.floor((i + 1) * fail) > math.floor(i * fail):
            stats["failed"] += 1
            raise ValueError(f"key {key!r} is not indexed yet")
        return f"{key}: found on page {stats['runs']}"

    doc, system = "", "You answer questions about the document below, using the lookup tool.\n"
    schemas = [lookup.json_schema()]

    def rendered() -> int:
        return len(
            model.render([{"role": "system", "content": system + doc}], schemas, generation_prompt=False)
        )

    while rendered() < context_tokens:
        doc += TEXT + "\n"
    context = rendered()
    agent = Agent(
        model,
        [lookup],
        system_prompt=system + doc,
        tool_choice=lambda step: "lookup" if step <= calls else "none",
        retry=RetryPolicy(model_attempts=6, initial_backoff=0.0),
        max_new_tokens=8,
        max_steps=calls + 1,
        seed=seed,
    )
    t0 = time.perf_counter()
    result = agent.run("Look up alpha, beta and gamma, one call per turn, then summarise.")
    wall = time.perf_counter() - t0
    trace = result.trace
    return {
        "context": context,
        "prefilled": trace.tokens_prefilled,
        "decoded": trace.tokens_decoded,
        "saved": trace.tokens_saved_by_rollback,
        "rollbacks": len(trace.rollbacks),
        "calls": len(trace.tool_calls),
        "tool_runs": stats["runs"],
        "failed": stats["failed"],
        "wall": wall,
        "turns": len(trace.steps) + len(trace.rollbacks),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--context", type=int, default=2000, help="tokens of system prompt + tools")
    parser.add_argument("--calls", type=int, default=16, help="successful tool calls in the run")
    parser.add_argument("--fail", type=float, default=0.3, help="fraction of tool runs that fail")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (tiny model: 1)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        engine = Engine.from_pretrained(build_model(Path(tmp)))
        rows = {}
        for name, model in (("freetoken", FreeTokenModel(engine)), ("resend", ResendModel(engine))):
            rows[name] = run_loop(model, args.context, args.calls, args.fail, args.seed)
    ft, rs = rows["freetoken"], rows["resend"]
    print(f"context {ft['context']} tokens (system prompt + tools), {args.calls} successful calls")
    columns = ("prefilled", 10), ("decoded", 8), ("turns", 6), ("rollbacks", 9), ("failed", 11), ("wall s", 8)
    print(f"{'loop':<10} " + " ".join(f"{name:>{width}}" for name, width in columns))
    for name, r in rows.items():
        failed = f"{r['failed']}/{r['tool_runs']}"
        print(
            f"{name:<10} {r['prefilled']:>10} {r['decoded']:>8} {r['turns']:>6} {r['rollbacks']:>9} "
            f"{failed:>11} {r['wall']:>8.2f}"
        )
    print(f"tokens saved by rollback (freetoken trace): {ft['saved']}")
    print(f"prefill ratio resend/freetoken: {rs['prefilled'] / max(1, ft['prefilled']):.1f}x (target >= 5x)")
    print(f"wall-time ratio resend/freetoken: {rs['wall'] / ft['wall']:.2f}x")


if __name__ == "__main__":
    main()
