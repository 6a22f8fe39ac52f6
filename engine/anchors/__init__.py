"""Semantic anchors: content-addressed, validated, shared-KV checkpoints of a session.

    with engine.new_session() as s:
        s.prefill(system_prompt_ids)
        a = s.anchor("system_prompt")          # O(1) amortised: no pass over the cache
        s.prefill(more_ids)
        s.rollback(a)                          # pointer work: verify the signature, then swap
        s.rollback(a.id, validate="full")      # rehash every block first
    engine.anchors.save("anchors/")            # safetensors + JSON; load() in a new process

What an anchor captures (and so what rollback restores): the token ids [0, position), pending ones
included; a read-only pin of the KV blocks that cover the processed ones (refcounted, shared with
the session and other anchors, never a clone); and a snapshot of the expert-cache state. The
engine keeps no other per-sequence state: every supported architecture's cache is its KV. In
particular gpt-oss's sliding-window layers keep *all* positions in the cache (the window is an
attention mask computed from positions, see `layers.StepContext.mask`), so an anchor of a gpt-oss
session already holds everything a rollback needs, for windowed and full layers alike. MLA
(DeepSeek-V3) layers cache the compressed latent and rotary key, which the anchor pins the same way.

Modules: `anchor` (the record, expert-state snapshots, validation), `digest` (ids, KV digests,
signature, model fingerprint), `store` (AnchorStore: LRU byte budget, pins), `persist` (save/load).
"""

from .anchor import ANCHOR_KINDS, Anchor, AnchorKind, AnchorSignature, ExpertState, Validation
from .digest import FORMAT_VERSION, SIGNATURE_SPAN, model_fingerprint
from .store import AnchorStore

__all__ = [
    "ANCHOR_KINDS",
    "FORMAT_VERSION",
    "SIGNATURE_SPAN",
    "Anchor",
    "AnchorKind",
    "AnchorSignature",
    "AnchorStore",
    "ExpertState",
    "Validation",
    "model_fingerprint",
]
