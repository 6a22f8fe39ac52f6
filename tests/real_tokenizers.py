"""Real tokenizers for tests, from packages on the index (never vendored):

- Qwen's byte-level BPE (vocabulary, merges, pre-tokenizer, `<|im_start|>`...): the
  `ggml-vocab-qwen2.gguf` of the llama-cpp-python sdist (`real_templates.real_vocab`), read by
  `transformers`' own GGUF tokenizer conversion; Qwen3 keeps that BPE and adds `<think>`,
  `<tool_call>`, `<tool_response>` and their closers as added (not special) tokens, as its
  tokenizer_config.json declares them.
- Mistral Nemo's Tekken (`tekken_240718.json`, the file Mistral-Nemo-Instruct-2407 ships), which
  the `mistral-common` package carries, read by `transformers`' Tekken conversion.
- The 32k Llama SentencePiece vocabulary (`ggml-vocab-llama-spm.gguf` of the same sdist; Mistral-7B
  and Mixtral's 32k vocabulary is built the same way: a BPE over "▁"-spaced text with a dummy "▁"
  prefix), in the three layouts tokenizer.json files give the dummy prefix: a Metaspace
  pre-tokenizer with prepend_scheme "first" (the prefix only at the start of the whole text, what
  transformers converts to), one with "always" (at the start of every text between added tokens),
  and the legacy `Prepend("▁")` normalizer; each with the control tokens of every chat template
  family of the tests added as special tokens, so any real template's markup is control tokens.
- gpt-oss's o200k_harmony and DeepSeek-V3's vocabulary are on no package of the index: those
  families get a real BPE (Qwen's, DeepSeek-LLM's from the same sdist) with their own control
  tokens added as their tokenizers declare them, so the template's markup tokenizes as it does in
  the real tokenizer (one id per control token) while the text between is a real BPE's.

Each is converted once and kept, `save_pretrained`, in the tests' cache.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
from real_templates import CACHE, real_vocab
from tokenizers import AddedToken

QWEN3_ADDED = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>")
HARMONY_SPECIAL = (
    "<|startoftext|>",
    "<|return|>",
    "<|constrain|>",
    "<|channel|>",
    "<|start|>",
    "<|end|>",
    "<|message|>",
    "<|call|>",
)
DEEPSEEK_V3_ADDED = (
    "<｜User｜>",
    "<｜Assistant｜>",
    "<think>",
    "</think>",
    "<｜tool▁calls▁begin｜>",
    "<｜tool▁calls▁end｜>",
    "<｜tool▁call▁begin｜>",
    "<｜tool▁call▁end｜>",
    "<｜tool▁outputs▁begin｜>",
    "<｜tool▁outputs▁end｜>",
    "<｜tool▁output▁begin｜>",
    "<｜tool▁output▁end｜>",
    "<｜tool▁sep｜>",
)
MISTRAL_CONTROL = (
    "[INST]",
    "[/INST]",
    "[TOOL_CALLS]",
    "[AVAILABLE_TOOLS]",
    "[/AVAILABLE_TOOLS]",
    "[TOOL_RESULTS]",
    "[/TOOL_RESULTS]",
    "[TOOL_CONTENT]",
    "[SYSTEM_PROMPT]",
    "[/SYSTEM_PROMPT]",
    "[CALL_ID]",
    "[ARGS]",
    "[THINK]",
    "[/THINK]",
)
CHATML = ("<|im_start|>", "<|im_end|>", "<|endoftext|>")
SPM = {"llama-spm": "first", "llama-spm-always": "always", "llama-spm-legacy": "legacy"}
"""The SentencePiece tokenizers by name, with the layout of their dummy prefix."""
NAMES = ("qwen3", "mistral-nemo", "gpt-oss", "deepseek-v3", *SPM)


def real_tokenizer(name: str) -> Any:
    """A fresh `transformers` tokenizer object for `name` (one of NAMES), without a chat template."""
    from transformers import AutoTokenizer

    folder = CACHE / "tokenizers" / name
    if not (folder / "tokenizer.json").is_file():
        tokenizer = _build(name)
        tmp = folder.with_name(folder.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tokenizer.save_pretrained(tmp)
        shutil.rmtree(folder, ignore_errors=True)
        tmp.rename(folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.chat_template = None
    return tokenizer


def _build(name: str) -> Any:
    if name == "mistral-nemo":
        return _tekken("tekken_240718.json")
    if name in SPM:
        return _sentencepiece(SPM[name])
    if name == "deepseek-v3":
        tokenizer = _from_vocab(real_vocab("ggml-vocab-deepseek-llm.gguf"))
        tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in DEEPSEEK_V3_ADDED])
        return tokenizer
    tokenizer = _from_vocab(real_vocab("ggml-vocab-qwen2.gguf"))
    if name == "qwen3":
        tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in QWEN3_ADDED])
    elif name == "gpt-oss":
        tokenizer.add_special_tokens({"additional_special_tokens": list(HARMONY_SPECIAL)})
    else:
        raise ValueError(f"no real tokenizer named {name!r}; known: {', '.join(NAMES)}")
    return tokenizer


def _sentencepiece(scheme: str) -> Any:
    """The Llama SPM vocabulary with its dummy prefix laid out as `scheme` ("first", "always",
    "legacy") and every family's control tokens."""
    from tokenizers import Tokenizer, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    converted = _from_vocab(real_vocab("ggml-vocab-llama-spm.gguf"))  # Metaspace, "first"
    backend = Tokenizer.from_str(converted.backend_tokenizer.to_str())
    if scheme == "legacy":
        backend.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
        backend.pre_tokenizer = None
    else:
        backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme=scheme, split=False)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    control = (*MISTRAL_CONTROL, *CHATML, *QWEN3_ADDED, *HARMONY_SPECIAL, *DEEPSEEK_V3_ADDED)
    tokenizer.add_special_tokens({"additional_special_tokens": list(dict.fromkeys(control))})
    return tokenizer


def _from_vocab(path: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


def _tekken(file: str) -> Any:
    try:
        import mistral_common
        from transformers.integrations.mistral import convert_tekken_tokenizer
    except ImportError as e:
        pytest.skip(f"Mistral's Tekken tokenizer needs mistral-common: {e}")
    path = Path(mistral_common.__file__).parent / "data" / file
    if not path.is_file():
        pytest.skip(f"{file} is not in mistral-common {mistral_common.__version__}")
    return convert_tekken_tokenizer(str(path))
