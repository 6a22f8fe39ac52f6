"""Peers for bench/decode.py: llama.cpp on the same f32 weights, and a FreeToken engine loaded
from another checkout (the "before" of a change, side by side in one run).

llama.cpp: `llama_cpp` (llama-cpp-python) runs the model; the weights go through llama.cpp's own
HF -> GGUF converter, `convert_hf_to_gguf.py`, which llama-cpp-python ships in its sdist
(`vendor/llama.cpp/convert_hf_to_gguf.py`, next to `gguf-py/` and `conversion/`) but not in the
installed package: pass the script's path (`--llama-convert`, or FT_LLAMA_CONVERT). The converter
wants a tokenizer, so a llama-style BPE `tokenizer.json` with the model's vocab size is written
beside the random weights, and it imports `sentencepiece` even when the model has no
sentencepiece file. Every reason a peer cannot run is reported in one line.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

GGML_TYPE_F32 = 0  # ggml_type of an f32 KV cache (llama.cpp's default is f16)


def write_llama_tokenizer(folder: Path, vocab_size: int) -> None:
    """A llama-style byte-fallback BPE tokenizer with exactly `vocab_size` tokens (no merges: the
    bench feeds token ids, the converter only needs a vocabulary)."""
    from tokenizers import Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(["<unk>", "<s>", "</s>"])}
    vocab.update({f"<0x{b:02X}>": len(vocab) + b for b in range(256)})
    for i in range(vocab_size - len(vocab)):
        vocab[f"\u2581w{i}"] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    tok.decoder = decoders.Sequence(
        [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(folder)


def llama_cpp_peer(folder: Path, converter: str | None, threads: int, n_ctx: int) -> tuple[Any, str]:
    """(a `llama_cpp.Llama` on `folder`'s weights converted to f32 GGUF, "") or (None, why not)."""
    if importlib.util.find_spec("llama_cpp") is None:
        return None, "llama.cpp: not measured: llama_cpp is not importable (pip install llama-cpp-python)"
    script = converter or os.environ.get("FT_LLAMA_CONVERT")
    if not script or not Path(script).is_file():
        return None, (
            "llama.cpp: not measured: llama_cpp imports but does not install its GGUF converter; pass "
            "--llama-convert PATH/convert_hf_to_gguf.py (vendor/llama.cpp/ of the llama-cpp-python sdist)"
        )
    if importlib.util.find_spec("sentencepiece") is None:
        return (
            None,
            "llama.cpp: not measured: its converter imports sentencepiece (pip install sentencepiece)",
        )
    gguf = folder / "model-f32.gguf"
    cmd = [sys.executable, script, str(folder), "--outtype", "f32", "--outfile", str(gguf)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        last = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
        return None, f"llama.cpp: not measured: convert_hf_to_gguf.py failed: {last[0]}"
    from llama_cpp import Llama

    llm = Llama(
        model_path=str(gguf),
        n_ctx=n_ctx,
        n_batch=512,
        n_threads=threads,
        n_threads_batch=threads,
        type_k=GGML_TYPE_F32,  # the same KV bytes as FreeToken's fp32 cache
        type_v=GGML_TYPE_F32,
        logits_all=True,
        verbose=False,
    )
    return llm, ""


def llama_logits(llm: Any, tokens: list[int]) -> Any:
    """llama.cpp's logits [T, V] (numpy) for `tokens` from an empty context."""
    import numpy as np

    llm.reset()
    llm.eval(tokens)
    return np.array(llm.scores[: len(tokens)])


def load_engine_module(tree: Path) -> types.ModuleType:
    """The `engine` package of another FreeToken checkout, imported as `ftbaseline.engine` (its
    modules import each other relatively, so it runs beside this checkout's engine)."""
    init = tree / "engine" / "__init__.py"
    if not init.is_file():
        raise SystemExit(f"--baseline-tree {tree}: no engine/__init__.py there")
    root = types.ModuleType("ftbaseline")
    root.__path__ = []  # a namespace parent for the relative imports
    sys.modules["ftbaseline"] = root
    spec = importlib.util.spec_from_file_location(
        "ftbaseline.engine", init, submodule_search_locations=[str(init.parent)]
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["ftbaseline.engine"] = module
    spec.loader.exec_module(module)
    return module
