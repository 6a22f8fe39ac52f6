"""Start training from an existing FTW file (the shipped model): its tokenizer and weights as a
transformers Qwen3-MoE, so new skills are taught on top of what it knows instead of from scratch.

The FTW holds dense tensors under the engine's names (`layers.L.mlp.router.weight`, ...) and each
expert's `gate_up` [2 * moe_intermediate, hidden] and `down` [hidden, moe_intermediate] matrices;
transformers stacks the experts as `mlp.experts.gate_up_proj` / `down_proj` [experts, out, in].
The round trip is checked in tests/test_tiny_generic.py (same logits as the engine).
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

import torch

from freetoken_agents.engine.ftw.reader import FTWFile


def _hf_name(name: str) -> str:
    return "model." + name.replace(".mlp.router.", ".mlp.gate.")


def load_ftw(path: Path, max_position_embeddings: int | None = None) -> tuple[Any, Any]:
    """(model, tokenizer) from an FTW file: a float32 transformers model with the file's weights."""
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast, Qwen3MoeConfig

    with FTWFile(path) as ftw:
        config = dict(ftw.model_config)
        if config.get("model_type") != "qwen3_moe":
            raise ValueError(f"{path}: --init needs a qwen3_moe FTW file, not {config.get('model_type')!r}")
        if max_position_embeddings:
            config["max_position_embeddings"] = max_position_embeddings
        for key in ("architectures", "transformers_version", "dtype", "model_type"):
            config.pop(key, None)
        config["num_experts"] = config.pop("num_local_experts", config.get("num_experts"))
        model = AutoModelForCausalLM.from_config(
            Qwen3MoeConfig(**config), experts_implementation="eager", attn_implementation="sdpa"
        )
        state = {_hf_name(n): ftw.dense(n).float() for n in ftw.dense_names()}
        layers, experts = config["num_hidden_layers"], config["num_experts"]
        for layer in range(layers):
            decoded = [ftw.decode_expert(layer, e) for e in range(experts)]
            prefix = f"model.layers.{layer}.mlp.experts."
            state[prefix + "gate_up_proj"] = torch.stack([d["gate_up"] for d in decoded]).float()
            state[prefix + "down_proj"] = torch.stack([d["down"] for d in decoded]).float()
        missing, unexpected = model.load_state_dict(state, strict=False)
        if unexpected or set(missing) - {"lm_head.weight"}:
            raise ValueError(
                f"{path}: weights do not match the model (missing {missing}, extra {unexpected})"
            )
        model.tie_weights()
        with tempfile.TemporaryDirectory() as tmp:
            for name, data in ftw.tokenizer_files.items():
                (Path(tmp) / name).write_bytes(data)
            tokenizer = PreTrainedTokenizerFast.from_pretrained(tmp)
            limit = json.loads((Path(tmp) / "tokenizer_config.json").read_text()).get("model_max_length")
    if max_position_embeddings and (limit or 0) < max_position_embeddings:
        tokenizer.model_max_length = max_position_embeddings
    return model, tokenizer
