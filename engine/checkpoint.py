"""Reading a Hugging Face checkpoint folder: config.json and memory-mapped safetensors.

Never unpickles anything: only `*.safetensors` files are read.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from .errors import CheckpointError


def read_config(folder: Path) -> dict:
    """The parsed config.json of a checkpoint folder."""
    path = folder / "config.json"
    if not folder.is_dir():
        raise CheckpointError(
            f"checkpoint folder {folder} does not exist (expected a folder with config.json)"
        )
    if not path.is_file():
        raise CheckpointError(f"{folder} has no config.json: not a Hugging Face checkpoint folder")
    try:
        config = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"cannot parse {path}: {e}") from e
    if not isinstance(config, dict) or "model_type" not in config:
        raise CheckpointError(f"{path} has no 'model_type' field")
    return config


class SafetensorsCheckpoint:
    """Name -> tensor lookup across all safetensors shards of a folder (lazy, mmapped)."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        files = sorted(folder.glob("*.safetensors"))
        if not files:
            raise CheckpointError(
                f"{folder} has no *.safetensors files (pickled .bin checkpoints are not loaded, by design)"
            )
        self._handles = []
        self._where: dict[str, int] = {}
        for path in files:
            try:
                handle = safe_open(str(path), framework="pt")
            except (SafetensorError, OSError) as e:
                raise CheckpointError(f"cannot open {path}: {e}") from e
            self._handles.append(handle)
            for name in handle.keys():
                self._where[name] = len(self._handles) - 1

    def names(self) -> list[str]:
        return sorted(self._where)

    def has(self, name: str) -> bool:
        return name in self._where

    def get(self, name: str) -> torch.Tensor:
        """The tensor called `name`; CheckpointError naming it when the checkpoint lacks it."""
        index = self._where.get(name)
        if index is None:
            raise CheckpointError(f"checkpoint {self.folder} is missing tensor '{name}'")
        try:
            return self._handles[index].get_tensor(name)
        except SafetensorError as e:
            raise CheckpointError(f"cannot read tensor '{name}' from {self.folder}: {e}") from e
