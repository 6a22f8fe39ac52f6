"""Reading a Hugging Face checkpoint folder: config.json and memory-mapped safetensors.

The one config loader: `read_config` parses a folder's config.json, `config_from_dict` builds the
transformers config from that dict (or from the one an FTW file embeds, or a GGUF file's metadata
maps to), so every model source gets its config the same way.

Never unpickles anything: only `*.safetensors` files are read.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import SafetensorError, safe_open

from .errors import CheckpointError
from .spec_checks import check_config, check_raw_config

if TYPE_CHECKING:
    from transformers import PretrainedConfig


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
    except RecursionError:  # nested deeper than the parser's stack: hostile, not a config
        raise CheckpointError(f"cannot parse {path}: JSON nested too deeply") from None
    except (OSError, ValueError) as e:  # JSONDecodeError, bad UTF-8, a 5000-digit integer...
        raise CheckpointError(f"cannot parse {path}: {' '.join(str(e).split())[:200]}") from None
    if not isinstance(config, dict):
        raise CheckpointError(f"{path} holds a JSON {type(config).__name__}, not an object")
    if "model_type" not in config:
        raise CheckpointError(f"{path} has no 'model_type' field")
    check_raw_config(config, str(path))
    return config


def config_from_dict(config: Mapping[str, Any], where: str = "model config") -> PretrainedConfig:
    """A transformers config from a config.json dict, as `AutoConfig.from_pretrained` builds it from
    the folder (less ``name_or_path``, which the engine does not read). The hyper-parameters are
    checked first (`spec_checks`): CheckpointError naming `where` and the key for a bad value,
    or for a config transformers refuses; KeyError for a model_type transformers does not know."""
    from transformers import CONFIG_MAPPING

    check_raw_config(config, where)
    cls = CONFIG_MAPPING[config["model_type"]]
    try:
        built = cls.from_dict(dict(config))
    except Exception as e:  # noqa: BLE001 - strict-dataclass, Value, Type errors... all mean "refused"
        why = " ".join(f"{type(e).__name__}: {e}".split())[:200]
        raise CheckpointError(f"{where}: transformers refuses this config ({why})") from None
    check_config(built, where)  # the values with transformers' defaults filled in, and their relations
    return built


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
