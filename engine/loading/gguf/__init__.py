"""GGUF files (llama.cpp / Ollama weights) as a model source: converted once to FTW, then loaded.

- `layout`: the file's structure parsed with bounded plain reads, every count, length, dim and
  offset checked against the file size first (no memory map: a truncated file is an error).
- `reader`: `GGUFSource`, the metadata and tensors (read on demand) of a GGUF model (split files
  too), every failure turned into a one-line `CheckpointError` naming the file.
- `config`: metadata -> the Hugging Face config of the model (qwen3moe, qwen2moe, llama with
  experts = Mixtral, olmoe, gpt-oss, deepseek2 = DeepSeek-V3).
- `deepseek2`: DeepSeek-V3 / R1 / Kimi-K2 files: MLA metadata, sigmoid group-limited routing,
  ``kv_b_proj`` whole or split into ``attn_k_b`` / ``attn_v_b`` (rebuilt exactly).
- `tensors`: engine weight -> GGUF tensor (gguf-py's name map, llama q/k un-permuted), experts per
  layer in their kept codecs.
- `quants`: GGUF blocks -> FTW codecs with the exact values (Q8_0 -> int8_b32, Q4_0/Q4_1/Q4_K ->
  uint4_b32, MXFP4 -> mxfp4, other types dequantized to fp32).
- `tokenizer`: tokenizer files, chat template and end-of-generation ids from ``tokenizer.*``.
- `convert`: `convert_gguf`, the FTW writer (`freetoken convert x.gguf out.ftw`);
  `loading.cache.cached_ftw` keeps one conversion per GGUF file for `Engine.from_pretrained("x.gguf")`.
"""

from __future__ import annotations

from .convert import GGUF_QUANTS, SOURCE, convert_gguf
from .reader import GGUFSource, gguf_parts, is_gguf_path

__all__ = ["GGUF_QUANTS", "GGUFSource", "SOURCE", "convert_gguf", "gguf_parts", "is_gguf_path"]
