"""The names engine options accept, in a module that imports nothing heavy (no torch): the
command-line flags (`flags.py`, `freetoken convert`) offer them as choices while building their
parsers, so `freetoken --help` answers without loading torch or transformers (issue 65).

The modules that act on these names (`options`, `int8`, `loading.convert`) import them from here.
"""

from __future__ import annotations

from typing import Literal, get_args

Placement = Literal["auto", "resident", "qstar", "stream"]
PLACEMENTS: tuple[str, ...] = get_args(Placement)
"""Where experts go (`EngineOptions.placement`; the module doc of `options` says what each does)."""

ExpertQuant = Literal["auto", "int8", "compact", "none"]
EXPERT_QUANTS: tuple[ExpertQuant, ...] = get_args(ExpertQuant)
"""`Engine.from_pretrained(expert_quant=...)` values:
``auto`` keep projections stored as int8 (FTW ``int8`` codec) in int8 and decode every other
codec to the engine dtype (an HF checkpoint or an fp32/bf16 FTW file runs exactly as before);
``int8`` hold every expert projection in int8 (quantizing float / other codecs at load);
``compact`` as ``auto``, and also keep projections stored as MXFP4 in their 4-bit form
(`mxfp4.py`: a GEMV kernel on CUDA, a transient decode elsewhere);
``none`` decode every stored codec, int8 included, to the engine dtype (the pre-int8 behaviour)."""

QUANT_CODECS: dict[str, str] = {
    "fp32": "fp32",
    "bf16": "bf16",
    "fp8": "fp8_e4m3",
    "int8": "int8",
    "mxfp4": "mxfp4",
    "int8_b32": "int8_b32",
    "uint4_b32": "uint4_b32",
}
"""``freetoken convert --quant`` value -> expert codec (``auto`` picks per expert)."""
QUANTS: tuple[str, ...] = (*QUANT_CODECS, "auto")
"""`convert_checkpoint(quant=...)` values."""
CODECS: tuple[str, ...] = tuple(dict.fromkeys(QUANT_CODECS.values()))
"""The expert codecs (`codecs.CODECS`, whose registry needs torch; a test keeps the two equal)."""
GGUF_SOURCE = "source"
"""The GGUF converter's quant that keeps each tensor's stored precision (`loading.gguf.SOURCE`;
a test keeps the two equal)."""
SIMULATION_POLICIES: tuple[str, ...] = (
    "qstar",
    "qstar-profiled",
    "layer-lru",
    "static",
    "static-layers",
    "stream",
    "belady",
)
"""The expert policies `freetoken simulate --policies` replays (`simulate.simulator.POLICIES`, whose
module needs torch; a test keeps the two equal)."""
