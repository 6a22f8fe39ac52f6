"""The `Anchor` record, its signature, expert-state snapshots, and the checks a rollback runs.

An anchor is immutable and content-addressed: `id = sha256(model_fingerprint || token ids ||
kv_digest || expert_state)` (see `digest.anchor_id`). Kind, label, parent, time and session are
metadata, not identity: anchoring an identical state twice yields the same id (the store keeps the
first record).

Expert-cache state: a provider may implement the optional methods

    snapshot_state() -> Mapping[str, Iterable[ExpertKey]]   # tier name -> experts resident there
    restore_state(state: Mapping[str, Sequence[ExpertKey]]) -> None   # re-warm the tiers

A provider without `snapshot_state` but with `keys()` (InMemoryExpertProvider: every expert always
resident) is recorded as `{"resident": keys()}`; one with neither as the empty state. Restoring
calls `restore_state` when the provider has it and otherwise does nothing (nothing to re-warm).
The state is normalised (tiers and keys sorted) and is part of the anchor's identity.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal, get_args

from ..errors import AnchorError, AnchorFingerprintError, AnchorValidationError
from ..model.experts import ExpertKey, ExpertStore
from ..model.kv import BlockTable
from .digest import (
    FORMAT_VERSION,
    SIGNATURE_SPAN,
    anchor_id,
    kv_digest,
    rehash_kv,
    signature_edges,
    token_hash,
)

logger = logging.getLogger(__name__)

AnchorKind = Literal["system_prompt", "tool_call", "tool_result", "code_block", "manual"]
ANCHOR_KINDS: tuple[str, ...] = get_args(AnchorKind)
Validation = Literal["blocks", "signature", "full"]
VALIDATIONS: tuple[str, ...] = get_args(Validation)
DEFAULT_VALIDATION: Validation = "blocks"
ExpertState = tuple[tuple[str, tuple[ExpertKey, ...]], ...]


@dataclass(frozen=True)
class AnchorSignature:
    """What a `validate="signature"` rollback checks, in O(1) of the context length (opt-in: it
    misses a change between the first and last `span` bytes)."""

    edges: str  # sha256 hex of the first and last `span` bytes of the KV byte stream (digest.py)
    token_hash: str  # sha256 hex of the token ids (fixed-width little-endian int64)
    span: int = SIGNATURE_SPAN  # bytes taken from each end


@dataclass(frozen=True, eq=False)
class Anchor:
    """One pinned session state. Equal (and hashed) by `id`.

    The record never changes; the KV it pins lives in the engine's pool until the anchor store
    evicts or discards it, after which rollback to it raises AnchorNotFoundError.
    """

    id: str  # 64 hex chars: sha256(model_fingerprint || token ids || kv_digest || expert_state)
    kind: AnchorKind  # why it was placed: system_prompt, tool_call, tool_result, code_block, manual
    label: str | None  # free text for traces and listings
    position: int  # number of tokens in the anchored sequence (pending ones included)
    kv_length: int  # tokens whose KV is pinned (position minus the pending tokens)
    parent_id: str | None  # the nearest anchor before this one on the same branch, if any
    created: float  # creation time, seconds since the epoch
    session_id: str  # id of the session that created it
    token_ids: tuple[int, ...]  # the sequence [0, position)
    expert_state: ExpertState  # (tier, sorted expert keys) pairs, sorted by tier
    kv_digest: str  # sha256 hex over the chained block digests and the partial last block
    model_fingerprint: str  # sha256 hex of weights, tokenizer, KV layout, format version
    signature: AnchorSignature
    table: BlockTable = field(repr=False)  # read-only pin of the KV blocks (refcounted, shared)
    v: int = FORMAT_VERSION  # record format version

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Anchor) and other.id == self.id

    def __hash__(self) -> int:
        return hash(self.id)

    @property
    def blocks(self) -> tuple[int, ...]:
        """Ids of the KV blocks the anchor holds (one reference each)."""
        return tuple(self.table.blocks)

    @property
    def pinned_bytes(self) -> int:
        """Bytes of the KV blocks the anchor references (shared with others or not)."""
        return len(self.table.blocks) * self.table.pool.bytes_per_block


def check_kind(kind: str) -> AnchorKind:
    if kind not in ANCHOR_KINDS:
        raise AnchorError(f"anchor kind must be one of {', '.join(ANCHOR_KINDS)}; got {kind!r}")
    return kind  # type: ignore[return-value]


def snapshot_expert_state(store: ExpertStore) -> ExpertState:
    """The store's expert-cache state, normalised (see the module docstring)."""
    return tuple(
        (str(tier), tuple(sorted((int(layer), int(expert)) for layer, expert in experts)))
        for tier, experts in sorted(store.snapshot_state().items())
    )


def restore_expert_state(store: ExpertStore, state: ExpertState) -> bool:
    """Re-warm the store's tiers from `state`; False when that failed.

    Warmth is a performance matter, not correctness: a failing `restore_state` is logged, not raised.
    """
    try:
        store.restore_state({tier: list(keys) for tier, keys in state})
    except Exception:
        logger.warning(
            "expert store %s failed to restore an anchor's state", type(store).__name__, exc_info=True
        )
        return False
    return True


def identify(
    table: BlockTable, token_ids: Sequence[int], fingerprint: str, expert_state: ExpertState
) -> tuple[str, str, AnchorSignature]:
    """(id, kv_digest, signature) of `table` + `token_ids`, without pinning anything.

    Cost: O(block_size + signature span) KV bytes read and hashed (the full blocks' digests were
    computed when they filled) plus O(tokens) integer hashing: independent of the KV size.
    """
    ids = tuple(int(t) for t in token_ids)
    digest = kv_digest(table)
    signature = AnchorSignature(edges=signature_edges(table), token_hash=token_hash(ids))
    return anchor_id(fingerprint, ids, digest, expert_state), digest, signature


def make_anchor(
    table: BlockTable,
    token_ids: Sequence[int],
    identity: tuple[str, str, AnchorSignature],
    *,
    kind: str,
    label: str | None,
    parent_id: str | None,
    session_id: str,
    fingerprint: str,
    expert_state: ExpertState,
) -> Anchor:
    """The anchor record for `identify(...)`'s result, holding a fresh pin of the table. O(blocks)."""
    anchor_hex, digest, signature = identity
    ids = tuple(int(t) for t in token_ids)
    return Anchor(
        id=anchor_hex,
        kind=check_kind(kind),
        label=label,
        position=len(ids),
        kv_length=table.length,
        parent_id=parent_id,
        created=time.time(),
        session_id=session_id,
        token_ids=ids,
        expert_state=expert_state,
        kv_digest=digest,
        model_fingerprint=fingerprint,
        signature=signature,
        table=table.pin(),
    )


def identity_of(anchor: Anchor) -> str:
    """The id the anchor's recorded parts hash to (equals `anchor.id` unless tampered with)."""
    return anchor_id(anchor.model_fingerprint, anchor.token_ids, anchor.kv_digest, anchor.expert_state)


def check_fingerprint(anchor: Anchor, fingerprint: str) -> None:
    """AnchorFingerprintError unless the anchor was made by the model with `fingerprint`."""
    if anchor.model_fingerprint != fingerprint:
        raise AnchorFingerprintError(
            f"anchor {anchor.id} was made by another model ({anchor.model_fingerprint[:16]}...); "
            f"this engine is {fingerprint[:16]}..."
        )


def check_validation(validate: str | None) -> Validation:
    """`validate` as a validation mode (None: `DEFAULT_VALIDATION`); AnchorError for any other value."""
    if validate is None:
        return DEFAULT_VALIDATION
    if validate not in VALIDATIONS:
        raise AnchorError(
            f"validate must be one of {', '.join(map(repr, VALIDATIONS))} or None, got {validate!r}"
        )
    return validate  # type: ignore[return-value]


def verify_anchor(anchor: Anchor, view: BlockTable, fingerprint: str, validate: str | None = None) -> None:
    """Check `view` (a table over the anchor's blocks) against the anchor; raise on any mismatch.

    What `Session.rollback(anchor, validate=...)` runs before it swaps. `validate`:

    - None or "blocks" (the default): the token-prefix hash, then every KV block the anchor
      covers rehashed (xxh3-128, as when the blocks filled) against the anchor's kv digest, so any
      change of any KV byte under the anchor is caught. Cost O(context): xxh3 at memory speed,
      a small fraction of a re-prefill of the same prefix (bench/rollback.py measures both).
    - "signature" (opt-in, cheapest): the token-prefix hash and the first/last `span` bytes of the
      KV only: O(1) KV bytes, but a change in between goes unnoticed.
    - "full": "signature" and "blocks" both, and the anchor id recomputed from its parts.

    Raises AnchorValidationError (naming what differs), AnchorFingerprintError (another model),
    AnchorError (a `validate` value not listed above).
    """
    mode = check_validation(validate)
    check_fingerprint(anchor, fingerprint)
    if view.length != anchor.kv_length or len(anchor.token_ids) != anchor.position:
        raise AnchorValidationError(
            f"anchor {anchor.id}: pins {view.length} KV positions and {len(anchor.token_ids)} token ids, "
            f"recorded {anchor.kv_length} and {anchor.position}"
        )
    if token_hash(anchor.token_ids) != anchor.signature.token_hash:
        raise AnchorValidationError(f"anchor {anchor.id}: its token ids do not match the token-prefix hash")
    if (
        mode in ("signature", "full")
        and signature_edges(view, anchor.signature.span) != anchor.signature.edges
    ):
        raise AnchorValidationError(
            f"anchor {anchor.id}: the first/last {anchor.signature.span} bytes of its KV changed "
            f"(corrupted KV cache)"
        )
    if mode in ("blocks", "full"):
        digest, first_bad = rehash_kv(view)
        if digest != anchor.kv_digest:
            bs = view.pool.block_size
            where = (
                f"block {first_bad} (positions {first_bad * bs}..{first_bad * bs + bs - 1})"
                if first_bad is not None
                else f"the partial last block (positions {view.length // bs * bs}..{view.length - 1})"
            )
            raise AnchorValidationError(f"anchor {anchor.id}: KV data differs from its digest in {where}")
    if mode == "full" and identity_of(anchor) != anchor.id:
        raise AnchorValidationError(f"anchor {anchor.id}: its recorded parts hash to another id")
