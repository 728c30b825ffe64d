"""What the server takes on: `ServerLimits` (per request and at once, the `minimind-serve` flags), `Admission`
(a 429 beyond the concurrency limit) and `BodyLimit` (ASGI middleware: a 413 for a body over `max_request_bytes`
before it is parsed)."""

from __future__ import annotations

from dataclasses import dataclass

from minimind.chat import DEFAULT_MAX_NEW_TOKENS
from minimind.serving.errors import APIError, _request_too_large

DEFAULT_MAX_TOKENS = DEFAULT_MAX_NEW_TOKENS


@dataclass
class ServerLimits:
    """What one request may ask for, and how much the server takes on at once (the `minimind-serve` flags)."""

    max_context: int | None = None  # prompt + completion; default: the model's max_position_embeddings
    default_max_tokens: int = DEFAULT_MAX_TOKENS
    max_tokens: int = 4096  # most completion tokens a request may ask for (per choice)
    max_n: int = 8  # most choices per request
    max_prompt_tokens: int | None = None  # default: max_context - 1
    max_concurrent_requests: int = 64  # more get 429 with Retry-After
    request_timeout: float = 600.0  # seconds; a request still generating then is cancelled
    kv_cache_tokens: int | None = None  # the KV cache's size; default: see `check`
    max_batch: int = 8  # sequences one compiled step decodes together (`--engine compiled`)
    max_request_bytes: int = 1 << 20  # a larger request body gets 413 before it is parsed

    # The default cache: enough for every admitted request at full context, but no more than this many tokens
    # (about 0.5 GB for the 64M default model) unless two contexts need more.
    DEFAULT_KV_CACHE_TOKENS = 65536

    def check(self, context_limit: int) -> ServerLimits:
        """These limits with defaults filled in from the model's context; ValueError naming the flag if bad."""
        context = self.max_context or context_limit
        if not 1 < context <= context_limit:
            raise ValueError(
                f"max_context must be in [2, {context_limit}] (the model's max_position_embeddings), "
                f"got {self.max_context}"
            )
        prompt = self.max_prompt_tokens or context - 1
        for name, value, low in (
            ("default_max_tokens", self.default_max_tokens, 1),
            ("max_tokens", self.max_tokens, 1),
            ("max_n", self.max_n, 1),
            ("max_concurrent_requests", self.max_concurrent_requests, 1),
            ("max_batch", self.max_batch, 1),
            ("max_request_bytes", self.max_request_bytes, 1),
            ("max_prompt_tokens", prompt, 1),
        ):
            if value < low:
                raise ValueError(f"{name} must be at least {low}, got {value}")
        if prompt >= context:
            raise ValueError(
                f"max_prompt_tokens ({prompt}) must be below max_context ({context}), leaving room for a completion"
            )
        if self.default_max_tokens > self.max_tokens:
            raise ValueError(
                f"default_max_tokens ({self.default_max_tokens}) must not exceed max_tokens ({self.max_tokens})"
            )
        if not self.request_timeout > 0:
            raise ValueError(f"request_timeout must be positive seconds, got {self.request_timeout}")
        # Two contexts at least: one sequence of the whole context plus the spare the batching engine needs to
        # keep scheduling while other sequences hold pages. Sequences that do not fit wait for pages.
        cache = self.kv_cache_tokens or max(
            2 * context, min((self.max_concurrent_requests + 1) * context, self.DEFAULT_KV_CACHE_TOKENS)
        )
        if cache < 2 * context:
            raise ValueError(
                f"kv_cache_tokens ({cache}) must hold two full contexts (2 x max_context = "
                f"{2 * context}). Fix: raise --kv_cache_tokens or lower --max_context"
            )
        return ServerLimits(
            context,
            self.default_max_tokens,
            self.max_tokens,
            self.max_n,
            prompt,
            self.max_concurrent_requests,
            self.request_timeout,
            cache,
            self.max_batch,
            max_request_bytes=self.max_request_bytes,
        )


class Admission:
    """Counts requests in progress; one more than `limit` is refused with a 429 that says when to retry."""

    RETRY_AFTER_S = 1

    def __init__(self, limit: int):
        self.limit, self.active = limit, 0

    def enter(self) -> None:
        # Only the event loop thread calls this, so a plain counter is enough.
        if self.active >= self.limit:
            raise APIError(
                429,
                f"The server is busy: {self.limit} requests are in progress (--max_concurrent_"
                f"requests). Retry after {self.RETRY_AFTER_S} s.",
                type="requests",
                code="rate_limit_exceeded",
                headers={"Retry-After": str(self.RETRY_AFTER_S)},
            )
        self.active += 1

    def leave(self) -> None:
        self.active -= 1


class BodyLimit:
    """ASGI middleware: a request body over `limit` bytes gets the 413 before anything reads or parses it; by its
    Content-Length at once, and a chunked one as soon as the bytes received pass the limit. A body within the limit
    is read here and handed on whole, so the app's own body parsing reads it once.

    The 413 closes the connection: the rest of a refused body is never read, and a kept-alive connection would
    read it as the next request."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or ()).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.limit:
            return await self._refuse(scope, receive, send)
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] != "http.request":  # the client left: the app sees that as usual
                return await self.app(scope, _replay([message], receive), send)
            chunk, more = message.get("body", b""), message.get("more_body", False)
            size += len(chunk)
            if size > self.limit:
                return await self._refuse(scope, receive, send)
            chunks.append(chunk)
        body = {"type": "http.request", "body": b"".join(chunks), "more_body": False}
        await self.app(scope, _replay([body], receive), send)

    async def _refuse(self, scope, receive, send):
        error = _request_too_large(self.limit)
        error.headers = {"Connection": "close"}
        await error.response()(scope, receive, send)


def _replay(messages: list[dict], receive):
    """A `receive` that returns `messages` first, then what the client sends next (its disconnect)."""

    async def replayed():
        return messages.pop(0) if messages else await receive()

    return replayed
