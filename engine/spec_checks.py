"""Hyper-parameter checks: every value a model config gives the engine, against sane ranges, against
the other values and against the tensors the checkpoint holds, before anything is built from it.

A hostile or garbled config must end in one `CheckpointError` line naming the source, the key and
the bad value, never in a loop over 2**31 layers, a 4 GiB allocation, a raw traceback from deep in
transformers or torch, or a model that silently answers wrong (0 layers, 0 experts, NaN rotary
frequencies). Every source goes through here:

- `check_raw_config`: the config.json dict as read (a folder's config.json, an FTW manifest's
  config, the fields a GGUF file's metadata maps to), before transformers sees it: types and ranges
  of the keys present. Its config classes loop over ``num_hidden_layers`` in ``__init__`` and refuse
  wrong types with exceptions of their own, so this runs first.
- `check_config`: the transformers config as built (defaults filled in): the same rules on the
  values the adapters read, plus the relations between them (heads divide the hidden size, top-k
  within the experts, groups divide the experts...). `Adapter.build_spec` runs it, so no spec is
  built from an unchecked config.
- `check_layer_count`: the layer count against the layer tensors found.
- `check_value`: one value against one rule (the GGUF metadata check uses it under GGUF key names).

The caps are far above any released model (DeepSeek-V3: 61 layers, hidden 7168, 256 experts) and
far below what would exhaust memory: nothing is allocated from the config before the checkpoint's
tensors are compared with it (the model is built on the meta device), except the rotary
frequencies (``head_dim / 2`` floats), which the head size cap bounds.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from .errors import CheckpointError

MAX_LAYERS = 1024
MAX_HIDDEN = 1 << 17
MAX_FFN = 1 << 20
MAX_HEADS = 4096
MAX_HEAD_DIM = 4096
MAX_EXPERTS = 1 << 14
MAX_VOCAB = 1 << 22
MAX_POSITIONS = 1 << 27
MAX_THETA = 1e15
MAX_FACTOR = 1e6
LAYER_TYPES = ("full_attention", "sliding_attention")

#: the key of the routed-expert count, by model_type
EXPERTS_KEY = {
    "mixtral": "num_local_experts",
    "gpt_oss": "num_local_experts",
    "qwen2_moe": "num_experts",
    "qwen3_moe": "num_experts",
    "olmoe": "num_experts",
    "deepseek_v3": "n_routed_experts",
}


@dataclass(frozen=True)
class Rule:
    """What one hyper-parameter may be: an int in [lo, hi], a finite float in [lo, hi] (or (lo, hi]
    with `open_lo`), or a bool; `optional`: None (JSON null) is accepted too."""

    kind: str  # "int" | "float" | "bool"
    lo: float = 0
    hi: float = math.inf
    optional: bool = False
    open_lo: bool = False

    def expected(self) -> str:
        if self.kind == "bool":
            text = "true or false"
        elif self.kind == "int":
            text = f"an integer in [{int(self.lo)}, {int(self.hi)}]"
        else:
            text = f"a finite number in {'(' if self.open_lo else '['}{self.lo:g}, {self.hi:g}]"
        return text + (" or null" if self.optional else "")

    def accepts(self, value: Any) -> bool:
        if value is None:
            return self.optional
        if self.kind == "bool":
            return isinstance(value, bool)
        # bool is an int subclass: true as a layer count is a type error, not 1
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return False
        if self.kind == "int":
            return isinstance(value, int) and self.lo <= value <= self.hi
        if not math.isfinite(value):
            return False
        return (value > self.lo if self.open_lo else value >= self.lo) and value <= self.hi


def _int(lo: int, hi: int, optional: bool = False) -> Rule:
    return Rule("int", lo, hi, optional)


def _pos(hi: float, optional: bool = False) -> Rule:
    return Rule("float", 0.0, hi, optional, open_lo=True)


BOOL = Rule("bool")

#: top-level config.json keys the adapters read
RULES: dict[str, Rule] = {
    "num_hidden_layers": _int(1, MAX_LAYERS),
    "hidden_size": _int(1, MAX_HIDDEN),
    "num_attention_heads": _int(1, MAX_HEADS),
    "num_key_value_heads": _int(1, MAX_HEADS),  # never null: qwen2-moe keeps a null as is
    "head_dim": _int(1, MAX_HEAD_DIM, optional=True),
    "intermediate_size": _int(1, MAX_FFN),
    "moe_intermediate_size": _int(1, MAX_FFN),
    "shared_expert_intermediate_size": _int(0, MAX_FFN),
    "num_experts": _int(1, MAX_EXPERTS),
    "num_local_experts": _int(1, MAX_EXPERTS),
    "n_routed_experts": _int(1, MAX_EXPERTS),
    "num_experts_per_tok": _int(1, MAX_EXPERTS),
    "vocab_size": _int(1, MAX_VOCAB),
    "max_position_embeddings": _int(1, MAX_POSITIONS),
    "q_lora_rank": _int(1, MAX_HIDDEN, optional=True),
    "kv_lora_rank": _int(1, MAX_HIDDEN),
    "qk_nope_head_dim": _int(1, MAX_HEAD_DIM),
    "qk_rope_head_dim": _int(2, MAX_HEAD_DIM),
    "v_head_dim": _int(1, MAX_HEAD_DIM),
    # 0 / null: no group limit (the adapter routes as with one group)
    "n_group": _int(0, MAX_EXPERTS, optional=True),
    "topk_group": _int(0, MAX_EXPERTS, optional=True),
    "n_shared_experts": _int(0, MAX_EXPERTS, optional=True),
    "first_k_dense_replace": _int(0, MAX_LAYERS, optional=True),
    "num_nextn_predict_layers": _int(0, MAX_LAYERS, optional=True),
    "decoder_sparse_step": _int(1, MAX_LAYERS, optional=True),
    "sliding_window": _int(0, MAX_POSITIONS, optional=True),  # 0 / null: no window
    "rms_norm_eps": Rule("float", 0.0, 1.0, open_lo=True),
    "routed_scaling_factor": _pos(MAX_FACTOR),
    "swiglu_alpha": _pos(MAX_FACTOR, optional=True),
    "swiglu_limit": _pos(MAX_FACTOR, optional=True),
    "clip_qkv": _pos(MAX_FACTOR, optional=True),
    # theta <= 1 makes every rotary frequency 1 (or inf, or a division by log 1 in YaRN)
    "rope_theta": Rule("float", 1.0, MAX_THETA, open_lo=True),
    "tie_word_embeddings": BOOL,
    "norm_topk_prob": BOOL,
    "attention_bias": BOOL,
    "qkv_bias": BOOL,
    "rope_interleave": BOOL,
}

#: keys of `rope_parameters` / `rope_scaling`
ROPE_RULES: dict[str, Rule] = {
    "rope_theta": RULES["rope_theta"],
    "factor": _pos(MAX_FACTOR),
    "original_max_position_embeddings": _int(1, MAX_POSITIONS),
    "beta_fast": _pos(MAX_FACTOR),
    "beta_slow": _pos(MAX_FACTOR),
    # YaRN's attention scale: about 1 in real configs; 1e6 would scale cos/sin into overflow
    "mscale": Rule("float", 0.0, 100.0, optional=True),
    "mscale_all_dim": Rule("float", 0.0, 100.0, optional=True),
    "attention_factor": _pos(100.0, optional=True),
    "low_freq_factor": _pos(MAX_FACTOR),
    "high_freq_factor": _pos(MAX_FACTOR),
    "partial_rotary_factor": Rule("float", 0.0, 1.0, open_lo=True),
    "truncate": BOOL,
}

_LIST_KEYS = ("layer_types", "mlp_only_layers")
_DICT_KEYS = ("rope_parameters", "rope_scaling", "quantization_config")


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def bad_value(where: str, name: str, value: Any, expected: str) -> CheckpointError:
    """The one-line error for hyper-parameter `name` (as the source spells it) being `value`."""
    return CheckpointError(f"{where}: '{name}' is {_show(value)}; expected {expected}")


def check_value(where: str, name: str, value: Any, rule: Rule) -> None:
    """CheckpointError naming `name` unless `rule` accepts `value`."""
    if not rule.accepts(value):
        raise bad_value(where, name, value, rule.expected())


def _name(names: Mapping[str, str] | None, key: str) -> str:
    return (names or {}).get(key, key)


def check_raw_config(raw: Mapping[str, Any], where: str, names: Mapping[str, str] | None = None) -> None:
    """Types and ranges of the hyper-parameters present in the config dict `raw`; `names` maps a key
    to the name the source gives it (GGUF metadata keys), for the message."""
    if not isinstance(raw, Mapping):
        raise CheckpointError(f"{where}: the model config is {type(raw).__name__}, not a JSON object")
    model_type = raw.get("model_type")
    if not isinstance(model_type, str):
        raise bad_value(where, "model_type", model_type, "a string")
    for key, rule in RULES.items():
        if key in raw:
            check_value(where, _name(names, key), raw[key], rule)
    for key in _DICT_KEYS:
        if raw.get(key) is not None and not isinstance(raw[key], Mapping):
            raise bad_value(where, _name(names, key), raw[key], "an object or null")
    for key in ("rope_parameters", "rope_scaling"):
        _check_rope(raw.get(key), where, key, names)
    for key in _LIST_KEYS:
        value = raw.get(key)
        if value is not None and (not isinstance(value, list) or len(value) > MAX_LAYERS):
            raise bad_value(where, _name(names, key), value, f"a list of at most {MAX_LAYERS} items or null")
    _check_layer_lists(
        raw.get("layer_types"), raw.get("mlp_only_layers"), raw.get("num_hidden_layers"), where
    )


def _check_rope(params: Any, where: str, key: str, names: Mapping[str, str] | None) -> None:
    if not isinstance(params, Mapping):
        return
    for name, rule in ROPE_RULES.items():
        if name in params:
            check_value(where, _name(names, f"{key}.{name}"), params[name], rule)
    if "rope_type" in params and not isinstance(params["rope_type"], str):
        raise bad_value(where, f"{key}.rope_type", params["rope_type"], "a string")


def _check_layer_lists(layer_types: Any, mlp_only: Any, layers: Any, where: str) -> None:
    """Entries of `layer_types` / `mlp_only_layers` (lists, at most MAX_LAYERS long: checked)."""
    for kind in layer_types or ():
        if kind not in LAYER_TYPES:
            raise bad_value(where, "layer_types", kind, f"entries in {list(LAYER_TYPES)}")
    if isinstance(layer_types, list) and isinstance(layers, int) and len(layer_types) != layers:
        raise bad_value(where, "layer_types", layer_types, f"{layers} entries (num_hidden_layers)")
    hi = layers - 1 if isinstance(layers, int) else MAX_LAYERS - 1
    for index in mlp_only or ():
        check_value(where, "mlp_only_layers", index, _int(0, hi))


def check_config(config: Any, where: str, names: Mapping[str, str] | None = None) -> None:
    """The per-key rules on the values of the transformers config `config` (defaults filled in), and
    the relations between them the architecture needs. CheckpointError naming the key otherwise."""
    model_type = getattr(config, "model_type", None)
    values = {key: getattr(config, key) for key in RULES if hasattr(config, key)}
    for key in _LIST_KEYS:
        values[key] = getattr(config, key, None)
    values["model_type"] = model_type
    rope = getattr(config, "rope_parameters", None)
    values["rope_parameters"] = rope
    check_raw_config(values, where, names)
    if isinstance(rope, Mapping) and rope.get("rope_type", "default") == "default":
        check_value(where, _name(names, "rope_theta"), rope.get("rope_theta"), RULES["rope_theta"])
    _check_experts(values, model_type, where, names)
    if model_type == "deepseek_v3":
        _check_mla(values, where, names)
    else:
        _check_gqa(values, where, names)


def _check_experts(
    values: Mapping[str, Any], model_type: Any, where: str, names: Mapping[str, str] | None
) -> None:
    key = EXPERTS_KEY.get(model_type)
    if key is None:
        return
    experts = values.get(key)
    check_value(where, _name(names, key), experts, RULES[key])
    top_k = values.get("num_experts_per_tok")
    check_value(where, _name(names, "num_experts_per_tok"), top_k, _int(1, experts))


def _check_gqa(values: Mapping[str, Any], where: str, names: Mapping[str, str] | None) -> None:
    hidden, heads = values.get("hidden_size"), values.get("num_attention_heads")
    kv_heads = values.get("num_key_value_heads") or heads
    head_dim = values.get("head_dim")
    if not head_dim:  # the adapters then use hidden_size // num_attention_heads
        if hidden % heads:
            raise bad_value(
                where, _name(names, "num_attention_heads"), heads, f"a divisor of hidden_size {hidden}"
            )
        head_dim = hidden // heads
    if head_dim % 2:  # rotary pairs
        raise bad_value(where, _name(names, "head_dim"), head_dim, "an even head size (rotary embedding)")
    if heads % kv_heads:
        raise bad_value(
            where, _name(names, "num_key_value_heads"), kv_heads, f"a divisor of num_attention_heads {heads}"
        )


def _check_mla(values: Mapping[str, Any], where: str, names: Mapping[str, str] | None) -> None:
    if values["qk_rope_head_dim"] % 2:
        raise bad_value(where, _name(names, "qk_rope_head_dim"), values["qk_rope_head_dim"], "an even number")
    experts, top_k = values["n_routed_experts"], values["num_experts_per_tok"]
    groups, used = values.get("n_group") or 1, values.get("topk_group") or 1
    if experts < 2:  # a group's score is the sum of its best two experts
        raise bad_value(
            where, _name(names, "n_routed_experts"), experts, "at least 2 (group-limited routing)"
        )
    if experts % groups or experts // groups < 2:
        raise bad_value(
            where,
            _name(names, "n_group"),
            groups,
            f"a divisor of n_routed_experts {experts} leaving 2+ per group",
        )
    if used > groups:
        raise bad_value(where, _name(names, "topk_group"), used, f"at most n_group {groups}")
    if top_k > used * (experts // groups):  # the chosen groups must hold top_k experts
        raise bad_value(
            where,
            _name(names, "num_experts_per_tok"),
            top_k,
            f"at most {used * (experts // groups)} (topk_group {used} groups of {experts // groups} experts)",
        )
    first_dense, layers = values.get("first_k_dense_replace") or 0, values["num_hidden_layers"]
    if first_dense >= layers:
        raise bad_value(
            where, _name(names, "first_k_dense_replace"), first_dense, f"below num_hidden_layers {layers}"
        )


def check_layer_count(where: str, name: str, layers: int, found: Iterable[int], what: str) -> None:
    """The config's layer count `layers` (key `name`) against the layer indices `found` in the
    checkpoint's tensor names (`what` describes them): every layer must have tensors, and the
    checkpoint must hold no layer the config would leave out."""
    indices = set(found)
    count = max(indices) + 1 if indices else 0
    if layers > count:
        raise bad_value(where, name, layers, f"at most the {count} layer(s) the checkpoint holds ({what})")
    if count > layers:
        raise bad_value(where, name, layers, f"the {count} layers the checkpoint holds ({what})")


def check_spec(spec: Any, where: str) -> None:
    """What the float hyper-parameters combine to (YaRN, llama3 scaling...): finite, positive rotary
    frequencies and attention scales, so a bad combination fails here, not as NaN logits."""
    import torch

    rope = spec.rope
    if not bool(torch.isfinite(rope.inv_freq).all()) or not bool((rope.inv_freq > 0).all()):
        raise CheckpointError(f"{where}: the rope parameters give non-finite or zero rotary frequencies")
    scales = {rope.attention_scaling, *(layer.attention.scaling for layer in spec.layers)}
    if not all(math.isfinite(s) and s > 0 for s in scales):
        raise CheckpointError(
            f"{where}: the rope parameters give a non-finite attention scale {sorted(scales)}"
        )
