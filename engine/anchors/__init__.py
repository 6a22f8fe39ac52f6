"""Semantic anchors: content-addressed, validated, shared-KV checkpoints of a session.

    with engine.new_session() as s:
        s.prefill(system_prompt_ids)
        a = s.anchor("system_prompt")          # O(1) amortised: no pass over the cache
        s.prefill(more_ids)
        s.rollback(a)                          # rehash the covered KV blocks (xxh3), then swap
        s.rollback(a.id, validate="signature") # opt-in: only the first/last 512 KV bytes
    engine.anchors.save("anchors/")            # safetensors + JSON + HMAC; load() in a new process

What an anchor captures (and so what rollback restores): the token ids [0, position), pending ones
included; a read-only pin of the KV blocks that cover the processed ones (refcounted, shared with
the session and other anchors, never a clone); and a snapshot of the expert-cache state. The
engine keeps no other per-sequence state: every supported architecture's cache is its KV. In
particular gpt-oss's sliding-window layers keep *all* positions in the cache (the window is an
attention mask computed from positions, see `layers.StepContext.mask`), so an anchor of a gpt-oss
session already holds everything a rollback needs, for windowed and full layers alike. MLA
(DeepSeek-V3) layers cache the compressed latent and rotary key, which the anchor pins the same way.

Modules: `anchor` (the record, expert-state snapshots, validation: `verify_anchor` documents the
`validate` modes), `digest` (ids, KV digests, signature, model fingerprint), `weights` (digests of
weight files), `store` (AnchorStore: LRU byte budget, pins), `persist` (authenticated save/load),
`keys` (the per-user key that authenticates saved anchors).
"""

from .anchor import (
    ANCHOR_KINDS,
    DEFAULT_VALIDATION,
    VALIDATIONS,
    Anchor,
    AnchorKind,
    AnchorSignature,
    ExpertState,
    Validation,
    check_validation,
)
from .digest import FORMAT_VERSION, SIGNATURE_SPAN, model_fingerprint
from .keys import KEY_FILE_ENV, key_path
from .store import AnchorStore

__all__ = [
    "ANCHOR_KINDS",
    "DEFAULT_VALIDATION",
    "FORMAT_VERSION",
    "KEY_FILE_ENV",
    "SIGNATURE_SPAN",
    "VALIDATIONS",
    "Anchor",
    "AnchorKind",
    "AnchorSignature",
    "AnchorStore",
    "ExpertState",
    "Validation",
    "check_validation",
    "key_path",
    "model_fingerprint",
]
