"""Incremental detokenisation: the streamed text equals a whole decode, multi-byte characters split
over tokens are held back until complete, truncation restores an earlier state exactly, and the
tokenizer work per token does not grow with the text."""

from __future__ import annotations

import random

import pytest
from tiny_models import make_tiny_tokenizer

from freetoken_agents import default_model
from freetoken_agents.detokenize import IncrementalDetokenizer
from freetoken_agents.engine import Engine

TEXTS = [
    "Hello there, the weather in Paris is sunny. 12 times 7 is 84.",
    "Unicode: 你好啊集团, こんにちは, café, naïve, emoji 🙂 done.",
    '<tool_call>\n{"name": "f", "arguments": {"x": "é"}}\n</tool_call>',
    "```python\ndef f(x):\n    return x + 1\n```\n",
]


@pytest.fixture(scope="module")
def tokenizers() -> list:
    embedded = Engine.from_pretrained(default_model()).tokenizer
    return [make_tiny_tokenizer(), embedded]


def test_streamed_text_equals_a_whole_decode(tokenizers: list) -> None:
    for tok in tokenizers:
        for text in TEXTS:
            ids = tok.encode(text, add_special_tokens=False)
            detok = IncrementalDetokenizer(tok)
            streamed = "".join(detok.push(t) for t in ids) + detok.flush()
            assert streamed == tok.decode(ids, skip_special_tokens=False) == detok.text


def test_random_token_sequences(tokenizers: list) -> None:
    """Arbitrary ids (byte pieces that never form valid UTF-8 included): the stable text is
    always a prefix of the whole decode, and flush completes it."""
    rng = random.Random(0)
    for tok in tokenizers:
        for _ in range(30):
            ids = [rng.randrange(len(tok)) for _ in range(rng.randint(1, 60))]
            detok = IncrementalDetokenizer(tok)
            for i, t in enumerate(ids):
                detok.push(t)
                whole = tok.decode(ids[: i + 1], skip_special_tokens=False)
                assert whole.startswith(detok.text)
            detok.flush()
            assert detok.text == tok.decode(ids, skip_special_tokens=False)


def test_multibyte_characters_are_held_back_until_complete() -> None:
    tok = make_tiny_tokenizer()
    ids = tok.encode("好", add_special_tokens=False)
    assert len(ids) > 1  # byte-level pieces of one character
    detok = IncrementalDetokenizer(tok)
    deltas = [detok.push(t) for t in ids]
    assert deltas[:-1] == [""] * (len(ids) - 1) and deltas[-1] == "好"


def test_truncate_restores_the_state_after_that_many_tokens(tokenizers: list) -> None:
    for tok in tokenizers:
        ids = tok.encode(TEXTS[1], add_special_tokens=False)
        for n in (0, 1, len(ids) // 2, len(ids) - 1):
            detok = IncrementalDetokenizer(tok)
            detok.extend(ids)
            detok.truncate(n)
            fresh = IncrementalDetokenizer(tok)
            fresh.extend(ids[:n])
            assert (detok.ids, detok.text) == (fresh.ids, fresh.text)
            assert detok.extend(ids[n:]) + detok.flush() == fresh.extend(ids[n:]) + fresh.flush()
            assert detok.text == tok.decode(ids)
            assert detok.tokens_within(detok.text_length_after(n)) >= n


class CountingTokenizer:
    """Wraps a tokenizer, counting the token ids it is asked to decode."""

    def __init__(self, tok) -> None:
        self.tok, self.decoded = tok, 0

    def decode(self, ids, **kwargs) -> str:
        self.decoded += len(ids)
        return self.tok.decode(ids, **kwargs)


def test_work_per_token_does_not_grow_with_the_text() -> None:
    tok = CountingTokenizer(make_tiny_tokenizer())
    ids = tok.tok.encode(" ".join(TEXTS) * 20, add_special_tokens=False)
    detok = IncrementalDetokenizer(tok)
    work = []
    for t in ids:
        before = tok.decoded
        detok.push(t)
        work.append(tok.decoded - before)
    assert len(ids) > 1000 and max(work) <= 16  # a whole-text decode would reach len(ids)
