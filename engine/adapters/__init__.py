"""One adapter per Hugging Face architecture; `adapter_for(model_type)` picks it."""

from __future__ import annotations

from ..errors import UnsupportedModelError
from .base import Adapter
from .deepseek_v3 import DeepseekV3Adapter
from .gpt_oss import GptOssAdapter
from .mixtral import MixtralAdapter
from .olmoe import OlmoeAdapter
from .qwen_moe import QwenMoeAdapter

_ADAPTERS: tuple[Adapter, ...] = (
    MixtralAdapter(),
    QwenMoeAdapter(),
    OlmoeAdapter(),
    DeepseekV3Adapter(),
    GptOssAdapter(),
)
SUPPORTED_MODEL_TYPES: tuple[str, ...] = tuple(t for a in _ADAPTERS for t in a.model_types)


def adapter_for(model_type: str) -> Adapter:
    """The adapter for `model_type`; UnsupportedModelError listing the supported types otherwise."""
    for adapter in _ADAPTERS:
        if model_type in adapter.model_types:
            return adapter
    raise UnsupportedModelError(
        f"model_type '{model_type}' is not supported; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
    )


__all__ = ["Adapter", "SUPPORTED_MODEL_TYPES", "adapter_for"]
