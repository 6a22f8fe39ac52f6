"""The training corpus: tool-using and code-writing dialogues in the engine's chat template.

Every dialogue is a list of chat messages plus the tools the system prompt shows; the text the
model trains on is rendered by `freetoken_agents.engine.render_chat`, the engine's own prompt path.
Some dialogues carry the Agent's and the coding recipe's failure notes after a rollback, so the
model has seen what a retry looks like.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any, Literal

from freetoken_agents.retry import DEFAULT_NOTE

from .._coding_format import CODING_SYSTEM_PROMPT, code_failure_note
from . import generic
from .coding import TEMPLATES, code_reply, code_task
from .world import (
    CHITCHAT,
    SYSTEM_PROMPT,
    TOOLS,
    Split,
    ToolQuestion,
    call_tool,
    final_answer,
    tool_question,
)

TOOL_SCHEMAS: list[dict[str, Any]] = [t.json_schema() for t in TOOLS]


Kind = Literal["code", "world", "generic"]


@dataclass
class Dialogue:
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] = field(default_factory=list)
    kind: Kind = "generic"  # what it teaches: writing code, the four world tools, the user's own tools


def _as_text(result: Any) -> str:
    import json

    return result if isinstance(result, str) else json.dumps(result, ensure_ascii=False)


def _call_message(question: ToolQuestion, content: str = "") -> dict[str, Any]:
    call = {"type": "function", "function": {"name": question.tool, "arguments": question.arguments}}
    return {"role": "assistant", "content": content, "tool_calls": [call]}


def _tool_note(rng: random.Random, question: ToolQuestion) -> str:
    """A failure note as the Agent writes it after rolling back a call the model got wrong."""
    wrong = dict(question.arguments)
    key = rng.choice(list(wrong))
    errors = [
        f"{key}: Input should be a valid integer"
        if isinstance(wrong[key], int)
        else f"{key}: Field required",
        f"no tool named 'get_{rng.choice(['sum', 'info', 'data'])}'; tools: {sorted(t.name for t in TOOLS)}",
        "the tool call was not finished",
    ]
    return DEFAULT_NOTE.format(
        attempt=1, tool=question.tool, arguments=wrong, error=rng.choice(errors)
    ).strip()


def tool_dialogue(rng: random.Random, split: Split = "train") -> Dialogue:
    messages: list[dict[str, Any]] = []
    if rng.random() < 0.7:
        messages.append({"role": "system", "content": SYSTEM_PROMPT})
    for _ in range(2 if rng.random() < 0.2 else 1):
        if rng.random() < 0.06:
            user, reply = rng.choice(CHITCHAT)
            messages += [{"role": "user", "content": user}, {"role": "assistant", "content": reply}]
            continue
        question = tool_question(rng, split, vowel_onsets=split == "train")
        result = call_tool(question.tool, question.arguments)
        note = _tool_note(rng, question) if rng.random() < 0.06 else ""
        messages += [
            {"role": "user", "content": question.question},
            _call_message(question, note),
            {"role": "tool", "name": question.tool, "content": _as_text(result)},
            {"role": "assistant", "content": final_answer(rng, question, result)},
        ]
    return Dialogue(messages, TOOL_SCHEMAS, kind="world")


def _code_error(rng: random.Random, function: str) -> str:
    """A failure note's error, as the sandbox reports it. The NameError for the function itself is
    what a wrongly copied name gets; the corrected code after it has the right name, so the model
    learns to take the name from the note."""
    arg = rng.randint(0, 9)
    options = [
        f"AssertionError: {function}({arg}) returned {rng.randint(-9, 99)}, expected {rng.randint(-9, 99)}",
        f"NameError: name '{rng.choice('abyz')}' is not defined",
        f"NameError: name '{function}' is not defined",
        "SyntaxError: invalid syntax (line 2)",
        f"TypeError: {function}() takes 1 positional argument but 2 were given",
        "TimeoutError: the program ran longer than 2.0 s",
    ]
    return rng.choice(options)


def code_dialogue(rng: random.Random, split: Split = "train") -> Dialogue:
    task = code_task(rng, split, rng.choice(TEMPLATES))
    reply = code_reply(rng, task.solution)
    if rng.random() < 0.15:  # a retry after rollback to the code-block anchor: lead-in, notes, code
        lead, code = reply.split("\n", 1)
        notes = "".join(
            code_failure_note(i + 1, _code_error(rng, task.function)) for i in range(rng.randint(1, 2))
        )
        reply = f"{lead}\n{notes}{code}"
    messages = [
        {"role": "system", "content": CODING_SYSTEM_PROMPT},
        {"role": "user", "content": task.prompt},
        {"role": "assistant", "content": reply},
    ]
    return Dialogue(messages, kind="code")


def dialogue(rng: random.Random, split: Split = "train", code_share: float = 0.45) -> Dialogue:
    return code_dialogue(rng, split) if rng.random() < code_share else tool_dialogue(rng, split)


def build_corpus(
    rng: random.Random,
    size: int,
    split: Split = "train",
    code_share: float = 0.3,
    world_share: float = 0.15,
    no_call_share: float = generic.NO_CALL_SHARE,
    plain_generic: bool = False,
) -> list[Dialogue]:
    """`size` dialogues: coding tasks (`code_share` of them), the world's four tools (`world_share`)
    and, for the rest, groups of eight generic dialogues over one random tool set each (see
    `generic.dialogue_group`; `plain_generic`: their requests without greetings and closing words)."""
    group = 8
    weights = [code_share, world_share, (1 - code_share - world_share) / group]
    out: list[Dialogue] = []
    while len(out) < size:
        kind = rng.choices(["code", "world", "generic"], weights)[0]
        if kind == "code":
            out.append(code_dialogue(rng, split))
        elif kind == "world":
            out.append(tool_dialogue(rng, split))
        else:
            messages, tools = generic.dialogue_group(
                rng, split, size=group, no_call_share=no_call_share, plain=plain_generic
            )
            out += [Dialogue(m, tools) for m in messages]
    return out[:size]
