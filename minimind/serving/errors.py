"""Errors in OpenAI's shape, `{"error": {"message", "type", "param", "code"}}` with a 4xx/5xx status: `APIError`
and the helpers that build it for an invalid request, a timeout, a body over the size limit or one FastAPI could not
parse."""

from __future__ import annotations

from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException


class APIError(Exception):
    """An error reported in OpenAI's shape."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        type: str = "invalid_request_error",
        headers: dict | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def _validation_error(exc: RequestValidationError) -> APIError:
    first = exc.errors()[0]
    location = [str(part) for part in first.get("loc", ()) if part != "body"]
    if first.get("type") == "json_invalid":
        return APIError(400, "The request body is not valid JSON.", code="invalid_json")
    param = ".".join(location) or None
    return APIError(
        400,
        f"Invalid value for '{param}': {first.get('msg')}" if param else first.get("msg"),
        param=param,
        code="invalid_value",
    )


def _timed_out(seconds: float) -> APIError:
    # 504, not 408: OpenAI's client retries a 408 at once, which would only time out again.
    return APIError(
        504,
        f"The request did not finish within the server's request timeout of {seconds:g} s; its "
        "generation was stopped. Ask for fewer tokens (max_tokens) or raise --request_timeout.",
        type="timeout_error",
        code="request_timeout",
    )


def _request_too_large(limit: int) -> APIError:
    return APIError(
        413,
        f"The request body is larger than this server's limit of {limit} bytes "
        "(--max_request_bytes). Send a shorter prompt.",
        code="request_too_large",
    )


def _body_parse_error(exc: StarletteHTTPException) -> APIError | None:
    """The OpenAI error for a body FastAPI could not parse, by what its generic 400 wraps: JSON nested deeper than
    the decoder recurses, or bytes that are not UTF-8."""
    cause = exc.__cause__
    if isinstance(cause, RecursionError):
        return APIError(400, "The request body is not valid JSON here: it is nested too deeply.", code="invalid_json")
    if isinstance(cause, UnicodeDecodeError):
        return APIError(400, "The request body is not valid JSON: it is not UTF-8 text.", code="invalid_json")
    return None
