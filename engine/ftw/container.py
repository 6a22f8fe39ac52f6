"""The FTW container: one file per model holding dense tensors and independently readable expert blocks.

The byte layout is documented in `layout.py`; `FTWWriter` (in `writer.py`) streams a file and
`FTWFile` (in `reader.py`) opens, validates and reads it. This module is the public entry point.
"""

from __future__ import annotations

from .layout import (
    ALIGNMENT,
    BLOCK_HEADER_SIZE,
    FORMAT_MAJOR,
    FORMAT_MINOR,
    DenseInfo,
    ExpertInfo,
    PartInfo,
    TensorInfo,
)
from .reader import FTWFile
from .writer import FTWWriter

__all__ = [
    "ALIGNMENT",
    "BLOCK_HEADER_SIZE",
    "FORMAT_MAJOR",
    "FORMAT_MINOR",
    "DenseInfo",
    "ExpertInfo",
    "FTWFile",
    "FTWWriter",
    "PartInfo",
    "TensorInfo",
]
