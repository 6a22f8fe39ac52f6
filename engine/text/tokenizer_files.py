"""The files of a checkpoint folder that make its tokenizer: one list for every path that reads,
fetches, embeds or fingerprints them (the HF-folder and FTW loaders, the Hub download, the FTW
conversion and its cache key, the anchors' model fingerprint).

A file missing from a copy of this list used to be a bug: the anchors' fingerprint did not hash
``added_tokens.json``, so a changed added-tokens file kept saved anchors valid for another tokenizer.
"""

from __future__ import annotations

TOKENIZER_FILES: tuple[str, ...] = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
)
"""Every tokenizer file `AutoTokenizer.from_pretrained` may read from a folder (it reads the ones
present). The anchors' fingerprint hashes them in this order: reordering changes fingerprints.
generation_config.json is not one (the FTW conversion embeds it too: `ftw.convert.EMBEDDED_FILES`)."""

TOKENIZER_MARKERS: tuple[str, ...] = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "vocab.json",
)
"""The files that prove a tokenizer exists (a vocabulary, or the config naming the tokenizer class):
without one of them a model runs on token ids and no tokenizer is built. The others only add to a
tokenizer (merges, special and added tokens, the chat template)."""
