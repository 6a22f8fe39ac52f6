"""The tokenizer and chat template a GGUF file describes, as the files an FTW manifest embeds.

A GGUF has no tokenizer.json: the vocabulary, merges, special ids and the chat template are
metadata (``tokenizer.ggml.*``, ``tokenizer.chat_template``). transformers builds the tokenizer from
them (`PreTrainedTokenizerFast.from_pretrained(folder, gguf_file=name)`, the same builder as
`AutoTokenizer(..., gguf_file=...)`); its ``save_pretrained`` files (tokenizer.json,
tokenizer_config.json, chat_template.jinja) go into the FTW file like an HF folder's, plus a
generation_config.json whose ``eos_token_id`` lists llama.cpp's end-of-generation ids, so that
`stop_tokens.read_generation_eos` ends turns on every one of them.
"""

from __future__ import annotations

import json
import logging
import tempfile
from pathlib import Path

from .config import eos_ids
from .reader import GGUFSource

logger = logging.getLogger(__name__)

#: ``tokenizer.ggml.pre`` -> the pre-tokenizer splits (isolated, in order) that transformers' GGUF
#: builder lacks: DeepSeek-V3 / R1's (its tokenizer.json; llama.cpp's DEEPSEEK3_LLM pre-tokenizer)
_SPLITS: dict[str, tuple[str, ...]] = {
    "deepseek-v3": (
        r"\p{N}{1,3}",
        "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+",
        r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
        r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    ),
}


def tokenizer_files(src: GGUFSource) -> dict[str, bytes]:
    """``{file name: bytes}`` to embed: the tokenizer built from the metadata (none, with a warning,
    when transformers cannot build it: the model then runs on token ids) and generation_config.json."""
    files: dict[str, bytes] = {}
    eos = eos_ids(src)
    if eos:
        files["generation_config.json"] = json.dumps({"eos_token_id": eos}, indent=2).encode()
    if src.array_length("tokenizer.ggml.tokens") is None:
        logger.warning("%s: GGUF metadata has no tokenizer; the model runs on token ids only", src.path)
        return files
    from transformers import PreTrainedTokenizerFast

    # from a private metadata-only copy: transformers maps the file it reads, and the user's file
    # may be truncated while it converts (a SIGBUS in there, not an error)
    with tempfile.TemporaryDirectory(prefix="gguf-metadata-") as tmp:
        (Path(tmp) / src.path.name).write_bytes(src.metadata_only())
        try:
            tok = PreTrainedTokenizerFast.from_pretrained(tmp, gguf_file=src.path.name)
        except Exception as e:  # transformers raises ValueError, KeyError, ... for what it cannot build
            logger.warning(
                "%s: cannot build the GGUF tokenizer (%s); the model runs on token ids only", src.path, e
            )
            return files
    splits = _SPLITS.get(src.get("tokenizer.ggml.pre", ""))
    if splits is not None:
        from tokenizers import Regex, pre_tokenizers

        steps = [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in splits]
        steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False))
        tok.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(steps)
    with tempfile.TemporaryDirectory(prefix="gguf-tokenizer-") as tmp:
        tok.save_pretrained(tmp)
        for path in sorted(Path(tmp).iterdir()):
            if path.is_file():
                files[path.name] = path.read_bytes()
    return files
