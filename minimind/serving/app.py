"""The FastAPI app (`create_app`): `GET /v1/models`, `POST /v1/chat/completions` and `POST /v1/completions`, the
API key check, the error handlers, and the responses: whole (`_run_to_end`, which notices a client gone) or
streamed as server-sent events ending with `data: [DONE]` (`_stream_events`)."""

from __future__ import annotations

import asyncio
import json
import secrets
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from minimind.chat import THINK_CLOSE, THINK_OPEN, chat_prompt_ids, split_reasoning
from minimind.serving.errors import APIError, _body_parse_error, _validation_error
from minimind.serving.generator import Generator, _Job, _Tokenizers
from minimind.serving.limits import Admission, BodyLimit
from minimind.serving.schema import ChatCompletionRequest, CompletionRequest, _Sampling, check_unicode
from minimind.tokenizer import render_conversation


def _completion_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def _usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def _sse(payload) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


async def _run_to_end(job: _Job, request: Request, poll_s: float = 0.05) -> list[str]:
    """Every choice's text; cancels the job as soon as the client disconnects (polled: a plain response has no
    other way to notice) and raises the timeout error at the deadline."""
    texts = [""] * len(job.sequences)

    async def collect():
        async for index, piece in job.events():
            if piece:
                texts[index] += piece

    task = asyncio.create_task(collect())
    try:
        while not task.done():
            await asyncio.wait({task}, timeout=poll_s)
            if not task.done() and await request.is_disconnected():
                task.cancel()
                raise ClientGone()
        task.result()  # raises what the generation raised
        return texts
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


class ClientGone(Exception):
    """The client closed the connection before its response was ready; nobody is left to answer."""


def _api_key_check(api_key: str | None):
    async def check(request: Request):
        if api_key is None:
            return
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not given:
            raise APIError(
                401,
                "You didn't provide an API key. Send it as 'Authorization: Bearer <key>' (the "
                "openai client does so with api_key=...).",
                code="invalid_api_key",
            )
        if not secrets.compare_digest(given.strip().encode(), api_key.encode()):
            raise APIError(401, "Incorrect API key provided.", code="invalid_api_key")

    return check


def create_app(generator: Generator, api_key: str | None = None) -> FastAPI:
    """The FastAPI app; with `api_key`, every /v1 route needs `Authorization: Bearer <api_key>`, and the
    interactive docs and the OpenAPI schema (/docs, /redoc, /openapi.json) are not served: a browser fetches the
    schema without the key. Request bodies over `generator.limits.max_request_bytes` get a 413 unread."""
    if api_key is not None and not api_key:
        raise ValueError("api_key must not be empty; pass None to serve without a key")
    admission = Admission(generator.limits.max_concurrent_requests)
    tokenizers = _Tokenizers(generator.tokenizer)

    async def lifespan(app):
        generator.engine.start()
        yield
        generator.engine.stop()
        tokenizers.close()

    no_docs = {"docs_url": None, "redoc_url": None, "openapi_url": None} if api_key is not None else {}
    app = FastAPI(title="MiniMind OpenAI-compatible server", lifespan=asynccontextmanager(lifespan), **no_docs)
    app.add_middleware(BodyLimit, limit=generator.limits.max_request_bytes)
    app.state.admission, app.state.generator = admission, generator
    router = APIRouter(dependencies=[Depends(_api_key_check(api_key))])

    @app.exception_handler(APIError)
    async def on_api_error(request: Request, exc: APIError):
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def on_invalid_request(request: Request, exc: RequestValidationError):
        return _validation_error(exc).response()

    @app.exception_handler(Exception)
    async def on_server_error(request: Request, exc: Exception):
        # Still OpenAI's shape, so clients report it properly; the traceback goes to the server log.
        return APIError(500, f"Generation failed: {type(exc).__name__}: {exc}", type="server_error").response()

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, exc: StarletteHTTPException):
        if (error := _body_parse_error(exc)) is not None:
            return error.response()
        error_type = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return APIError(exc.status_code, str(exc.detail), type=error_type).response()

    def check_model(name: str):
        if name != generator.model_id:
            raise APIError(
                404,
                f"The model '{name}' does not exist; this server serves '{generator.model_id}'.",
                param="model",
                code="model_not_found",
            )

    @router.get("/v1/models")
    async def list_models():
        return {"object": "list", "data": [_model_card(generator.model_id)]}

    @router.get("/v1/models/{model_id}")
    async def get_model(model_id: str):
        check_model(model_id)
        return _model_card(model_id)

    async def respond(request: Request, job: _Job, chat: bool):
        admission.enter()
        if job.request.stream:
            return _EventStream(_stream_events(job, generator.model_id, chat), on_close=admission.leave)
        try:
            texts = await _run_to_end(job, request)
        except ClientGone:
            return JSONResponse({}, status_code=499)  # nobody reads it; nginx's "client closed request"
        finally:
            admission.leave()
        id_prefix, object_name = ("chatcmpl", "chat.completion") if chat else ("cmpl", "text_completion")
        return {
            "id": _completion_id(id_prefix),
            "object": object_name,
            "created": int(time.time()),
            "model": generator.model_id,
            "choices": [
                {
                    "index": i,
                    **(_chat_message(text) if chat else {"text": text}),
                    "logprobs": None,
                    "finish_reason": sequence.finish_reason,
                }
                for i, (text, sequence) in enumerate(zip(texts, job.sequences))
            ],
            "usage": _usage(job.prompt_tokens, job.completion_tokens),
        }

    def chat_ids(tokenizer, messages: list[dict]) -> list[int]:
        if (
            generator.max_prompt_chars is not None
            and sum(len(message["content"]) for message in messages) > generator.max_prompt_chars
        ):
            # Only the rendered text is certain to reach the model: a template may leave parts of messages out.
            rendered = render_conversation(tokenizer, messages, add_generation_prompt=True)
            generator.check_prompt_chars(sum(len(text) for text, _ in rendered), "messages")
        return chat_prompt_ids(tokenizer, messages)

    @router.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        check_unicode(body)
        check_model(body.model)
        messages = [message.as_template_message() for message in body.messages]
        job = _Job(generator, body, [await tokenizers.run(chat_ids, messages)], param="messages")
        return await respond(request, job, chat=True)

    @router.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        check_unicode(body)
        check_model(body.model)
        prompts = [body.prompt] if isinstance(body.prompt, str) else body.prompt
        if not prompts or not all(prompts):
            raise APIError(
                400, "The prompt must be a non-empty string (or a list of them).", param="prompt", code="invalid_value"
            )
        for prompt in prompts:
            generator.check_prompt_chars(len(prompt), "prompt")
        # Raw text: no chat template, no bos (the tokenizer never adds special tokens by itself).
        ids = await tokenizers.run(lambda tokenizer: [tokenizer(prompt)["input_ids"] for prompt in prompts])
        job = _Job(generator, body, ids, param="prompt")
        return await respond(request, job, chat=False)

    app.include_router(router)
    return app


def _chat_message(text: str) -> dict:
    reasoning, answer = split_reasoning(text)
    extra = {"reasoning_content": reasoning} if reasoning is not None else {}
    return {"message": {"role": "assistant", "content": answer, **extra}}


class _ReasoningDeltas:
    """A chat choice's streamed text as `delta` fields: what `split_reasoning` puts in the think block goes to
    `reasoning_content`, the rest to `content`. A tail that could still grow into a tag, or text that is only
    whitespace so far (it may come before "<think>"), waits for the next piece."""

    def __init__(self):
        self.text, self.sent = "", {"reasoning_content": 0, "content": 0}

    def feed(self, piece: str) -> dict:
        self.text += piece
        settled = self.text
        for size in range(min(len(settled), len(THINK_CLOSE) - 1), 0, -1):
            if THINK_OPEN.startswith(settled[-size:]) or THINK_CLOSE.startswith(settled[-size:]):
                settled = settled[:-size]
                break
        return self._new(settled) if settled.strip() else {}

    def finish(self) -> dict:
        return self._new(self.text)

    def _new(self, text: str) -> dict:
        reasoning, answer = split_reasoning(text)
        delta = {}
        for name, value in (("reasoning_content", reasoning), ("content", answer)):
            if value and len(value) > self.sent[name]:
                delta[name], self.sent[name] = value[self.sent[name] :], len(value)
        return delta


def _model_card(model_id: str) -> dict:
    return {"id": model_id, "object": "model", "created": 0, "owned_by": "minimind"}


class _EventStream(StreamingResponse):
    """Server-sent events whose generator is closed, and `on_close` called, however the response ends: finished,
    client gone (even before the first event) or server shutting down. Closing cancels the generation."""

    def __init__(self, events: AsyncIterator[str], on_close):
        super().__init__(
            events, media_type="text/event-stream", headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        )
        self.events, self.on_close = events, on_close

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            try:
                await self.events.aclose()
            finally:
                self.on_close()


def _wants_usage(request: _Sampling) -> bool:
    return bool((request.stream_options or {}).get("include_usage"))


async def _stream_events(job: _Job, model_id: str, chat: bool) -> AsyncIterator[str]:
    """Server-sent events: per choice its text pieces (choices interleave as they generate) and a chunk with its
    finish reason; then, if asked, a usage chunk; then `[DONE]`. Chat chunks carry `delta`s (the first one of a
    choice announces the role), completion chunks `text`. An error after the stream began (the timeout, a failed
    generation) is an `error` event, as OpenAI sends it, and ends the stream."""
    header = {
        "id": _completion_id("chatcmpl" if chat else "cmpl"),
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": int(time.time()),
        "model": model_id,
    }

    def chunk(index, content, finish_reason=None):
        choice = {"index": index, **({"delta": content} if chat else {"text": content})}
        return _sse({**header, "choices": [{**choice, "logprobs": None, "finish_reason": finish_reason}]})

    deltas = [_ReasoningDeltas() for _ in job.sequences]
    if chat:
        for index in range(len(job.sequences)):
            yield chunk(index, {"role": "assistant", "content": ""})
    try:
        async for index, piece in job.events():
            if not chat:
                yield chunk(index, piece or "", None if piece is not None else job.sequences[index].finish_reason)
            elif piece is not None:
                if delta := deltas[index].feed(piece):
                    yield chunk(index, delta)
            else:
                if delta := deltas[index].finish():
                    yield chunk(index, delta)
                yield chunk(index, {}, job.sequences[index].finish_reason)
    except APIError as error:
        yield _sse(error.body())
        return
    except Exception as error:  # the status line is long sent: the error can only be an event
        yield _sse(APIError(500, f"Generation failed: {type(error).__name__}: {error}", type="server_error").body())
        return
    if _wants_usage(job.request):
        yield _sse({**header, "choices": [], "usage": _usage(job.prompt_tokens, job.completion_tokens)})
    yield "data: [DONE]\n\n"
