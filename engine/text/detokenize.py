"""Incremental detokenisation: the text of a growing token sequence at O(1) tokenizer work per token.

Decoding the whole sequence after every token (what a naive streamer does) costs O(n) per token,
O(n^2) per turn. `IncrementalDetokenizer` decodes only a short window: the text of
`ids[prefix:]` minus the text of `ids[prefix:read]`, the method vLLM and TGI use. Decoding from a
few tokens back keeps merges right (SentencePiece's leading-space rule, byte-level BPE pieces); a
trailing U+FFFD (a multi-byte character split over tokens) is held back until a later token
completes it, or until `flush()`.

It lives in the engine (the bottom layer) so the engine's own stream and the SDK's turn decoder
use the same code; `freetoken_agents.detokenize` re-exports it.
"""

from __future__ import annotations

from bisect import bisect_right
from typing import Any

REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """The stable text of the tokens pushed so far. `text` only grows (until `truncate`)."""

    def __init__(self, tokenizer: Any, *, skip_special_tokens: bool = False) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self.text = ""
        self._prefix = 0  # decoding window start (token index)
        self._read = 0  # tokens whose text is already in `self.text`
        # After each token: (window start, read offset, len(text)), so `truncate` is exact.
        self._states: list[tuple[int, int, int]] = []

    def __len__(self) -> int:
        return len(self.ids)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def push(self, token_id: int) -> str:
        """Add one token; returns the text it made stable (may be empty, or hold earlier text)."""
        self.ids.append(token_id)
        prefix_text = self._decode(self.ids[self._prefix : self._read])
        new_text = self._decode(self.ids[self._prefix :])
        delta = ""
        if len(new_text) > len(prefix_text) and not new_text.endswith(REPLACEMENT):
            delta = new_text[len(prefix_text) :]
            self.text += delta
            self._prefix, self._read = self._read, len(self.ids)
        self._states.append((self._prefix, self._read, len(self.text)))
        return delta

    def extend(self, token_ids: list[int]) -> str:
        """`push` each of `token_ids`; the concatenated deltas."""
        return "".join(self.push(t) for t in token_ids)

    def flush(self) -> str:
        """Text held back (an incomplete character at the end), decoded as is; ends the stream."""
        rest = self._decode(self.ids[self._prefix :])[
            len(self._decode(self.ids[self._prefix : self._read])) :
        ]
        self.text += rest
        self._prefix = self._read = len(self.ids)
        if self._states:
            self._states[-1] = (self._prefix, self._read, len(self.text))
        return rest

    def text_length_after(self, n_tokens: int) -> int:
        """Length of the stable text after the first `n_tokens` tokens."""
        return self._states[n_tokens - 1][2] if n_tokens > 0 else 0

    def tokens_within(self, n_chars: int) -> int:
        """The most leading tokens whose stable text fits in `n_chars` characters."""
        return bisect_right([s[2] for s in self._states], n_chars)

    def truncate(self, n_tokens: int) -> None:
        """Keep the first `n_tokens` tokens (the state is exactly as it was after pushing them)."""
        if n_tokens >= len(self.ids):
            return
        self.ids = self.ids[:n_tokens]
        self._states = self._states[:n_tokens]
        self._prefix, self._read, length = self._states[-1] if self._states else (0, 0, 0)
        self.text = self.text[:length]
