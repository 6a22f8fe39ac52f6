"""OpenAI-style errors: every failure the server answers is `{"error": {message, type, param, code}}`
with the status OpenAI uses for it, so clients raise their usual exceptions (`openai`'s
BadRequestError, AuthenticationError, RateLimitError, NotFoundError, ...).

A request that does not match the schema is described in the user's terms, one problem per
error: `param` is the field as written in the request (`messages[0].content`), never pydantic's
path through the schema (`messages.0.user.content.str`), and of the alternatives a field may take
(a string or an array of parts) the one the value was meant to be is the one reported on.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse


class OpenAIError(Exception):
    """A request the server refuses or could not finish. `status`: the HTTP status; `type`,
    `param` and `code` as in OpenAI's error objects; `headers`: extra response headers (e.g.
    Retry-After on a 429)."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message = status, message
        self.type, self.param, self.code = type, param, code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, param=param, code=code)


def internal_error(error: BaseException) -> OpenAIError:
    return OpenAIError(500, f"internal error: {type(error).__name__}: {error}", type="server_error")


def model_not_found(model: str, served: str) -> OpenAIError:
    """A 404 for a model id this server does not serve (OpenAI's shape for it)."""
    return OpenAIError(
        404,
        f"The model `{model}` does not exist; this server serves `{served}`.",
        param="model",
        code="model_not_found",
    )


def from_validation_error(error: RequestValidationError) -> OpenAIError:
    """A 400 for a body that is not JSON or does not match the request schema: its first problem,
    named as the user wrote the field (see the module docstring)."""
    problems = list(error.errors())
    if not problems:
        return bad_request("invalid request")
    if problems[0].get("type") == "json_invalid":
        detail = (problems[0].get("ctx") or {}).get("error", "")
        return bad_request(f"We could not parse the JSON body of your request: {detail}".rstrip(": "))
    return _describe(_pick([_Problem.of(p) for p in problems]))


@dataclass(frozen=True)
class _Problem:
    """One pydantic error in the user's terms. `path`: the fields and indexes as in the request;
    `unions`: where in `path` a union's alternatives part, with each alternative's label
    (`str`, `list[TextPart]`, a model's name) in `branches`."""

    path: tuple[str | int, ...]
    kind: str
    message: str
    input: Any
    ctx: dict[str, Any]
    unions: tuple[int, ...] = ()
    branches: tuple[str, ...] = ()

    @classmethod
    def of(cls, error: Any) -> _Problem:
        path: list[str | int] = []
        unions: list[int] = []
        branches: list[str] = []
        loc = list(error.get("loc", ()))
        for i, part in enumerate(loc):
            if i == 0 and part == "body":  # FastAPI's own prefix
                continue
            in_message = len(path) >= 2 and path[-2] == "messages" and isinstance(path[-1], int)
            if in_message and part in _MESSAGE_TAGS:
                continue  # the message union's tag: it matched, so it names no alternative
            if _is_branch(part):
                unions.append(len(path))
                branches.append(str(part))
                continue
            path.append(part)
        return cls(
            tuple(path),
            str(error.get("type", "")),
            str(error.get("msg", "invalid value")),
            error.get("input"),
            dict(error.get("ctx") or {}),
            tuple(unions),
            tuple(branches),
        )

    def only_wrong_type_at(self, at: int) -> bool:
        """This alternative failed only because the value is of another JSON type."""
        return len(self.path) == at and (self.kind.endswith("_type") or self.kind == "literal_error")


def _pick(problems: Sequence[_Problem], level: int = 0) -> _Problem:
    """The one problem to report: the first, but inside a union the alternative the value was
    meant to be (the one it got furthest in), and if none, a type error naming them all."""
    first = problems[0]
    if len(first.unions) <= level:
        return first
    at = first.unions[level]
    same = [
        p
        for p in problems
        if len(p.unions) > level and p.unions[level] == at and p.path[:at] == first.path[:at]
    ]
    further = [p for p in same if not p.only_wrong_type_at(at)]
    if not further:  # e.g. a literal alternative that was not matched: report its value error
        further = [p for p in same if p.kind == "literal_error" and isinstance(p.input, str)]
    if further:
        branch = further[0].branches[level]
        return _pick([p for p in further if p.branches[level] == branch], level + 1)
    expected = tuple(dict.fromkeys(_TYPE_WORDS.get(_label_kind(p.branches[level]), "a value") for p in same))
    return _Problem(first.path[:at], "union_type", "", first.input, {"expected": expected})


def _describe(problem: _Problem) -> OpenAIError:
    path, kind = list(problem.path), problem.kind
    if kind in ("union_tag_invalid", "union_tag_not_found"):
        path.append("role")  # the message union's tag: the role that matched no message type
    param = _param(path)
    if kind in ("missing", "union_tag_not_found"):
        message = f"Missing required parameter: '{param}'."
        return bad_request(message, param=param, code="missing_required_parameter")
    if kind == "union_tag_invalid":
        tags = problem.ctx.get("expected_tags", "")
        return bad_request(
            f"Invalid value for '{param}': {problem.ctx.get('tag')!r}; supported values are {tags}.",
            param=param,
            code="invalid_value",
        )
    if kind == "literal_error" and len(path) >= 3 and path[-1] == "type" and path[-3] == "content":
        refused = _UNSUPPORTED_PARTS.get(str(problem.input))
        if refused:  # an image (audio, file) part: say so, not "Input should be 'text'"
            part = _param(path[:-1])
            return bad_request(
                f"{part}: {refused} are not supported (this model reads text only)",
                param=part,
                code="unsupported_content",
            )
    expected = problem.ctx.get("expected") if kind == "union_type" else _TYPE_WORDS.get(kind)
    if expected:
        words = expected if isinstance(expected, str) else _one_of(expected)
        message = (
            f"Invalid type for '{param}': expected {words}, but got {_json_type(problem.input)} instead."
        )
        return bad_request(message, param=param, code="invalid_type")
    return bad_request(f"{param}: {problem.message}" if param else problem.message, param=param or None)


def _param(path: Sequence[str | int]) -> str:
    """`messages[0].content`: fields joined by dots, indexes in brackets, as OpenAI writes them."""
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _is_branch(part: Any) -> bool:
    """Whether a `loc` part is the label pydantic gives a union's alternative (`str`,
    `list[TextPart]`, `literal['auto','none']`, `NamedToolChoice`), not a field: no field of the
    OpenAI API starts with a capital letter, holds a bracket or is named after a type."""
    return isinstance(part, str) and (part[:1].isupper() or "[" in part or part in _TYPE_LABELS)


def _label_kind(label: str) -> str:
    head, _, inner = label.partition("[")
    if head[:1].isupper():
        return "model_type"
    if head == "list" and inner[:1].isupper():
        return "model_list_type"
    return {"str": "string_type", "list": "list_type", "dict": "dict_type", "int": "int_type"}.get(
        head, f"{head}_type"
    )


def _one_of(words: Sequence[str]) -> str:
    return words[0] if len(words) == 1 else "one of " + ", ".join(words[:-1]) + f" or {words[-1]}"


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    return "an array" if isinstance(value, list) else "an object"


_MESSAGE_TAGS = {"system", "developer", "user", "assistant", "tool"}  # the message union's tags
_TYPE_LABELS = {"str", "int", "float", "bool", "dict", "list", "none"}
_TYPE_WORDS = {
    "string_type": "a string",
    "list_type": "an array",
    "model_list_type": "an array of objects",
    "dict_type": "an object",
    "model_type": "an object",
    "model_attributes_type": "an object",
    "int_type": "an integer",
    "int_parsing": "an integer",
    "int_from_float": "an integer",
    "float_type": "a number",
    "float_parsing": "a number",
    "bool_type": "a boolean",
    "bool_parsing": "a boolean",
}
_UNSUPPORTED_PARTS = {
    "image_url": "images",
    "image": "images",
    "input_audio": "audio inputs",
    "audio": "audio inputs",
    "file": "files",
    "video": "videos",
}
