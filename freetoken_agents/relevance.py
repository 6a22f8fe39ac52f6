"""Relevant calls: an opt-in gate under which, with tool_choice "auto", the model may call only the
offered tools the request is about: those whose name or description shares a content word with
the user's messages, and those the model was trained to call (`FreeTokenModel.trained_tools`: it
decides those itself). When no offered tool is relevant, the turn answers without a call.

Why: a small model that learned to call tools it never saw calls one for every request, fitting
or not (the embedded model, continued on generic tool use, answered a third of the requests no
offered tool serves without a call, and only the small talk among them). Which tool a request is
about is what its words say: held-out requests reach their tools through the words of the tools'
names and descriptions ("the share price for QEV" for "Get the latest stock price for a ticker").
What the gate cannot see: a request that names its tool by a synonym alone ("how much is 2 plus
3" for `add: Add two integers.`) gets no call, unless the model was trained on that tool. So it is
opt-in, measured with and without (README, "The embedded model").

Words: runs of letters (any script), lowercased, three letters or more, less a plural "s", minus
the English function words below; a tool's name is split at "_", "-", "." and camelCase humps.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Iterable, Sequence
from typing import Any

from .grounding import message_texts

# Words that say nothing of what a request is about: English function words, and the verbs and
# nouns every request and tool description uses ("get", "tell", "please", "function", "tool").
STOP_WORDS = frozenset(
    """
    about above after again against all also and any are around because been before being below
    between both but can cannot could did does doing down during each few for from further had has
    have having her here hers herself him himself his how into its itself just let lets more most
    much must myself nor not now off once only other our ours ourselves out over own same she
    should some such than that the their theirs them themselves then there these they this those
    through too under until upon very was were what whats when where which while who whom why will
    with would yes you your yours yourself yourselves
    hello hey thank thanks please quick question help need want like know tell give show get got
    find make use used call run return returns value input output tool tools function functions
    args arg argument arguments one two new current latest given
    """.split()
)

_LETTERS = re.compile(r"[^\W\d_]+")
# Short words the stop words leave out (under three letters, so never content words): they break
# an acronym's run of words ("text to speech" is no "tts").
_FUNCTION_WORDS = frozenset("a an as at be by do if in is it me my no of on or so to up us we".split())
_HUMP = re.compile(r"(?<=[a-z])(?=[A-Z])")


def content_words(text: str) -> frozenset[str]:
    """The words of `text` that can say what it is about (module docstring)."""
    out = set()
    for word in _LETTERS.findall(_HUMP.sub(" ", text)):
        word = word.lower()
        if len(word) > 3 and word.endswith("s") and not word.endswith("ss"):
            word = word[:-1]
        if len(word) >= 3 and word not in STOP_WORDS:
            out.add(word)
    return frozenset(out)


def tool_name(tool: dict[str, Any]) -> str:
    """An OpenAI-style tool schema's name (`{"type": "function", "function": {...}}` or bare)."""
    return str(tool.get("function", tool).get("name", ""))


def acronyms(text: str) -> frozenset[str]:
    """The initials of every run of three or four consecutive words of `text` that are not stop
    words ("Compute the body mass index." gives "bmi"): a request may name its tool so."""
    words = [w.lower() for w in _LETTERS.findall(_HUMP.sub(" ", text))]
    out: set[str] = set()
    run: list[str] = []
    for word in [*words, ""]:
        if word and word not in STOP_WORDS and word not in _FUNCTION_WORDS:
            run.append(word[0])
            continue
        for n in (3, 4):
            out.update("".join(run[i : i + n]) for i in range(len(run) - n + 1))
        run = []
    return frozenset(out)


def tool_words(tool: dict[str, Any]) -> frozenset[str]:
    """The content words of a tool's name and description, and the description's acronyms
    (`acronyms`: a description spells out what a name or a request may abbreviate)."""
    name = re.sub(r"[_\-.]+", " ", tool_name(tool))
    description = tool.get("function", tool).get("description")
    description = description if isinstance(description, str) else ""
    words = content_words(name) | content_words(description)
    return words | acronyms(description)


def relevant_tools(
    tools: Sequence[dict[str, Any]], sources: Iterable[str], trained: Collection[str] = ()
) -> list[dict[str, Any]]:
    """The tools of `tools` a request in `sources` is about (module docstring), in their order:
    a content word in common with the tool's name or description, or a tool named in `trained`."""
    words: set[str] = set()
    for text in sources:
        words |= content_words(text)
    return [t for t in tools if tool_name(t) in trained or words & tool_words(t)]


def user_sources(messages: Sequence[dict[str, Any]]) -> list[str]:
    """The texts a call's relevance is judged from: the user's messages (their text parts). Not the
    tools' results: a result mentioning a word is no request to call a tool about it."""
    return message_texts(messages, ("user",))
