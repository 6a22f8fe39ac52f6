"""Generic tool use on held-out tools: tool sets drawn from the held-out domains (names,
descriptions, parameters and request phrases training never saw), held-out values and wordings.

Scored through the real engine and SDK, the way the Agent asks: with tool_choice auto (the model
decides whether and what to call; arguments grammar-constrained) and forced (the tool is named,
the model fills the arguments), plus requests no offered tool serves and small talk, which must be
answered without a call.
"""

from __future__ import annotations

import random
from typing import Any

from pydantic import BaseModel, Field
from tqdm.auto import tqdm

from freetoken_agents import FreeTokenModel, GenerateRequest

from .generic import CHITCHAT, Request, domain_tool, domains, make_request, toolset

SYSTEM_PROMPT = "You are a helpful assistant."


class GenericScore(BaseModel):
    """Right tool and exactly the right arguments on held-out tools."""

    prompts: int
    auto_exact: float = Field(description="tool_choice auto: one call, right tool, exact arguments")
    auto_right_tool: float = Field(description="tool_choice auto: one call to the right tool")
    forced_exact: float = Field(description="the tool forced: exactly the right arguments")
    direct_prompts: int
    direct: float = Field(description="share of no-fit requests and small talk answered without a call")


def heldout_cases(count: int, seed: int) -> list[tuple[list[dict[str, Any]], Request]]:
    """(offered tool schemas, request) pairs; one to four held-out tools are offered."""
    rng = random.Random(seed)
    cases = []
    for _ in range(count):
        tools = toolset(rng, "heldout", rng.choice([1, 2, 3, 4]))
        cases.append(([t.schema for t in tools], make_request(rng, rng.choice(tools), "heldout")))
    return cases


def no_fit_cases(count: int, seed: int) -> list[tuple[list[dict[str, Any]], str]]:
    """(offered tool schemas, message) where no offered tool fits: another domain's request, or small talk."""
    rng = random.Random(seed + 1)
    cases = []
    for i in range(count):
        tools = toolset(rng, "heldout", rng.choice([1, 2, 3]))
        if i % 3 == 2:
            cases.append(([t.schema for t in tools], rng.choice(CHITCHAT)[0]))
            continue
        names = {t.name for t in tools}
        other = rng.choice([d for d in domains("heldout") if not names & set(d.names)])
        cases.append(([t.schema for t in tools], make_request(rng, domain_tool(rng, other), "heldout").text))
    return cases


def _calls(
    model: FreeTokenModel,
    tools: list[dict],
    text: str,
    force: str | None,
    system: bool,
    ground: bool,
    relevant: bool = False,
) -> list:
    messages = ([{"role": "system", "content": SYSTEM_PROMPT}] if system else []) + [
        {"role": "user", "content": text}
    ]
    model.sync(model.render(messages, tools))
    sources = [text] if ground else None
    request = GenerateRequest(
        tools=tools,
        force=force,
        max_new_tokens=60,
        argument_sources=sources,
        call_sources=[text] if relevant else None,
    )
    text = "".join(e.text for e in model.generate(request) if e.kind == "text")
    parsed = model.parser.parse(text, tools)
    if parsed.malformed or parsed.partial:
        return [None]
    return parsed.calls


def score_generic(
    model: FreeTokenModel,
    prompts: int,
    direct_prompts: int,
    seed: int,
    ground: bool = False,
    relevant: bool = False,
) -> GenericScore:
    """`ground`: grounded arguments (string arguments are spans of the request); `relevant`:
    relevant calls (with tool_choice auto, only tools the request is about)."""
    auto = right = forced = 0
    cases = heldout_cases(prompts, seed)
    for i, (tools, request) in enumerate(tqdm(cases, desc="generic tools", leave=False)):
        want = (request.tool.name, request.arguments)
        calls = _calls(model, tools, request.text, None, system=i % 2 == 0, ground=ground, relevant=relevant)
        if len(calls) == 1 and calls[0] is not None:
            right += calls[0].name == want[0]
            auto += (calls[0].name, calls[0].arguments) == want
        calls = _calls(model, tools, request.text, request.tool.name, system=i % 2 == 0, ground=ground)
        forced += len(calls) == 1 and calls[0] is not None and calls[0].arguments == want[1]
    direct = 0
    for i, (tools, text) in enumerate(tqdm(no_fit_cases(direct_prompts, seed), desc="no fit", leave=False)):
        direct += _calls(model, tools, text, None, system=i % 2 == 0, ground=ground, relevant=relevant) == []
    n = max(prompts, 1)
    return GenericScore(
        prompts=prompts,
        auto_exact=auto / n,
        auto_right_tool=right / n,
        forced_exact=forced / n,
        direct_prompts=direct_prompts,
        direct=direct / max(direct_prompts, 1),
    )
