"""What the recipes share: loading the model (the embedded default or `--model PATH`) and the
writer they print through (the CLI's stdout; tests pass their own)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

from freetoken_agents import FreeTokenModel, default_model

Write = Callable[[str], None]
"""Where recipe output goes: text in, nothing out (lines end with their own newline)."""


def stdout_write(text: str) -> None:
    """The CLI's writer: stdout, flushed at once so streamed text shows as it comes."""
    sys.stdout.write(text)
    sys.stdout.flush()


def model_path(path: str | Path | None) -> Path:
    """`path`, or the embedded model's when None (EmbeddedModelMissing if it is not installed)."""
    return Path(path) if path is not None else default_model()


def load_model(path: str | Path | None = None) -> FreeTokenModel:
    """A FreeTokenModel over `path` (an HF checkpoint folder or an .ftw file; default: embedded)."""
    return FreeTokenModel.from_pretrained(model_path(path))


def add_model_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        default=None,
        metavar="PATH",
        help="Hugging Face checkpoint folder or .ftw file (default: the embedded model)",
    )
