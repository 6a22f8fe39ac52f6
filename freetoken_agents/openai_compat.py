"""`OpenAICompatibleModel`: the Agent on any OpenAI-compatible server (vLLM, SGLang, llama-server,
`freetoken serve`, OpenAI itself), through the same `ModelBackend` protocol as FreeTokenModel.

    from freetoken_agents import Agent, OpenAICompatibleModel

    model = OpenAICompatibleModel("http://127.0.0.1:8000/v1", "Qwen/Qwen3-30B-A3B", api_key="...")
    result = Agent(model, [get_weather]).run("Weather in Paris?")

The server holds the model, so this backend keeps the context as the conversation it will send:
the messages last rendered, then the text of the current assistant turn (what the model wrote,
its tool calls in the parser's text format, failure notes the Agent appended). Its positions are
characters of that transcript (not tokens: the client has no tokenizer), and anchors are marks
in it. A rollback cuts the transcript back to the anchor; the next request re-sends the kept
prefix and the server's prefix cache absorbs it (on `freetoken serve`, vLLM or SGLang the
re-sent prefix costs no prefill). An unfinished turn (text kept by a rollback, the failure
note) goes as a last assistant message, so the reply is a fresh turn that sees it.

Tool calls arrive as structured `tool_calls` and are written into the transcript in the parser's
format (Hermes by default), where the Agent parses them back; `tool_choice` becomes the
request's (a forced call is the server's to enforce: `freetoken serve` does it by grammar).
`usage()` is the server's: prefilled = prompt tokens not served from its cache, decoded =
completion tokens, reused = its cached tokens (`prompt_tokens_details.cached_tokens`).

Why the `openai` package (an optional dependency, `pip install 'freetoken-agents[openai]'`):
it is the reference client of the API every one of these servers implements, and brings
streaming (server-sent events), typed responses, retries with backoff and the error classes.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Generator, Iterator, Sequence
from typing import Any, NoReturn

from .anchors import AnchorBook, AnchorHandle, RollbackOutcome
from .backend import BackendBase
from .errors import AgentError
from .model import GenerateRequest, GenEvent, Usage, common_prefix_length
from .parsers import ToolCallParser, parser_for
from .trace import AnchorKind

logger = logging.getLogger(__name__)


class ModelServerError(AgentError):
    """The OpenAI-compatible server refused or failed a request (`status`: its HTTP status, None
    when it could not be reached). The run stops: this is not the model's fault."""

    def __init__(self, message: str, *, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class _Transcript:
    """The context as characters (what AnchorBook needs of a session without native anchors)."""

    def __init__(self) -> None:
        self.chars: list[int] = []

    @property
    def token_ids(self) -> list[int]:
        return list(self.chars)

    @property
    def position(self) -> int:
        return len(self.chars)

    def truncate(self, position: int) -> None:
        del self.chars[position:]


_RENDERS_KEPT = 64  # rendered conversations remembered (a run renders a few per step)


def _codes(text: str) -> list[int]:
    return [ord(c) for c in text]


class OpenAICompatibleModel(BackendBase):
    """A `ModelBackend` over an OpenAI-compatible chat-completions server (see the module docstring).

    base_url: the API root (".../v1"); model: the served model's id; api_key: sent as a Bearer
    key (servers that need none accept any); family: the text format the transcript keeps tool
    calls in (default Hermes); timeout: seconds per request; max_retries: the client's retries of
    connection errors, 429 and 5xx; client: an `openai.OpenAI` to use instead of building one.

    Its capabilities are `BackendBase`'s: the transcript is its one context (an Agent's runs take
    turns on it; the server, not this client, runs requests side by side), and the context size is
    the server's, unknown here.
    """

    def __init__(
        self,
        base_url: str,
        model: str,
        api_key: str | None = None,
        *,
        family: str | None = None,
        timeout: float = 600.0,
        max_retries: int = 2,
        max_anchors: int = 64,
        client: Any = None,
    ) -> None:
        self.model = model
        self.name = f"openai:{model}"
        self.parser: ToolCallParser = parser_for(family)
        self.client = client if client is not None else _client(base_url, api_key, timeout, max_retries)
        self.anchors = AnchorBook(max_anchors)
        self._transcript = _Transcript()
        self._rendered: dict[tuple[int, ...], tuple[list[dict], list[dict]]] = {}
        self._usage = Usage()

    # ---- context --------------------------------------------------------------------------------
    @property
    def position(self) -> int:
        """Characters in the transcript."""
        return self._transcript.position

    @property
    def text(self) -> str:
        """The transcript: what the next request will send, as text."""
        return "".join(map(chr, self._transcript.chars))

    def render(
        self, messages: Sequence[dict], tools: Sequence[dict] | None, *, generation_prompt: bool = True
    ) -> list[int]:
        """The transcript of `messages` (and `tools`) as character codes; the messages are kept so
        that a request can send them as they are."""
        parts = [f"<|tools|>{json.dumps(list(tools), sort_keys=True)}<|end|>\n"] if tools else []
        for message in messages:
            content = message.get("content") or ""
            for call in message.get("tool_calls") or []:
                fn = call.get("function", call)
                content += self._call_text(fn["name"], fn.get("arguments") or {})
            parts.append(f"<|{message['role']}|>{content}<|end|>\n")
        if generation_prompt:
            parts.append("<|assistant|>")
        ids = _codes("".join(parts))
        self._rendered[tuple(ids)] = (json.loads(json.dumps(list(messages), default=str)), list(tools or []))
        while len(self._rendered) > _RENDERS_KEPT:
            del self._rendered[next(iter(self._rendered))]
        return ids

    def sync(self, ids: Sequence[int]) -> None:
        """Make the transcript exactly `ids` (nothing is sent until the next `generate`)."""
        ids = list(ids)
        keep = common_prefix_length(self._transcript.chars, ids)
        if keep < self._transcript.position:
            self._transcript.truncate(keep)
            self.anchors.forget_after(keep)
        self._transcript.chars.extend(ids[keep:])

    def append_text(self, text: str) -> None:
        """Add `text` to the current assistant turn (a failure note): sent with the next request."""
        self._transcript.chars.extend(_codes(text))

    def reset(self) -> None:
        self.anchors.clear()
        self._transcript = _Transcript()
        self._rendered.clear()

    def usage(self) -> Usage:
        return self._usage.model_copy()

    # ---- anchors --------------------------------------------------------------------------------
    def anchor(self, kind: AnchorKind, label: str | None = None) -> AnchorHandle:
        return self.anchors.place(self._transcript, kind, label)

    def rollback(self, anchor: AnchorHandle, *, validate: str | None = None) -> RollbackOutcome:
        """Cut the transcript back to `anchor`; the next request re-sends what is kept. `validate`
        is accepted for the protocol: the transcript is checked by comparing its characters."""
        start = self.position
        rebuilt = self.anchors.rollback(self._transcript, anchor)
        if rebuilt:
            self._transcript.chars = list(anchor.prefix)
            self.anchors.forget_after(anchor.position)
            self.anchors.rebind(self._transcript, anchor)
        return RollbackOutcome(start, anchor.position, rebuilt)

    # ---- generation -----------------------------------------------------------------------------
    def generate(self, request: GenerateRequest) -> Generator[GenEvent, None, None]:
        """One request, streamed: text deltas as they come, then for each tool call an anchor
        before it and its text in the parser's format, then `done`."""
        messages, tools = self._conversation(request.prefix)
        params = self._params(request, tools)
        if request.prefix:
            self.append_text(request.prefix)
            yield GenEvent("text", request.prefix)
        stream = self._create(messages=messages, **params)
        calls: dict[int, dict[str, str]] = {}
        finish = "stop"
        try:
            for chunk in stream:
                if chunk.usage is not None:
                    self._count(chunk.usage)
                for choice in chunk.choices or []:
                    delta = choice.delta
                    reasoning = getattr(delta, "reasoning_content", None)  # vLLM, llama-server, ours
                    if isinstance(reasoning, str) and reasoning:
                        yield GenEvent("reasoning", reasoning)
                    if delta.content:
                        self.append_text(delta.content)
                        yield GenEvent("text", delta.content)
                    for part in delta.tool_calls or []:
                        if part.index not in calls and calls:
                            yield from self._emit_calls(calls, upto=part.index)
                        slot = calls.setdefault(part.index, {"name": "", "arguments": ""})
                        if part.function is not None:
                            slot["name"] += part.function.name or ""
                            slot["arguments"] += part.function.arguments or ""
                    if choice.finish_reason:
                        finish = "length" if choice.finish_reason == "length" else "stop"
        except Exception as e:
            _raise_server_error(e)
        finally:
            stream.close()
        yield from self._emit_calls(calls, upto=None)
        yield GenEvent("done", finish_reason=finish)

    # ---- internals ------------------------------------------------------------------------------
    def _conversation(self, prefix: str) -> tuple[list[dict], list[dict]]:
        """The messages the transcript stands for: the longest rendered prefix of it, plus the
        unfinished assistant turn after it (text kept by a rollback, failure notes)."""
        chars = self._transcript.chars
        best: tuple[int, ...] | None = None
        for key in self._rendered:
            if (
                len(key) <= len(chars)
                and (best is None or len(key) > len(best))
                and chars[: len(key)] == list(key)
            ):
                best = key
        if best is None:
            raise ModelServerError("the context holds no rendered conversation: call sync(render(...)) first")
        messages, tools = self._rendered[best]
        wire = [_wire_message(m) for m in messages]
        tail = "".join(map(chr, chars[len(best) :])) + prefix
        if tail.strip():
            wire.append({"role": "assistant", "content": tail})
        return wire, tools

    def _params(self, request: GenerateRequest, tools: list[dict]) -> dict[str, Any]:
        params: dict[str, Any] = {
            "model": self.model,
            "temperature": request.temperature,
            "max_tokens": max(1, request.max_new_tokens + (request.max_call_tokens if tools else 0)),
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if request.seed is not None:
            params["seed"] = request.seed
        if request.top_p is not None:
            params["top_p"] = request.top_p
        if request.logit_bias:
            params["logit_bias"] = {str(k): v for k, v in request.logit_bias.items()}
        if request.stop:  # the server applies them (OpenAI takes at most 4)
            params["stop"] = list(request.stop)
        if tools:
            params["tools"] = tools
            if not request.tools:
                params["tool_choice"] = "none"
            elif request.force == "*":
                params["tool_choice"] = "required"
            elif request.force is not None:
                params["tool_choice"] = {"type": "function", "function": {"name": request.force}}
        return params

    def _create(self, **params: Any) -> Any:
        try:
            return self.client.chat.completions.create(**params)
        except Exception as e:
            _raise_server_error(e)

    def _count(self, usage: Any) -> None:
        details = getattr(usage, "prompt_tokens_details", None)
        cached = int(getattr(details, "cached_tokens", None) or 0)
        self._usage.prefilled += max(0, int(usage.prompt_tokens or 0) - cached)
        self._usage.decoded += int(usage.completion_tokens or 0)
        self._usage.reused += cached

    def _emit_calls(self, calls: dict[int, dict[str, str]], *, upto: int | None) -> Iterator[GenEvent]:
        """Anchor + text of each buffered call before index `upto` (all when None), in order."""
        for index in sorted(i for i in calls if upto is None or i < upto):
            call = calls.pop(index)
            yield GenEvent("anchor", anchor=self.anchor("tool_call", label=call["name"]))
            text = self._call_text(call["name"], call["arguments"])
            self.append_text(text)
            yield GenEvent("text", text)

    def _call_text(self, name: str, arguments: dict | str) -> str:
        """A call in the parser's format; arguments that are not a JSON object stay a string (the
        Agent's parse then reports the call as malformed, and the model retries)."""
        if isinstance(arguments, str):
            try:
                parsed = json.loads(arguments or "{}")
            except json.JSONDecodeError:
                parsed = arguments
            arguments = parsed if isinstance(parsed, dict) else arguments
        if isinstance(arguments, dict):
            return self.parser.format_call(name, arguments)  # the family's own form (XML for some)
        p, body = self.parser, arguments
        if not p.needs_name_in_prefix():
            body = f'{{"name": {json.dumps(name)}, "arguments": {arguments}}}'
        return p.call_prefix(name) + body + p.call_suffix()


def _wire_message(message: dict[str, Any]) -> dict[str, Any]:
    """A chat message as the API takes it: tool-call arguments as JSON text, content a string."""
    out = {k: v for k, v in message.items() if k in ("role", "content", "tool_call_id", "name", "tool_calls")}
    out["content"] = out.get("content") or ""
    if out["role"] != "tool":
        out.pop("tool_call_id", None)
    if out["role"] not in ("tool", "user", "system") or not out.get("name"):
        out.pop("name", None)
    if out["role"] == "tool":
        out.pop("name", None)
    calls = []
    for call in message.get("tool_calls") or []:
        fn = call.get("function", call)
        args = fn.get("arguments")
        text = args if isinstance(args, str) else json.dumps(args or {}, ensure_ascii=False)
        calls.append(
            {"id": call.get("id"), "type": "function", "function": {"name": fn["name"], "arguments": text}}
        )
    if calls:
        out["tool_calls"] = calls
    else:
        out.pop("tool_calls", None)
    return out


def _client(base_url: str, api_key: str | None, timeout: float, max_retries: int) -> Any:
    try:
        import openai
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError(
            "OpenAICompatibleModel needs the openai package: pip install 'freetoken-agents[openai]'"
        ) from e
    return openai.OpenAI(
        base_url=base_url, api_key=api_key or "not-needed", timeout=timeout, max_retries=max_retries
    )


def _raise_server_error(error: Exception) -> NoReturn:
    """Raise openai's errors as ModelServerError (status and the server's message); others as they are."""
    import openai

    if isinstance(error, openai.APIStatusError):
        message = f"the server answered {error.status_code}: {error.message}"
        raise ModelServerError(message, status=error.status_code) from error
    if isinstance(error, openai.APIError):
        raise ModelServerError(f"the server failed: {error.message}") from error
    raise error
