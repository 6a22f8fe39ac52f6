"""Tokenization in linear time: the tokenizer's own ids for ordinary text; long whitespace-free
runs (quadratic in BPE: 40 kB of "x" took 10 s on the embedded tokenizer) handed over in slices,
never cutting a special token, decoding to the same text."""

from __future__ import annotations

import re

from freetoken_agents import default_model
from freetoken_agents.engine.ftw import FTWFile
from freetoken_agents.engine.loading.ftw_load import load_embedded_tokenizer
from freetoken_agents.engine.text.tokenize import MAX_RUN, encode, split_long_runs


class Recording:
    """A tokenizer that records the longest whitespace-free run it was asked to encode, between added
    tokens (the tokenizer splits at those before its BPE sees the text)."""

    def __init__(self, inner) -> None:
        self.inner, self.longest = inner, 0

    def _note(self, texts) -> None:
        added = "|".join(map(re.escape, self.inner.get_added_vocab()))
        for text in [texts] if isinstance(texts, str) else texts:
            runs = (len(r) for part in re.split(added, text) for r in re.findall(r"\S+", part))
            self.longest = max([self.longest, *runs])

    def encode(self, text, **kw):
        self._note(text)
        return self.inner.encode(text, **kw)

    def __call__(self, texts, **kw):
        self._note(texts)
        return self.inner(texts, **kw)

    def get_added_vocab(self):
        return self.inner.get_added_vocab()


def embedded_tokenizer():
    with FTWFile(default_model()) as f:
        return load_embedded_tokenizer(f)


def test_ordinary_text_gets_exactly_the_tokenizers_ids():
    tok = embedded_tokenizer()
    texts = [
        "Hello world, def add(a, b): return a + b",
        "<|im_start|>user\nWhat is 12 times 7?<|im_end|>\n<|im_start|>assistant\n",
        "tab\tand  double  spaces\n\nlines " + "word " * 2000,
        "y" * MAX_RUN,  # a run of exactly the limit is not cut
    ]
    for text in texts:
        assert encode(tok, text) == tok.encode(text, add_special_tokens=False)


def test_a_long_run_is_tokenized_in_slices_that_decode_to_the_same_text():
    tok = Recording(embedded_tokenizer())
    text = "result: " + "x" * (20 * MAX_RUN + 7) + " and " + "ab" * (3 * MAX_RUN) + " done"
    ids = encode(tok, text)
    assert tok.longest <= MAX_RUN  # no run longer than MAX_RUN reached the tokenizer at once
    assert tok.inner.decode(ids) == text


def test_a_cut_never_splits_a_special_token():
    tok = embedded_tokenizer()
    special = "<|im_end|>"
    run = "q" * (MAX_RUN - 3) + special + "q" * (2 * MAX_RUN)  # the token straddles the first cut
    pieces = split_long_runs(run, (special,))
    assert "".join(pieces) == run and all(special not in p or p.count(special) == 1 for p in pieces)
    assert any(special in p for p in pieces)
    assert tok.convert_tokens_to_ids(special) in encode(tok, run)
