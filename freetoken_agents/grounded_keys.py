"""Which keys a grounded call's objects write, in the schema's order (the grammar's): a key the
conversation names a value under (`unit = km`: `named_values`) is written, the first one missing
next, and the object does not close without it; an optional key the conversation never mentions
(`said_keys`) is not written. `KeyRules` masks the tokens that would break either, where the
grammar leaves a choice; `grounding.SpanGrounding` builds its tables and applies it.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping

import torch

from .json_cursor import JsonCursor
from .said_keys import Path
from .spans import SpanIndex


class KeyRules(JsonCursor):
    """A `JsonCursor` that knows which keys each object of the call must and may still write.

    `named_keys`: per object's key path, the keys the text names a value under (and the keys
    leading to such a value); `tool_paths`: each tool's key paths (`grounding.tool_key_paths`),
    so a key named for one tool is not asked of another's call; `key_order`: per tool, per
    object path, its keys in the schema's order; `unsaid`: per tool, per object path, its
    optional keys the conversation does not mention."""

    def __init__(
        self,
        index: SpanIndex,
        named_keys: dict[Path, frozenset[bytes]],
        tool_paths: Mapping[bytes, frozenset[Path]],
        key_order: dict[bytes | None, dict[Path, tuple[bytes, ...]]],
        unsaid: dict[bytes | None, dict[Path, frozenset[bytes]]],
    ) -> None:
        super().__init__()
        self.index, self.named_keys, self.tool_paths = index, named_keys, tool_paths
        self.key_order, self.unsaid = key_order, unsaid

    def _missing(self, depth: int) -> frozenset[bytes]:
        """The named keys the object open at `depth` of the stack has not written (of the chosen
        tool's keys, where the schema is one per tool)."""
        frame = self.stack[depth]
        if frame[0] != "object":
            return frozenset()
        path = tuple(f[1] for f in self.stack[:depth])
        missing = self.named_keys.get(path, frozenset()) - frame[3]
        if missing and depth and self.tool_paths:
            known = self.tool_paths.get(self.tool) if self.tool is not None else None
            if known is None:  # no tool chosen yet (or an unknown one): nothing to ask for
                return frozenset()
            missing = frozenset(k for k in missing if (*path, k) in known)
        return missing

    def _missing_keys(self) -> bool:
        return any(self._missing(d) for d in range(len(self.stack)))

    def _next_named(self, depth: int) -> frozenset[bytes]:
        """Of the named keys the object open at `depth` misses, the one it must write next: the
        first in the schema's order (the grammar's: a later key first would leave it out), or all
        of them where the order is not known."""
        missing = self._missing(depth)
        path = tuple(f[1] for f in self.stack[:depth])
        order = self.key_order.get(self.tool, {}).get(path)
        if len(missing) < 2 or order is None or not missing <= set(order):
            return missing
        return frozenset({min(missing, key=order.index)})

    def _keys_left(self, depth: int) -> list[bytes] | None:
        """The keys the object open at `depth` may still write, in the schema's order (the
        grammar's), where it holds back an optional key the text does not mention; None where
        it holds back none."""
        frame = self.stack[depth]
        if frame[0] != "object":
            return None
        path = tuple(f[1] for f in self.stack[:depth])
        unsaid = self.unsaid.get(self.tool, {}).get(path)
        if not unsaid:
            return None
        order = self.key_order[self.tool][path]
        last = max((order.index(k) for k in frame[3] if k in order), default=-1)
        return [k for k in order[last + 1 :] if k not in unsaid]

    def _holds_back_keys(self) -> bool:
        return bool(self.unsaid) and any(self._keys_left(d) is not None for d in range(len(self.stack)))

    def _breaks_keys(self, piece: bytes) -> bool:
        """Whether writing `piece` here closes an object that misses a named key, or writes a key
        other than the first named key it misses (keys follow the schema's order, so an unnamed
        optional key there would be a guess the text does not make, and a later named key would
        leave the first out), or writes an optional key the text does not mention (`said_keys`)."""
        probe = copy.copy(self)
        probe.stack = [[*frame[:3], set(frame[3])] for frame in self.stack]
        for c in piece:
            in_key = probe.in_string and probe.is_key and not probe.escaped
            top = len(probe.stack) - 1
            if not probe.in_string and probe.stack:
                if c == 0x7D and probe._missing(top):
                    return True
                frame = probe.stack[top]
                key_next = c == 0x2C or (c == 0x22 and frame[2])  # a comma or a key's quote
                if key_next and frame[0] == "object" and probe._keys_left(top) == []:
                    return True
            if in_key and probe.stack:
                missing, left = probe._next_named(top), probe._keys_left(top)
                if c != 0x22:
                    prefix = probe.value + bytes((c,))
                    if missing and not any(k.startswith(prefix) for k in missing):
                        return True
                    if left is not None and not any(k.startswith(prefix) for k in left):
                        return True
                elif (missing and probe.value not in missing) or (
                    left is not None and probe.value not in left
                ):
                    return True
            probe._feed_byte(c)
        return False

    def _keep_keys_(self, logits: torch.Tensor) -> None:
        """Mask the tokens the grammar (and grounding) allow that `_breaks_keys`; unchanged where
        that leaves none."""
        flat = logits.view(-1)
        if self.in_string and self.is_key:  # any piece may continue the key
            candidates = torch.nonzero(torch.isfinite(flat)).flatten().tolist()
        else:
            idx = self.index.structural_ids(flat.numel(), flat.device, quoting=self.in_string)
            if not idx.numel():
                return
            candidates = idx[torch.isfinite(flat[idx])].tolist()
        pieces = self.index.pieces
        bad = [i for i in candidates if self._breaks_keys(pieces[i])]
        if not bad:
            return
        keep = torch.isfinite(flat)
        keep[torch.tensor(bad, device=flat.device)] = False
        if bool(keep.any()):
            flat.masked_fill_(~keep, float("-inf"))
