"""Generic tool use: random tools (from `domains.py` or invented), requests that name the intent and
carry the values, and the dialogues the embedded model learns from them.

A tool's schema is what a user's tool would send: the SDK's `Tool.json_schema()` shape, LangChain's
(`convert_to_openai_tool`: docstring "Args:" sections, numeric bounds) or a hand-written OpenAI
dict with parameter descriptions. Requests say what to do in a domain phrase ("the weather in
{v}"), in function notation ("magic(3)") or by naming the tool, and carry every other value as
"<parameter words> <value>". Dialogues cover calling, answering directly when no tool fits, turning
results into answers, the Agent's failure note after a rollback and several calls in one turn.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from typing import Any

from freetoken_agents.retry import DEFAULT_NOTE

from .domains import DOMAINS, HELDOUT_DOMAINS, Domain, Param
from .values import draw, quoted
from .world import Split, in_split

SYSTEM_PROMPTS = [
    "You are a helpful assistant.",
    "You are an assistant that can call tools.",
    "Use the tools when they help.",
]
QUERY_FRAMES = ["What is {p}?", "Tell me {p}.", "Look up {p}.", "I need {p}.", "Can you get {p}?",
                "Find {p}.", "Show me {p}.", "Please check {p}.", "Get {p}.",
                "I want to know {p}."]  # fmt: skip
ACTION_FRAMES = ["{P}.", "Please {p}.", "Can you {p}?", "I want you to {p}.", "Could you {p}?",
                 "{P}, please.", "Now {p}.", "I need you to {p}."]  # fmt: skip
CALL_FRAMES = ["What is the value of {call}?", "Compute {call}.", "Call {call}.", "What is {call}?",
               "Run {call} for me.", "Evaluate {call}.", "Calculate {call}.", "I need {call}."]  # fmt: skip
NAMED_FRAMES = ["Use {name} to {p}.", "With the {name} tool, {p}.", "Call {name} and {p}."]
# Held out of training: the evaluation's wordings include these.
HELDOUT_FRAMES = {
    "query": ["Could you find out {p} for me?", "I would like to know {p}."],
    "action": ["Go ahead and {p}.", "I'd like you to {p}, please."],
    "call": ["What does {call} return?", "Give me the result of {call}."],
}
SUFFIXES = ["", "", "", " Use the tool.", " Thanks!", " Please use a tool.", " Thank you."]
PREFIXES = ["", "", "", "Hi! ", "Hello. ", "Quick question: ", "Hey, "]
TAILS = [" - a small technology company", " - it is important", " (for my report)", " - a new client",
         " for the team", " - a family business"]  # fmt: skip
CHITCHAT = [
    ("Hello!", "Hello! How can I help you today?"),
    ("Hi there.", "Hi! What can I do for you?"),
    ("Thank you!", "You're welcome!"),
    ("Good morning.", "Good morning! How can I help?"),
    ("How are you?", "I'm doing well, thanks! How can I help?"),
    ("Tell me a joke.", "Why did the computer get cold? It left its Windows open."),
]
NO_TOOL_REPLIES = ["Sorry, none of my tools can do that.", "I can't do that with the tools I have."]
_SYLLABLES = [
    "zor",
    "bix",
    "quan",
    "mel",
    "tri",
    "vox",
    "lum",
    "pax",
    "dri",
    "fen",
    "gol",
    "nim",
    "kro",
    "sul",
]


@dataclass(frozen=True)
class GenericTool:
    name: str
    kind: str  # "query" or "action"
    phrases: tuple[str, ...]
    params: tuple[Param, ...]  # schema order; the first is the primary value
    required: frozenset[str]
    results: tuple[tuple[str, str], ...]
    schema: dict[str, Any]


@dataclass(frozen=True)
class Request:
    text: str
    tool: GenericTool
    arguments: dict[str, Any]


def domains(split: Split) -> list[Domain]:
    return [d for d in DOMAINS if (d.key in HELDOUT_DOMAINS) == (split == "heldout")]


def _property(p: Param, rng: random.Random, style: str) -> dict[str, Any]:
    types = {"int": "integer", "count": "integer", "number": "number", "bool": "boolean", "object": "object"}
    prop: dict[str, Any] = {"type": types.get(p.kind, "string")}
    if p.kind == "enum":
        prop["enum"] = list(p.options)
    if p.kind == "object":
        prop["properties"] = {f: _property(Param(f, k), rng, style) for f, k in p.fields}
        prop["required"] = [f for f, _ in p.fields]
    if style == "openai" and rng.random() < 0.6:
        prop["description"] = f"The {p.name.replace('_', ' ')}."
    if style == "langchain" and p.kind == "count" and rng.random() < 0.3:
        prop.update(exclusiveMinimum=0, exclusiveMaximum=1000)
    if rng.random() < 0.1:
        prop["title"] = p.name.replace("_", " ").title()
    return dict(sorted(prop.items())) if style != "openai" else prop


def _schema(name: str, description: str, params: list[Param], required: set[str], rng: random.Random) -> dict:
    style = rng.choice(["sdk", "langchain", "openai"])
    properties = {p.name: _property(p, rng, style) for p in params}
    if style == "langchain" and rng.random() < 0.5:
        args = "".join(f"\n        {p.name}: The {p.name.replace('_', ' ')}." for p in params)
        description = f"{description}\n\n    Args:{args}\n"
    parameters: dict[str, Any] = {
        "properties": properties,
        "required": [p.name for p in params if p.name in required],
    }
    parameters["type"] = "object"
    if style == "sdk":
        parameters = {"additionalProperties": False, **parameters}
    if style == "openai":
        parameters = {"type": "object", "properties": properties, "required": parameters["required"]}
    return {
        "type": "function",
        "function": {"name": name, "description": description, "parameters": parameters},
    }


def domain_tool(rng: random.Random, domain: Domain) -> GenericTool:
    primary = Param(rng.choice(domain.primary), domain.primary_kind)
    extras = [p for p in domain.extras if rng.random() < 0.6]
    params = [primary, *extras]
    required = {primary.name} | {p.name for p in extras if rng.random() < 0.4}
    name = rng.choice(domain.names)
    schema = _schema(name, domain.description, params, required, rng)
    results = domain.results if domain.kind == "query" else ()
    return GenericTool(name, domain.kind, domain.phrases, tuple(params), frozenset(required), results, schema)


def invented_tool(rng: random.Random, split: Split) -> GenericTool:
    """A tool whose name means nothing ("quanvox_function"): only the request's use of the name, and
    its values, say what to call."""
    while True:
        word = "".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(1, 3)))
        if in_split(word, split):
            break
    name = f"{word}_{rng.choice(['function', 'tool', 'op', 'transform'])}" if rng.random() < 0.7 else word
    params = [Param(rng.choice(["input", "x", "value", "n", "number"]), rng.choice(["int", "int", "number"]))]
    if rng.random() < 0.3:
        params.append(Param(rng.choice(["y", "factor", "offset", "label"]), rng.choice(["int", "text"])))
    description = f"Apply the {word} function to an input."
    schema = _schema(name, description, params, {p.name for p in params}, rng)
    phrases = (f"apply the {word} function to {{v}}", f"apply {word} to {{v}}")
    return GenericTool(
        name,
        "action",
        phrases,
        tuple(params),
        frozenset(p.name for p in params),
        (("result", "int"),),
        schema,
    )


def toolset(rng: random.Random, split: Split, size: int) -> list[GenericTool]:
    picked = rng.sample(domains(split), size)
    return [invented_tool(rng, split) if rng.random() < 0.12 else domain_tool(rng, d) for d in picked]


# ---- requests ----------------------------------------------------------------------------------------
def _spoken(value: Any, kind: str, rng: random.Random, gloss: bool = False) -> str:
    if kind == "text" or (kind == "word" and rng.random() < 0.3):
        text = quoted(value, rng)
        return text + (
            f" ({rng.choice(['Hello Group', 'the name', 'in full'])})" if gloss and rng.random() < 0.2 else ""
        )
    return str(value)


def _extra(p: Param, value: Any, rng: random.Random) -> str:
    words = p.name.replace("_", " ")
    if p.kind == "bool":
        said = rng.choice([("true", "false"), ("yes", "no"), ("on", "off")])[0 if value else 1]
        return rng.choice([f"with {words} set to {said}", f"{words}: {said}", f"{words} {said}"])
    if p.kind == "object":
        parts = [f"{f.replace('_', ' ')} {_spoken(value[f], k, rng)}" for f, k in p.fields]
        return f"with {words} " + " and ".join(parts)
    spoken = _spoken(value, p.kind, rng)
    return rng.choice(
        [f"with {words} {spoken}", f"{words} {spoken}", f"{words}: {spoken}", f"{words} = {spoken}"]
    )


def _value(p: Param, rng: random.Random, split: Split) -> Any:
    if p.kind == "object":
        return {f: draw(k, rng, split) for f, k in p.fields}
    return draw(p.kind, rng, split, list(p.options))


def _call_notation(tool: GenericTool, args: dict[str, Any]) -> str | None:
    if any(isinstance(v, dict) for v in args.values()):
        return None
    if len(args) == 1:
        return f"{tool.name}({next(iter(args.values()))!r})"
    return f"{tool.name}(" + ", ".join(f"{k}={v!r}" for k, v in args.items()) + ")"


def make_request(rng: random.Random, tool: GenericTool, split: Split, plain: bool = False) -> Request:
    """A request for `tool`. `plain`: no greeting, tail or closing words around it (the copy-first
    curriculum's requests: the frame, the intent and the values)."""
    args = {
        p.name: _value(p, rng, split) for p in tool.params if p.name in tool.required or rng.random() < 0.5
    }
    primary, *extras = tool.params
    phrase = rng.choice(tool.phrases).format(v=_spoken(args[primary.name], primary.kind, rng, gloss=True))
    said = [_extra(p, args[p.name], rng) for p in extras if p.name in args]
    if said:
        phrase += (" " if rng.random() < 0.6 else ", ") + ", ".join(said)
    shape = rng.random()
    notation = _call_notation(tool, args)
    heldout = HELDOUT_FRAMES["call" if notation and shape < 0.2 else tool.kind]
    if notation and shape < 0.2:
        frames = CALL_FRAMES + (heldout if split == "heldout" else [])
        text = rng.choice(frames).format(call=notation)
    elif shape < 0.3:
        text = rng.choice(NAMED_FRAMES).format(name=tool.name, p=_as_verb_phrase(tool, phrase))
    else:
        frames = QUERY_FRAMES if tool.kind == "query" else ACTION_FRAMES
        frames = frames + (heldout if split == "heldout" else [])
        text = rng.choice(frames).format(p=phrase, P=phrase[0].upper() + phrase[1:])
    if plain:
        return Request(text, tool, args)
    prefix = rng.choice(PREFIXES)
    if prefix.endswith(", "):
        text = text[0].lower() + text[1:]
    text = prefix + text + (rng.choice(TAILS) if rng.random() < 0.1 else "") + rng.choice(SUFFIXES)
    return Request(text, tool, args)


def _as_verb_phrase(tool: GenericTool, phrase: str) -> str:
    return phrase if tool.kind == "action" else f"get {phrase}"


# ---- results and answers -----------------------------------------------------------------------------
def tool_result(rng: random.Random, request: Request) -> Any:
    tool = request.tool
    if tool.kind == "action":
        return rng.choice([{"status": "ok", "id": rng.randint(1, 9999)}, "OK", {"ok": True}])
    fields = {f: draw(k, rng, "train") for f, k in tool.results}
    if len(fields) == 1 and rng.random() < 0.4:
        return next(iter(fields.values()))
    return fields


def final_answer(rng: random.Random, request: Request, result: Any) -> str:
    if request.tool.kind == "action":
        return rng.choice(["Done.", "Done: the tool says it worked.", f"Done. The result: {_text(result)}."])
    if isinstance(result, dict):
        listed = ", ".join(f"{k.replace('_', ' ')} {v}" for k, v in result.items())
        return rng.choice([f"Here is the result: {listed}.", f"The tool returned {listed}."])
    return rng.choice([f"The result is {result}.", f"It is {result}.", f"The answer is {result}."])


def _text(result: Any) -> str:
    return result if isinstance(result, str) else json.dumps(result, ensure_ascii=False)


def _failure_note(rng: random.Random, request: Request, tools: list[GenericTool]) -> str:
    key = rng.choice(list(request.arguments))
    wrong = {**request.arguments, key: rng.choice(["", 0, "value"])}
    errors = [
        f"{key}: Input should be a valid integer",
        f"{key}: Field required",
        f"no tool named 'get_{rng.choice(['data', 'info', 'result'])}'; "
        f"tools: {sorted(t.name for t in tools)}",
        "the tool call was not finished",
    ]
    return DEFAULT_NOTE.format(
        attempt=1, tool=request.tool.name, arguments=wrong, error=rng.choice(errors)
    ).strip()


def call_message(calls: list[Request], content: str = "") -> dict[str, Any]:
    tool_calls = [
        {"type": "function", "function": {"name": r.tool.name, "arguments": r.arguments}} for r in calls
    ]
    return {"role": "assistant", "content": content, "tool_calls": tool_calls}


NO_CALL_SHARE = 0.2  # exchanges answered without a call: small talk (2 in 5) or a request no tool serves


def exchange(
    rng: random.Random,
    tools: list[GenericTool],
    split: Split,
    no_call_share: float = NO_CALL_SHARE,
    plain: bool = False,
) -> list[dict[str, Any]]:
    """One user turn and everything after it: a direct answer, or calls, results and the answer
    (`plain`: requests without the words around them, see `make_request`)."""
    shape = rng.random()
    if shape < 0.4 * no_call_share:
        user, reply = rng.choice(CHITCHAT)
        return [{"role": "user", "content": user}, {"role": "assistant", "content": reply}]
    if shape < no_call_share:  # a request no offered tool can serve
        others = [d for d in domains(split) if not any(t.name in d.names for t in tools)]
        request = make_request(rng, domain_tool(rng, rng.choice(others)), split)
        return [
            {"role": "user", "content": request.text},
            {"role": "assistant", "content": rng.choice(NO_TOOL_REPLIES)},
        ]
    requests = [make_request(rng, rng.choice(tools), split, plain)]
    text = requests[0].text
    if shape > 0.88:  # two calls in one turn
        requests.append(make_request(rng, rng.choice(tools), split, plain))
        text += " Also, " + requests[1].text[0].lower() + requests[1].text[1:]
    note = _failure_note(rng, requests[0], tools) if rng.random() < 0.06 else ""
    results = [tool_result(rng, r) for r in requests]
    return [
        {"role": "user", "content": text},
        call_message(requests, note),
        *(
            {"role": "tool", "name": r.tool.name, "content": _text(res)}
            for r, res in zip(requests, results, strict=False)
        ),
        {
            "role": "assistant",
            "content": " ".join(final_answer(rng, r, res) for r, res in zip(requests, results, strict=False)),
        },
    ]


def dialogue_group(
    rng: random.Random,
    split: Split = "train",
    size: int = 8,
    no_call_share: float = NO_CALL_SHARE,
    plain: bool = False,
) -> tuple[list[list[dict]], list[dict]]:
    """`size` dialogues over one random tool set and system prompt (so training computes their shared
    system block once): (the dialogues' messages, the tool schemas). `plain`: see `make_request`."""
    tools = toolset(rng, split, rng.choice([1, 2, 2, 3, 3, 4]))
    system = rng.choice([None, *SYSTEM_PROMPTS])
    head = [{"role": "system", "content": system}] if system else []
    groups = []
    for _ in range(size):
        messages = head + exchange(rng, tools, split, no_call_share, plain)
        if rng.random() < 0.15:
            messages += exchange(rng, tools, split, no_call_share, plain)
        groups.append(messages)
    return groups, [t.schema for t in tools]
