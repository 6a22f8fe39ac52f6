"""Detokenisation and the stop-string hold-back, written once in the engine and used by every
streamer: the engine's `stream_tokens` yields exactly the whole decode (multi-byte characters and
special tokens included) at bounded tokenizer work per token, cuts stop strings where they begin,
and holds back only what may still become one; the SDK and the integrations use the same code."""

from __future__ import annotations

import random

import pytest
import torch
from tiny_models import make_tiny_tokenizer

from freetoken_agents import default_model
from freetoken_agents.engine import Engine, IncrementalDetokenizer, SamplingParams, held_back_for_stops
from freetoken_agents.engine.runtime.generate import stream_tokens
from freetoken_agents.engine.text.stop_text import first_stop

TEXT = 'Unicode: 你好啊集团, café 🙂 <tool_call>\n{"name": "f", "arguments": {"x": "é"}}\n</tool_call> done.'


class ScriptedSession:
    """The part of `Session` that `stream_tokens` uses, playing a fixed token sequence: the logits
    after each step are one-hot on the next scripted id, so greedy sampling picks exactly it."""

    def __init__(self, script: list[int], vocab: int, max_context: int = 100_000) -> None:
        self.script, self.vocab, self.step = script, vocab, 0
        self.engine = type("E", (), {"max_context": max_context})()
        self.position = 0
        self.pending: list[int] = []

    def _logits(self) -> torch.Tensor:
        logits = torch.zeros(self.vocab)
        logits[self.script[self.step]] = 1.0
        return logits

    def prefill(self, ids, last_only: bool = False) -> torch.Tensor:
        self.position += len(ids)
        return self._logits()[None]

    def decode(self, token: int) -> torch.Tensor:
        assert token == self.script[self.step]
        self.step += 1
        self.position += 1
        return self._logits()

    def append_unprocessed(self, token: int) -> None:
        self.pending.append(token)


def _stream(tok, ids: list[int], **params) -> list:
    session = ScriptedSession(ids, vocab=len(tok))
    sampling = SamplingParams(max_new_tokens=params.pop("max_new_tokens", len(ids)), **params)
    return list(stream_tokens(session, [1], sampling, tok))


@pytest.fixture(scope="module")
def tokenizers() -> list:
    return [make_tiny_tokenizer(), Engine.from_pretrained(default_model()).tokenizer]


def _ids_with_specials(tok, text: str) -> list[int]:
    ids = tok.encode(text, add_special_tokens=False)
    specials = [i for i in tok.all_special_ids if i is not None]
    return [specials[0], *ids[:7], specials[-1], *ids[7:], specials[0]]


def test_engine_stream_yields_exactly_the_whole_decode(tokenizers: list) -> None:
    for tok in tokenizers:
        ids = _ids_with_specials(tok, TEXT)
        events = _stream(tok, ids)
        assert [e.token_id for e in events] == ids and events[-1].finish_reason == "length"
        assert "".join(e.text for e in events) == tok.decode(ids, skip_special_tokens=False)


def test_engine_stream_flushes_at_a_stop_token(tokenizers: list) -> None:
    """The stop token adds no text; the text before it is delivered whole."""
    for tok in tokenizers:
        ids = tok.encode(TEXT, add_special_tokens=False)
        events = _stream(tok, [*ids, tok.eos_token_id], stop_token_ids=(tok.eos_token_id,))
        assert events[-1].finish_reason == "stop_token" and events[-1].token_id == tok.eos_token_id
        assert "".join(e.text for e in events) == tok.decode(ids)


def test_an_incomplete_character_at_the_end_is_flushed_as_decoded() -> None:
    tok = make_tiny_tokenizer()
    ids = tok.encode("ab好", add_special_tokens=False)[:-1]  # the last byte of 好 missing
    events = _stream(tok, ids)
    assert "".join(e.text for e in events) == tok.decode(ids) and tok.decode(ids).endswith("\ufffd")


def test_random_token_sequences_stream_their_whole_decode(tokenizers: list) -> None:
    rng = random.Random(0)
    for tok in tokenizers:
        for _ in range(10):
            ids = [rng.randrange(len(tok)) for _ in range(rng.randint(1, 40))]
            text = "".join(e.text for e in _stream(tok, ids))
            assert text == tok.decode(ids, skip_special_tokens=False)


@pytest.mark.parametrize("stop", ["好啊", "é", "</tool_call>", ", ca", "never there"])
def test_engine_stream_cuts_a_stop_string_where_it_begins(tokenizers: list, stop: str) -> None:
    for tok in tokenizers:
        ids = tok.encode(TEXT, add_special_tokens=False)
        events = _stream(tok, ids, stop_strings=(stop, "zzz"))
        whole = tok.decode(ids)
        streamed = "".join(e.text for e in events)
        if stop not in whole:
            assert streamed == whole and events[-1].finish_reason == "length"
            continue
        assert streamed == whole[: whole.find(stop)] and events[-1].finish_reason == "stop_string"
        # generation ends at the token whose text completes the stop string
        ends = next(n for n in range(1, len(ids) + 1) if stop in tok.decode(ids[:n]))
        assert len(events) == ends
        # nothing yielded before the end is a part of the stop string that was later cut
        shown = "".join(e.text for e in events[:-1])
        assert whole.startswith(shown) and len(shown) <= whole.find(stop)


def test_engine_stream_work_per_token_does_not_grow() -> None:
    class Counting:
        def __init__(self, tok) -> None:
            self.tok, self.decoded, self.most = tok, 0, 0

        def __len__(self) -> int:
            return len(self.tok)

        def decode(self, ids, **kwargs) -> str:
            self.decoded += len(ids)
            return self.tok.decode(ids, **kwargs)

    tok = Counting(make_tiny_tokenizer())
    ids = tok.tok.encode(TEXT * 40, add_special_tokens=False)
    session = ScriptedSession(ids, vocab=len(tok))
    work, before = [], 0
    for _ in stream_tokens(session, [1], SamplingParams(max_new_tokens=len(ids)), tok):
        work.append(tok.decoded - before)
        before = tok.decoded
    assert len(ids) > 1000 and max(work[:-1]) <= 16  # a whole-text decode would reach len(ids)


def test_held_back_for_stops() -> None:
    assert held_back_for_stops("xab", ("abc",)) == 2
    assert held_back_for_stops("xabc", ("abc",)) == 0  # a whole stop string is a hit, not held
    assert held_back_for_stops("xa", ("abc", "ab", "a")) == 1
    assert held_back_for_stops("x<tool", ("STOP", "<tool_call>")) == 5
    assert held_back_for_stops("ab", ("",)) == 0 and held_back_for_stops("", ("abc",)) == 0
    assert held_back_for_stops("aa", ("aab",)) == 2 and held_back_for_stops("a", ("aab",)) == 1


def test_first_stop_searches_only_where_a_new_stop_can_end() -> None:
    rng = random.Random(1)
    for _ in range(300):
        text = "".join(rng.choice("ab") for _ in range(rng.randint(0, 12)))
        stops = tuple("".join(rng.choice("ab") for _ in range(rng.randint(0, 3))) for _ in range(2))
        whole = first_stop(text, stops)
        # a prefix with no stop string in it need not be searched again
        clean = max((n for n in range(len(text) + 1) if first_stop(text[:n], stops) is None), default=0)
        assert first_stop(text, stops, searched=clean) == whole
        if whole is not None:
            assert whole == min(text.find(s) for s in stops if s and s in text)


def test_one_implementation_everywhere() -> None:
    # stop strings are held back once, in the SDK's turn decoder; the integrations' one chat turn
    # holds back a tool-call marker the same way
    import freetoken_agents._turn_text as sdk_turn_text
    import freetoken_agents.detokenize as sdk_detokenize
    import freetoken_agents.integrations.chat_turn as chat_turn

    assert sdk_detokenize.IncrementalDetokenizer is IncrementalDetokenizer
    assert sdk_turn_text.held_back_for_stops is held_back_for_stops
    assert chat_turn.held_back_for_stops is held_back_for_stops
