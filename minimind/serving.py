"""An OpenAI-compatible HTTP server for a MiniMind checkpoint (FastAPI + uvicorn).

Endpoints: `GET /v1/models`, `POST /v1/chat/completions`, `POST /v1/completions`, streaming (server-sent
events ending with `data: [DONE]`) or not. Errors use OpenAI's shape
`{"error": {"message", "type", "param", "code"}}` with a 4xx status.

Concurrency: one generation runs at a time; other requests wait on a lock. transformers' continuous
batching (`generate_batch` / `ContinuousBatchingManager`, paged KV cache) was tried with a tiny MiniMind on
CPU: with a small model change it gives the same greedy tokens, but each scheduler step costs ~0.1 s
against ~1 ms for `generate` (4 short requests: 4 s vs 0.05 s, plus a 12 s warm-up), and its sampling
settings are per manager, not per request. See docs/ecosystem-serve.md.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from contextlib import closing
from typing import Iterator, Literal

import anyio
import torch
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

from minimind.chat import SamplingParams, TextStream, chat_prompt_ids

DEFAULT_MAX_TOKENS = 256


# ----------------------------------------------------------------------------------------------------------
# Requests (unknown OpenAI fields such as `user` or `presence_penalty` are accepted and ignored)
# ----------------------------------------------------------------------------------------------------------

class _Sampling(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)  # the newer name of max_tokens
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    n: int = Field(default=1, ge=1, le=16)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: dict | None = None
    seed: int | None = None

    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


class _TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: str


class _Message(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[_TextPart] | None = None

    def as_template_message(self) -> dict:
        content = self.content if not isinstance(self.content, list) else "".join(p.text for p in self.content)
        # "developer" is OpenAI's new name for the system role.
        return {"role": "system" if self.role == "developer" else self.role, "content": content or ""}


class ChatCompletionRequest(_Sampling):
    messages: list[_Message] = Field(min_length=1)


class CompletionRequest(_Sampling):
    prompt: str | list[str]


# ----------------------------------------------------------------------------------------------------------
# Errors
# ----------------------------------------------------------------------------------------------------------

class APIError(Exception):
    """An error the client caused, reported in OpenAI's shape."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type

    def response(self) -> JSONResponse:
        body = {"message": self.message, "type": self.type, "param": self.param, "code": self.code}
        return JSONResponse({"error": body}, status_code=self.status)


def _validation_error(exc: RequestValidationError) -> APIError:
    first = exc.errors()[0]
    location = [str(part) for part in first.get("loc", ()) if part != "body"]
    if first.get("type") == "json_invalid":
        return APIError(400, "The request body is not valid JSON.", code="invalid_json")
    param = ".".join(location) or None
    return APIError(400, f"Invalid value for '{param}': {first.get('msg')}" if param else first.get("msg"),
                    param=param, code="invalid_value")


# ----------------------------------------------------------------------------------------------------------
# Generation
# ----------------------------------------------------------------------------------------------------------

class Generator:
    """The model, its tokenizer and the lock that lets one request generate at a time."""

    def __init__(self, model, tokenizer, model_id: str, max_context: int | None = None,
                 default_max_tokens: int = DEFAULT_MAX_TOKENS):
        limit = model.config.max_position_embeddings
        if max_context is not None and not 1 < max_context <= limit:
            raise ValueError(f"max_context must be in [2, {limit}] (the model's max_position_embeddings)")
        self.model, self.tokenizer, self.model_id = model, tokenizer, model_id
        self.max_context = max_context or limit
        self.default_max_tokens = default_max_tokens
        self.lock = threading.Lock()

    def sampling_params(self, request: _Sampling, prompt_tokens: int, param: str) -> SamplingParams:
        """Per-request sampling settings; rejects prompts that leave no room to generate in the context."""
        room = self.max_context - prompt_tokens
        if room < 1:
            raise APIError(400, f"This model's maximum context length is {self.max_context} tokens; the "
                                f"{param} has {prompt_tokens} tokens, leaving no room for a completion.",
                           param=param, code="context_length_exceeded")
        wanted = request.max_completion_tokens or request.max_tokens or self.default_max_tokens
        # Asking for more than the context holds is not an error: the completion ends with "length".
        return SamplingParams(max_new_tokens=min(wanted, room), do_sample=request.temperature > 0,
                              temperature=request.temperature, top_p=request.top_p, stop=request.stop_list())


def _completion_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def _usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _sse(payload) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


class _Job:
    """One request turned into generation work: n choices for each prompt, numbered like OpenAI does."""

    def __init__(self, generator: Generator, request: _Sampling, prompts: list[list[int]], param: str):
        self.generator, self.request, self.prompts = generator, request, prompts
        self.params = [generator.sampling_params(request, len(ids), param) for ids in prompts]
        self.prompt_tokens = sum(len(ids) for ids in prompts)

    def choices(self) -> Iterator[tuple[int, Iterator[str], TextStream]]:
        """(choice index, text pieces, stream) per choice, generated one after another.

        The whole request holds the generation lock, so a `seed` fixes all its choices and concurrent requests
        never interleave. Closing this iterator early (a client that went away) stops the running generation.
        """
        with self.generator.lock:
            if self.request.seed is not None:
                torch.manual_seed(self.request.seed)
            index = 0
            for prompt_ids, params in zip(self.prompts, self.params):
                for _ in range(self.request.n):
                    stream = TextStream(self.generator.model, self.generator.tokenizer, prompt_ids, params)
                    pieces = iter(stream)
                    try:
                        yield index, pieces, stream
                    finally:
                        pieces.close()  # cancels and joins the generation thread if the consumer stopped early
                    index += 1


def _run_to_end(job: _Job) -> tuple[list[tuple[str, str]], int]:
    """[(text, finish_reason)] per choice and the completion token count."""
    results, completion_tokens = [], 0
    with closing(job.choices()) as choices:  # an error in one choice frees the lock at once
        for _, pieces, stream in choices:
            results.append(("".join(pieces), stream.finish_reason))
            completion_tokens += stream.completion_tokens
    return results, completion_tokens


# ----------------------------------------------------------------------------------------------------------
# The app
# ----------------------------------------------------------------------------------------------------------

def _completion_response(job, model_id, id_prefix, object_name, choice_body):
    """The non-streaming body shared by both endpoints; `choice_body(text)` gives the endpoint's own fields."""
    results, completion_tokens = _run_to_end(job)
    return {
        "id": _completion_id(id_prefix), "object": object_name, "created": int(time.time()), "model": model_id,
        "choices": [{"index": i, **choice_body(text), "logprobs": None, "finish_reason": reason}
                    for i, (text, reason) in enumerate(results)],
        "usage": _usage(job.prompt_tokens, completion_tokens),
    }


def create_app(generator: Generator) -> FastAPI:
    app = FastAPI(title="MiniMind OpenAI-compatible server")

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
        error_type = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return APIError(exc.status_code, str(exc.detail), type=error_type).response()

    def check_model(name: str):
        if name != generator.model_id:
            raise APIError(404, f"The model '{name}' does not exist; this server serves '{generator.model_id}'.",
                           param="model", code="model_not_found")

    @app.get("/v1/models")
    def list_models():
        return {"object": "list", "data": [_model_card(generator.model_id)]}

    @app.get("/v1/models/{model_id}")
    def get_model(model_id: str):
        check_model(model_id)
        return _model_card(model_id)

    # Plain `def` endpoints: FastAPI runs them in its thread pool, so a request waiting for the generation
    # lock does not block the event loop.
    @app.post("/v1/chat/completions")
    def chat_completions(request: ChatCompletionRequest):
        check_model(request.model)
        messages = [message.as_template_message() for message in request.messages]
        job = _Job(generator, request, [chat_prompt_ids(generator.tokenizer, messages)], param="messages")
        if request.stream:
            return _event_stream(_stream_events(job, generator.model_id, chat=True))
        return _completion_response(job, generator.model_id, "chatcmpl", "chat.completion",
                                    lambda text: {"message": {"role": "assistant", "content": text}})

    @app.post("/v1/completions")
    def completions(request: CompletionRequest):
        check_model(request.model)
        prompts = [request.prompt] if isinstance(request.prompt, str) else request.prompt
        if not prompts or not all(prompts):
            raise APIError(400, "The prompt must be a non-empty string (or a list of them).", param="prompt",
                           code="invalid_value")
        # Raw text: no chat template, no bos (the tokenizer never adds special tokens by itself).
        job = _Job(generator, request, [generator.tokenizer(p)["input_ids"] for p in prompts], param="prompt")
        if request.stream:
            return _event_stream(_stream_events(job, generator.model_id, chat=False))
        return _completion_response(job, generator.model_id, "cmpl", "text_completion",
                                    lambda text: {"text": text})

    return app


def _model_card(model_id: str) -> dict:
    return {"id": model_id, "object": "model", "created": 0, "owned_by": "minimind"}


def _event_stream(events: Iterator[str]) -> StreamingResponse:
    return StreamingResponse(_closed_when_abandoned(events), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


async def _closed_when_abandoned(events: Iterator[str]):
    """Advance the sync event generator in worker threads (generation blocks), and close it as soon as the
    response stops, a client disconnect included: that cancels the running generation and frees the lock
    now rather than whenever the garbage collector gets to it."""
    try:
        while (event := await anyio.to_thread.run_sync(next, events, None)) is not None:
            yield event
    finally:
        # Not awaited (a cancelled task cannot await) and not on the event loop (closing joins the generation
        # thread). `run_sync` finishes its call even when cancelled, so `events` is not running now.
        threading.Thread(target=events.close, daemon=True).start()


def _wants_usage(request: _Sampling) -> bool:
    return bool((request.stream_options or {}).get("include_usage"))


def _stream_events(job: _Job, model_id: str, chat: bool) -> Iterator[str]:
    """Server-sent events: per choice its text pieces and a chunk with the finish reason; then, if asked, a
    usage chunk; then `[DONE]`. Chat chunks carry `delta`s (the first one announces the role), completion
    chunks `text`."""
    header = {"id": _completion_id("chatcmpl" if chat else "cmpl"),
              "object": "chat.completion.chunk" if chat else "text_completion",
              "created": int(time.time()), "model": model_id}

    def chunk(index, text, finish_reason=None, role=None):
        if chat:
            delta = {"role": role, "content": text} if role else ({"content": text} if text else {})
            choice = {"index": index, "delta": delta}
        else:
            choice = {"index": index, "text": text}
        return _sse({**header, "choices": [{**choice, "logprobs": None, "finish_reason": finish_reason}]})

    completion_tokens = 0
    with closing(job.choices()) as choices:  # closing this generator early must stop the generation now
        for index, pieces, stream in choices:
            if chat:
                yield chunk(index, "", role="assistant")
            for piece in pieces:
                yield chunk(index, piece)
            yield chunk(index, "", stream.finish_reason)
            completion_tokens += stream.completion_tokens
    if _wants_usage(job.request):
        yield _sse({**header, "choices": [], "usage": _usage(job.prompt_tokens, completion_tokens)})
    yield "data: [DONE]\n\n"


def serve(app: FastAPI, host: str = "127.0.0.1", port: int = 8000) -> None:
    import uvicorn

    uvicorn.run(app, host=host, port=port, log_level="info")
