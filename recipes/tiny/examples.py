"""The corpus as training examples: each dialogue rendered with the engine's chat template,
tokenized with labels on the conversation after the system block, and batched so that the
dialogues of one batch share their system block (computed once per batch: `forward.py`)."""

from __future__ import annotations

import random
from typing import Any

import torch
from tqdm.auto import tqdm

from freetoken_agents.engine import render_chat

from .corpus import Dialogue


def render(tokenizer: Any, d: Dialogue) -> tuple[str, list[tuple[int, int]]]:
    """The dialogue's text and the character span the loss covers: the whole conversation after
    the system block (user turns, calls, tool results, answers).

    Why not assistant turns only: a name is copied from the question into the call, the tool
    result and the answer; learning the user and tool turns too triples the copies a step sees,
    and copying unseen names is exactly what the held-out test asks. The system block (the same
    tool schemas every time) teaches nothing after the first steps and is left out.
    """
    text = render_chat(tokenizer, d.messages, d.tools, add_generation_prompt=False)
    first = next(i for i, m in enumerate(d.messages) if m["role"] != "system")
    # The conversation starts at the first non-system turn's "<|im_start|>ROLE" (the template puts
    # a tools-only system block first when the dialogue has no system message of its own).
    head = render_chat(tokenizer, d.messages[:first], d.tools, add_generation_prompt=False) if first else ""
    start = text.find(f"<|im_start|>{d.messages[first]['role']}", len(head))
    if start < 0 or not text.startswith(head):
        raise ValueError("the chat template does not render prefixes of a dialogue as prefixes")
    return text, [(start, len(text))]


def encode(tokenizer: Any, text: str, spans: list[tuple[int, int]]) -> tuple[list[int], list[int]]:
    """Token ids and labels (-100 outside `spans`)."""
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    return enc["input_ids"], _labels(enc["input_ids"], enc["offset_mapping"], spans)


def encode_all(
    tokenizer: Any, rendered: list[tuple[str, list[tuple[int, int]]]], chunk: int = 2048
) -> list[tuple[list[int], list[int]]]:
    """`encode` over many dialogues, a chunk per tokenizer call: the Rust tokenizer encodes a batch
    on every core (a 16-core GPU machine tokenizes a 100k-dialogue corpus in seconds, not minutes).
    Equal to `encode` one by one."""
    out: list[tuple[list[int], list[int]]] = []
    for i in tqdm(range(0, len(rendered), chunk), desc="tokenize", leave=False):
        part = rendered[i : i + chunk]
        enc = tokenizer([t for t, _ in part], add_special_tokens=False, return_offsets_mapping=True)
        for ids, offsets, (_, spans) in zip(enc["input_ids"], enc["offset_mapping"], part, strict=True):
            out.append((ids, _labels(ids, offsets, spans)))
    return out


def _labels(ids: list[int], offsets: list[tuple[int, int]], spans: list[tuple[int, int]]) -> list[int]:
    return [
        tid if any(a <= start < b for a, b in spans) else -100
        for tid, (start, _) in zip(ids, offsets, strict=True)
    ]


MAX_TOKENS = 1536  # longer dialogues (rare: four tools with long schemas, two exchanges) are left out
Example = tuple[tuple[int, ...], list[int], list[int]]  # (system-block ids, conversation ids, labels)


def split_system_block(ids: list[int], labels: list[int]) -> Example:
    """Cut an encoded dialogue where the loss starts: the system block before, the conversation after."""
    k = next(i for i, y in enumerate(labels) if y != -100)
    return tuple(ids[:k]), ids[k:], labels[k:]


def batches(examples: list[Example], tokens_per_batch: int, pad_id: int, rng: random.Random):
    """Shuffled batches of dialogues that share one system block: (system block [P], conversation
    ids [B, T], labels [B, T], attention mask [B, P + T]), length-bucketed under `tokens_per_batch`
    conversation tokens.

    The system block (the four tool schemas: ~70% of a tool dialogue's tokens) is computed once per
    batch and its KV shared by every row, so a step sees ~3x the dialogues for the same compute;
    the logits equal those of the full sequences (checked in tests/test_tiny_training.py).
    """
    by_block: dict[tuple[int, ...], list[int]] = {}
    for i, (block, _, _) in enumerate(examples):
        by_block.setdefault(block, []).append(i)
    groups: list[list[int]] = []
    for members in by_block.values():
        members.sort(key=lambda i: len(examples[i][1]))
        current: list[int] = []
        longest = 0
        for i in members:
            longest = max(longest, len(examples[i][1]))
            if current and longest * (len(current) + 1) > tokens_per_batch:
                groups.append(current)
                current, longest = [], len(examples[i][1])
            current.append(i)
        if current:
            groups.append(current)
    rng.shuffle(groups)
    for group in groups:
        block = torch.tensor(examples[group[0]][0])
        width = max(len(examples[i][1]) for i in group)
        ids = torch.full((len(group), width), pad_id)
        labels = torch.full((len(group), width), -100)
        mask = torch.zeros((len(group), len(block) + width), dtype=torch.long)
        mask[:, : len(block)] = 1
        for row, i in enumerate(group):
            _, x, y = examples[i]
            ids[row, : len(x)], labels[row, : len(y)] = torch.tensor(x), torch.tensor(y)
            mask[row, len(block) : len(block) + len(x)] = 1
        yield block, ids, labels, mask


def steps_of(micro_batches, tokens_per_batch: int):
    """Group batches into optimizer steps of at least `tokens_per_batch` conversation tokens: a
    generic tool set's eight dialogues are one small batch (their own system block), so a step
    accumulates gradients over several."""
    step, tokens = [], 0
    for batch in micro_batches:
        step.append(batch)
        tokens += batch[1].numel()
        if tokens >= tokens_per_batch:
            yield step
            step, tokens = [], 0
    if step:
        yield step


def short_enough(encoded: list[Example]) -> list[int]:
    """The indices of the encoded dialogues within `MAX_TOKENS` (system block and conversation)."""
    return [i for i, (block, ids, _) in enumerate(encoded) if len(block) + len(ids) <= MAX_TOKENS]
