"""OpenAI-style errors: every failure the server answers is `{"error": {message, type, param, code}}`
with the status OpenAI uses for it, so clients raise their usual exceptions (`openai`'s
BadRequestError, AuthenticationError, RateLimitError, NotFoundError, ...)."""

from __future__ import annotations

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


def from_validation_error(error: RequestValidationError) -> OpenAIError:
    """A 400 for a body that is not JSON or does not match the request schema, naming the first
    offending field (`messages.1.role`) the way OpenAI's `param` does."""
    problems = list(error.errors())
    if not problems:
        return bad_request("invalid request")
    first = problems[0]
    if first.get("type") == "json_invalid":
        detail = (first.get("ctx") or {}).get("error", "")
        return bad_request(f"We could not parse the JSON body of your request: {detail}".rstrip(": "))
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    # A tagged union adds the tag to the path (messages.1.user.content): drop it, keep the field.
    param = ".".join(p for p in loc if p not in _MESSAGE_TAGS) or None
    if first.get("type") == "union_tag_invalid" and param:
        param += ".role"  # the tag that matched no message type
    where = f"{param}: " if param else ""
    more = f" (and {len(problems) - 1} more problems)" if len(problems) > 1 else ""
    return bad_request(f"{where}{first.get('msg', 'invalid value')}{more}", param=param)


_MESSAGE_TAGS = {"system", "developer", "user", "assistant", "tool"}  # the message union's tags
