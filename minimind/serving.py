"""An OpenAI-compatible HTTP server for a MiniMind checkpoint (FastAPI + uvicorn).

Endpoints: `GET /v1/models`, `POST /v1/chat/completions`, `POST /v1/completions`, streaming (server-sent
events ending with `data: [DONE]`) or not. Errors use OpenAI's shape
`{"error": {"message", "type", "param", "code"}}` with a 4xx/5xx status.

Concurrency: every choice of every request is one sequence in a batching engine, where one background thread runs
batched decode steps over all active sequences, new ones join between steps, and temperature/top-k/top-p are per
sequence: transformers' continuous batching (`BatchEngine`, paged KV cache, the default) or compiled steps over a
static cache with a row per sequence (`CompiledBatchEngine`, `--engine compiled`). A request whose client goes
away, or that outlives `request_timeout`, is cancelled in the engine before its next step. Limits (`ServerLimits`)
bound each request; `BodyLimit` turns away a body over `max_request_bytes` with a 413 before it is parsed;
`Admission` turns away requests beyond the concurrency limit with a 429. Prompts are rendered and tokenized in
worker threads (`_Tokenizers`), off the event loop. See docs/ecosystem-serve.md.
"""

from __future__ import annotations

import asyncio
import copy
import inspect
import ipaddress
import json
import math
import secrets
import threading
import time
import uuid
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from typing import Literal

import torch
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException as StarletteHTTPException
from transformers import GenerationConfig, TextStreamer

from minimind.chat import (
    DEFAULT_MAX_NEW_TOKENS,
    THINK_CLOSE,
    THINK_OPEN,
    SamplingParams,
    StopStringCutter,
    chat_prompt_ids,
    reply_room,
    split_reasoning,
)
from minimind.decode import RowCache, RowDecoder, choose_tokens, sampling_warpers
from minimind.tokenizer import render_conversation

DEFAULT_MAX_TOKENS = DEFAULT_MAX_NEW_TOKENS


# ----------------------------------------------------------------------------------------------------------
# Requests (unknown OpenAI fields such as `user` or `presence_penalty` are accepted and ignored). Numbers and
# flags are strict: pydantic's lax mode reads `true` as 1, 2.0 as 2 and "yes" as true, so a client's type mistake
# would silently become another request. Floats still take integers, which JSON writers emit for whole numbers.
# ----------------------------------------------------------------------------------------------------------


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str
    max_tokens: int | None = Field(default=None, ge=1, strict=True)
    max_completion_tokens: int | None = Field(default=None, ge=1, strict=True)  # the newer name of max_tokens
    temperature: float = Field(default=1.0, ge=0.0, le=2.0, strict=True)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0, strict=True)
    top_k: int = Field(default=0, ge=0, strict=True)  # not OpenAI's, but vLLM's and llama.cpp's; 0 = no top-k filter
    n: int = Field(default=1, ge=1, strict=True)  # the upper bound is the server's --max_n
    stop: str | list[str] | None = None
    stream: bool = Field(default=False, strict=True)
    stream_options: dict | None = None
    seed: int | None = Field(default=None, strict=True)

    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def max_tokens_param(self) -> tuple[str, int | None]:
        if self.max_completion_tokens is not None:
            return "max_completion_tokens", self.max_completion_tokens
        return "max_tokens", self.max_tokens


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


def _texts(value, path: str):
    """(field path, string) for every string a request holds, the path in the error's `param` form
    ("messages.0.content"). `stream_options` is a free-form dict nobody reads as text: not walked."""
    if isinstance(value, str):
        yield path, value
    elif isinstance(value, BaseModel):
        for name in type(value).model_fields:
            if name != "stream_options":
                yield from _texts(getattr(value, name), f"{path}.{name}" if path else name)
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield from _texts(item, f"{path}.{index}")


def check_unicode(request: BaseModel) -> None:
    """A 400 naming the field for text that is not valid Unicode: JSON's escape "\\ud800" (or the same three
    bytes raw) decodes to a lone surrogate, which neither the tokenizer nor a UTF-8 response can take."""
    for path, text in _texts(request, ""):
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as error:
            raise APIError(
                400,
                f"Invalid value for '{path}': the text is not valid Unicode (a lone surrogate, "
                f"U+{ord(text[error.start]):04X}, at character {error.start}). Surrogate escapes "
                "(\\ud800-\\udfff) must come in high-low pairs.",
                param=path,
                code="invalid_value",
            ) from None


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


def _body_parse_error(exc: StarletteHTTPException) -> APIError | None:
    """The OpenAI error for a body FastAPI could not parse, by what its generic 400 wraps: JSON nested deeper than
    the decoder recurses, or bytes that are not UTF-8."""
    cause = exc.__cause__
    if isinstance(cause, RecursionError):
        return APIError(400, "The request body is not valid JSON here: it is nested too deeply.", code="invalid_json")
    if isinstance(cause, UnicodeDecodeError):
        return APIError(400, "The request body is not valid JSON: it is not UTF-8 text.", code="invalid_json")
    return None


# ----------------------------------------------------------------------------------------------------------
# Limits and admission
# ----------------------------------------------------------------------------------------------------------


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


# ----------------------------------------------------------------------------------------------------------
# Generation: transformers' continuous batching
# ----------------------------------------------------------------------------------------------------------


class BatchEngine:
    """transformers' `ContinuousBatchingManager` over the model, and a thread that hands each sequence's outputs
    to whoever waits for them (the manager has one output queue for all).

    Sampling settings are per sequence through the manager's per-request logits processors. Those exist only for
    settings the manager's generation config enables, so it enables all three with non-neutral values; every
    sequence then passes its own (greedy = top_k 1).
    """

    PAGE_SIZE = 16

    def __init__(self, model, tokenizer, max_context: int, cache_tokens: int):
        self.model, self.tokenizer = model, tokenizer
        self.max_context, self.cache_tokens = max_context, cache_tokens
        self.manager = None
        self._subscribers: dict[str, callable] = {}
        self._lock = threading.Lock()
        self._router: threading.Thread | None = None
        self._closing = threading.Event()

    def _new_manager(self):
        from transformers.generation.configuration_utils import ContinuousBatchingConfig

        config = GenerationConfig(
            do_sample=True,
            temperature=0.5,
            top_k=self.model.config.vocab_size,
            top_p=0.5,
            max_new_tokens=self.max_context,
            eos_token_id=self.tokenizer.eos_token_id,
            pad_token_id=self.tokenizer.pad_token_id,
        )
        # transformers 5.17 calls the page size `block_size`. The cache is sized explicitly: by default it takes
        # a share of free memory, which on a CPU box means gigabytes.
        size_name = (
            "page_size" if "page_size" in inspect.signature(ContinuousBatchingConfig).parameters else "block_size"
        )
        # At least one full context more than the longest sequence (ServerLimits.check): without spare pages, a
        # sequence that needs nearly the whole cache while others hold pages stops the manager ("No requests can
        # be scheduled").
        pages = self.pages_for(self.cache_tokens)
        paging = ContinuousBatchingConfig(
            **{size_name: self.PAGE_SIZE},
            num_blocks=pages,
            max_batch_tokens=max(256, self.PAGE_SIZE * 16),
            per_request_processors=True,
        )
        manager = self.model.init_continuous_batching(generation_config=config, continuous_batching_config=paging)
        manager.start()
        return manager

    def pages_for(self, tokens: int) -> int:
        return math.ceil(tokens / self.PAGE_SIZE)

    def start(self) -> None:
        with self._lock:
            if self.manager is None or not self.manager.is_running():
                # Also after a failure: a failed step stops the manager (its sequences get the error); a new
                # one serves the next requests.
                self.manager = self._new_manager()
            if self._router is None:
                self._closing.clear()
                self._router = threading.Thread(target=self._route, name="minimind-output-router", daemon=True)
                self._router.start()

    def stop(self) -> None:
        self._closing.set()
        if self._router is not None:
            self._router.join(timeout=30)
            self._router = None
        if self.manager is not None:
            self.manager.stop(block=True, timeout=30)
            self.manager = None

    def _route(self) -> None:
        while not self._closing.is_set():
            manager = self.manager
            output = manager.get_result(timeout=0.05) if manager is not None else None
            if output is None:
                time.sleep(0.005)  # get_result returns at once while no manager runs
                continue
            with self._lock:
                deliver = self._subscribers.get(output.request_id)
            if deliver is not None:
                deliver(output)

    def submit(self, prompt_ids: list[int], params: SamplingParams, deliver) -> str:
        """Queue one sequence; `deliver(output)` is called from the router thread with its cumulative outputs."""
        self.start()
        request_id = uuid.uuid4().hex
        with self._lock:
            self._subscribers[request_id] = deliver
        greedy = params.greedy
        self.manager.add_request(
            list(prompt_ids),
            request_id=request_id,
            max_new_tokens=params.max_new_tokens,
            streaming=True,
            eos_token_id=self.tokenizer.eos_token_id,
            temperature=1.0 if greedy else float(params.temperature),
            top_k=1 if greedy else (params.top_k or self.model.config.vocab_size),
            top_p=1.0 if greedy else float(params.top_p),
        )
        return request_id

    def release(self, request_id: str, cancel: bool) -> None:
        """Stop delivering the sequence's outputs and, with `cancel`, stop generating it at the next step."""
        with self._lock:
            self._subscribers.pop(request_id, None)
        if cancel and self.manager is not None:
            self.manager.cancel_request(request_id)

    @property
    def active_sequences(self) -> int:
        with self._lock:
            return len(self._subscribers)


@dataclass
class _RowOutput:
    """What `CompiledBatchEngine` hands a sequence after each of its tokens: the fields `Sequence` reads of the
    paged engine's outputs."""

    request_id: str
    generated_tokens: list[int]
    finished: bool = False
    error: str | None = None

    def is_finished(self) -> bool:
        return self.finished


class _Row:
    """A sequence in `CompiledBatchEngine`: its request, its sampling and what it has generated so far."""

    def __init__(self, request_id: str, prompt_ids: list[int], params: SamplingParams, deliver):
        self.request_id, self.prompt_ids, self.params, self.deliver = request_id, prompt_ids, params, deliver
        self.greedy = params.greedy
        self.warpers = sampling_warpers(not self.greedy, params.temperature, params.top_k, params.top_p)
        self.generated: list[int] = []
        self.first_token: int | None = None  # from the prompt's logits


class CompiledBatchEngine:
    """Batched decoding through compiled steps (`--engine compiled`): up to `max_batch` sequences decode together in
    one `RowCache` of `max_batch` x `max_context` positions, each row at its own position. One background thread
    admits waiting sequences between steps (their prompts run eagerly in one forward and their keys and values go
    to free rows), runs one step over the busy rows, samples each row with its own settings and hands each sequence its
    tokens. The busy rows are kept first (a finished row takes the last busy row's sequence), so a step runs over
    the smallest power of two that covers them: one compiled graph per such batch size (`warm_up` compiles them all
    before the first request).

    The same interface as `BatchEngine`; why a second engine: docs/ecosystem-serve.md.
    """

    PREFILL_TOKENS = 4096  # padded prompt tokens per prefill forward

    def __init__(self, model, tokenizer, max_context: int, max_batch: int, compile: bool = True):
        self.model, self.tokenizer, self.max_context, self.max_batch = model, tokenizer, max_context, max_batch
        self.decoder = RowDecoder(model, compile=compile)
        self.cache = RowCache(model.config, max_batch, max_context, self.decoder.dtype, model.device)
        self.batch_sizes = sorted({min(2**k, max_batch) for k in range(max_batch.bit_length() + 1)})
        self._caches = {rows: self.cache.first(rows) for rows in self.batch_sizes}
        self._rows: list[_Row] = []  # busy rows, in cache order
        self._waiting: list[_Row] = []
        self._cancelled: set[str] = set()
        self._subscribers: dict[str, callable] = {}
        self._wake = threading.Condition()
        self._stepping = threading.Lock()
        self._thread: threading.Thread | None = None
        self._closing = threading.Event()

    def warm_up(self) -> float:
        """Compiles the step for every batch size now instead of at the first request of that size; seconds. Before
        the engine takes requests: the steps write into every row."""
        with self._wake:
            if self._rows or self._waiting:
                raise RuntimeError("warm_up runs before the engine takes requests: sequences are in flight")
        started = time.perf_counter()
        with self._stepping:
            for rows in self.batch_sizes:
                self.decoder.step(torch.zeros(rows, 1, dtype=torch.long, device=self.model.device), self._caches[rows])
            self.cache.positions.zero_()
        return time.perf_counter() - started

    def start(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._closing.clear()
            self._thread = threading.Thread(target=self._loop, name="minimind-compiled-batch", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._closing.set()
        with self._wake:
            self._wake.notify()
        if self._thread is not None:
            self._thread.join(timeout=30)
            self._thread = None

    def submit(self, prompt_ids: list[int], params: SamplingParams, deliver) -> str:
        self.start()
        request_id = uuid.uuid4().hex
        with self._wake:
            self._subscribers[request_id] = deliver
            self._waiting.append(_Row(request_id, list(prompt_ids), params, deliver))
            self._wake.notify()
        return request_id

    def release(self, request_id: str, cancel: bool) -> None:
        with self._wake:
            self._subscribers.pop(request_id, None)
            if cancel:
                self._cancelled.add(request_id)

    @property
    def active_sequences(self) -> int:
        with self._wake:
            return len(self._subscribers)

    def _loop(self) -> None:
        while not self._closing.is_set():
            # The lock guards the bookkeeping only: the event loop takes it to submit and release sequences and
            # must not wait out a step.
            with self._wake:
                while not (self._waiting or self._rows or self._closing.is_set()):
                    self._wake.wait()
                cancelled, self._cancelled = self._cancelled, set()
                self._waiting = [r for r in self._waiting if r.request_id not in cancelled]
                room = self.max_batch - len(self._rows)
                joining, self._waiting = self._waiting[:room], self._waiting[room:]
            with self._stepping:
                try:
                    for index in reversed(range(len(self._rows))):
                        if self._rows[index].request_id in cancelled:
                            self._free(index)
                    if joining:
                        self._admit(joining)
                    if self._rows:
                        self._step()
                except Exception as error:  # every sequence in flight gets the error; the next ones start afresh
                    for row in self._rows:  # the joining ones included: admitting lists them first
                        row.deliver(
                            _RowOutput(row.request_id, list(row.generated), True, f"{type(error).__name__}: {error}")
                        )
                    self._rows.clear()
                    self.cache.positions.zero_()

    def _admit(self, joining: list[_Row]) -> None:
        first = len(self._rows)
        self._rows += joining
        groups, group, longest = [], [], 0
        for row in joining:  # prompts prefilled together, padded to the longest, up to PREFILL_TOKENS in all
            longest = max(longest, len(row.prompt_ids))
            if group and (len(group) + 1) * longest > self.PREFILL_TOKENS:
                groups.append(group)
                group, longest = [], len(row.prompt_ids)
            group.append(row)
        start = first
        for prefill_group in groups + [group]:
            logits = self.decoder.prefill(
                [row.prompt_ids for row in prefill_group], self.cache, list(range(start, start + len(prefill_group)))
            )  # [N, V]
            for row, row_logits in zip(prefill_group, logits):
                row.first_token = self._choose(row, row_logits[None])[0]
            start += len(group)
        for index in reversed(range(first, len(self._rows))):  # freeing a row moves the last one into it
            self._emit(index, self._rows[index].first_token)

    def _step(self) -> None:
        busy = len(self._rows)
        rows = next(size for size in self.batch_sizes if size >= busy)
        tokens = torch.zeros(rows, 1, dtype=torch.long, device=self.model.device)  # rows past the busy ones idle
        tokens[:busy, 0] = torch.tensor([row.generated[-1] for row in self._rows])
        logits = self.decoder.step(tokens, self._caches[rows])[:busy]  # [busy, V]
        self.cache.positions[:busy] += 1
        greedy = logits.argmax(dim=-1).tolist()
        chosen = [
            greedy[i] if row.greedy else self._choose(row, logits[i : i + 1])[0] for i, row in enumerate(self._rows)
        ]
        for index in reversed(range(busy)):  # freeing a row moves the last one into it: go from the end
            self._emit(index, chosen[index])

    @staticmethod
    def _choose(row: _Row, logits) -> list[int]:  # logits [N, V]
        return choose_tokens(None, logits, row.warpers)[:, 0].tolist()

    def _emit(self, index: int, token: int) -> None:
        row = self._rows[index]
        row.generated.append(token)
        finished = token == self.tokenizer.eos_token_id or len(row.generated) >= row.params.max_new_tokens
        row.deliver(_RowOutput(row.request_id, list(row.generated), finished))
        if finished:
            self._free(index)

    def _free(self, index: int) -> None:
        last = len(self._rows) - 1
        if index != last:
            self.cache.move_row(last, index)
            self._rows[index] = self._rows[last]
        self._rows.pop()
        self.cache.positions[last] = 0  # an idle row writes at 0 and does not widen the steps' attention


class _PieceCollector(TextStreamer):
    """transformers' incremental detokenizer (it waits for whole words and complete characters), collecting the
    finished text instead of printing it."""

    def __init__(self, tokenizer):
        super().__init__(tokenizer, skip_prompt=False, skip_special_tokens=True)
        self.pieces: list[str] = []

    def on_finalized_text(self, text: str, stream_end: bool = False):
        if text:
            self.pieces.append(text)

    def take(self) -> str:
        text, self.pieces = "".join(self.pieces), []
        return text


class Sequence:
    """One choice being generated: iterate `pieces()` for its text; then `finish_reason` and `completion_tokens`.

    Leaving the iteration early (a client gone, a timeout, a stop string) cancels it in the engine."""

    def __init__(self, engine: BatchEngine, prompt_ids: list[int], params: SamplingParams):
        self.engine, self.prompt_ids, self.params = engine, prompt_ids, params
        self.completion_tokens = 0
        self.finish_reason: str | None = None

    async def pieces(self) -> AsyncIterator[str]:
        loop = asyncio.get_running_loop()
        outputs: asyncio.Queue = asyncio.Queue()
        request_id = self.engine.submit(
            self.prompt_ids, self.params, lambda output: loop.call_soon_threadsafe(outputs.put_nowait, output)
        )
        detokenizer, cutter = _PieceCollector(self.engine.tokenizer), StopStringCutter(self.params.stop)
        output = None
        try:
            while True:
                output = await outputs.get()
                if output.error is not None:
                    raise RuntimeError(output.error)
                new_tokens = output.generated_tokens[self.completion_tokens :]
                self.completion_tokens = len(output.generated_tokens)
                if new_tokens:
                    detokenizer.put(torch.tensor(new_tokens))
                if output.is_finished():
                    detokenizer.end()
                if text := cutter.feed(detokenizer.take()):
                    yield text
                if cutter.hit:
                    self.finish_reason = "stop"
                    return
                if output.is_finished():
                    if text := cutter.finish():
                        yield text
                    ended = output.generated_tokens[-1:] == [self.engine.tokenizer.eos_token_id]
                    ran_out = self.completion_tokens >= self.params.max_new_tokens
                    self.finish_reason = "length" if ran_out and not ended else "stop"
                    return
        finally:
            self.engine.release(request_id, cancel=output is None or not output.is_finished())


# ----------------------------------------------------------------------------------------------------------
# A request: its sequences and what it reports
# ----------------------------------------------------------------------------------------------------------


class Generator:
    """What the server serves: the model, its tokenizer, its name, the limits and the batching engine."""

    ENGINES = ("paged", "compiled")

    def __init__(
        self,
        model,
        tokenizer,
        model_id: str,
        max_context: int | None = None,
        default_max_tokens: int = DEFAULT_MAX_TOKENS,
        limits: ServerLimits | None = None,
        engine: str = "paged",
        compile: bool = True,
    ):
        limits = limits or ServerLimits(
            max_context=max_context,
            default_max_tokens=default_max_tokens,
            max_tokens=max(default_max_tokens, ServerLimits.max_tokens),
        )
        self.limits = limits.check(model.config.max_position_embeddings)
        self.model, self.tokenizer, self.model_id = model, tokenizer, model_id
        self.max_context = self.limits.max_context
        # A text longer than this is certainly over max_prompt_tokens: refused without tokenizing it.
        per_token = max_chars_per_token(tokenizer)
        self.max_prompt_chars = per_token * self.limits.max_prompt_tokens if per_token else None
        if engine == "paged":
            self.engine = BatchEngine(model, tokenizer, self.max_context, cache_tokens=self.limits.kv_cache_tokens)
        elif engine == "compiled":
            slots = self.limits.max_batch * self.max_context
            if slots > self.limits.kv_cache_tokens:
                raise ValueError(
                    f"the compiled engine keeps max_batch x max_context = {self.limits.max_batch} x "
                    f"{self.max_context} = {slots} tokens of keys and values, more than kv_cache_tokens "
                    f"({self.limits.kv_cache_tokens}). Fix: lower --max_context or --max_batch, or raise "
                    "--kv_cache_tokens"
                )
            self.engine = CompiledBatchEngine(model, tokenizer, self.max_context, self.limits.max_batch, compile)
        else:
            raise ValueError(f"engine must be one of {', '.join(self.ENGINES)}, got {engine!r}")

    def check_prompt_chars(self, chars: int, param: str) -> None:
        """The 400 for a prompt whose `chars` characters are more than `max_prompt_tokens` tokens however it is
        tokenized; nothing where that is not certain."""
        if self.max_prompt_chars is not None and chars > self.max_prompt_chars:
            limits = self.limits
            raise APIError(
                400,
                f"This model's maximum context length is {limits.max_context} tokens and prompts "
                f"may have at most {limits.max_prompt_tokens}; the {param} has {chars} characters, "
                f"more than {limits.max_prompt_tokens} tokens however it is tokenized. Shorten it.",
                param=param,
                code="context_length_exceeded",
            )

    def sampling_params(self, request: _Sampling, prompt_tokens: int, param: str) -> SamplingParams:
        """Per-request sampling settings, or the APIError for a request beyond the server's limits."""
        limits = self.limits
        if prompt_tokens > limits.max_prompt_tokens:
            raise APIError(
                400,
                f"This model's maximum context length is {limits.max_context} tokens and prompts "
                f"may have at most {limits.max_prompt_tokens}; the {param} has {prompt_tokens} "
                "tokens. Shorten it.",
                param=param,
                code="context_length_exceeded",
            )
        name, wanted = request.max_tokens_param()
        if wanted is not None and wanted > limits.max_tokens:
            raise APIError(
                400,
                f"{name} is too large: {wanted}. This server allows at most {limits.max_tokens} "
                "completion tokens per request (--max_tokens).",
                param=name,
                code="invalid_value",
            )
        if request.n > limits.max_n:
            raise APIError(
                400,
                f"n is too large: {request.n}. This server allows at most {limits.max_n} choices "
                "per request (--max_n).",
                param="n",
                code="invalid_value",
            )
        # A completion that would not fit in the context is not an error: it ends there with "length".
        return SamplingParams(
            max_new_tokens=reply_room(wanted or limits.default_max_tokens, prompt_tokens, limits.max_context),
            do_sample=request.temperature > 0,
            temperature=request.temperature,
            top_p=request.top_p,
            top_k=request.top_k,
            stop=request.stop_list(),
        )


def max_chars_per_token(tokenizer) -> int | None:
    """The most characters of text one token can stand for, where that is certain; None elsewhere.

    A BPE without an unknown token (byte-level BPE needs none; a fused unknown token could swallow any run of
    characters) and without a normalizer (one could fold several characters into one) gives tokens whose vocabulary
    entries are at least as long as the text they cover: byte-level entries have one character per byte, and a
    character is at least one byte. An added token covers its own content, unless it strips the spaces around it."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    model = getattr(backend, "model", None)
    if type(model).__name__ != "BPE" or model.unk_token is not None or backend.normalizer is not None:
        return None
    if any(token.lstrip or token.rstrip for token in tokenizer.added_tokens_decoder.values()):
        return None
    return max(map(len, tokenizer.get_vocab()), default=None)


class _Job:
    """One request turned into sequences: n choices for each prompt, numbered like OpenAI does."""

    def __init__(self, generator: Generator, request: _Sampling, prompts: list[list[int]], param: str):
        self.generator, self.request = generator, request
        params = [generator.sampling_params(request, len(ids), param) for ids in prompts]
        if len(prompts) * request.n > generator.limits.max_n:
            raise APIError(
                400,
                f"Too many choices: {len(prompts)} prompts x n={request.n}. This server generates "
                f"at most {generator.limits.max_n} choices per request (--max_n); split the prompts "
                "over several requests.",
                param=param,
                code="invalid_value",
            )
        self.prompt_tokens = sum(len(ids) for ids in prompts)
        self.sequences = [
            Sequence(generator.engine, ids, p) for ids, p in zip(prompts, params) for _ in range(request.n)
        ]
        self.deadline = time.monotonic() + generator.limits.request_timeout

    @property
    def completion_tokens(self) -> int:
        return sum(sequence.completion_tokens for sequence in self.sequences)

    async def events(self) -> AsyncIterator[tuple[int, str | None]]:
        """(choice index, text piece) as the choices generate together; (index, None) when one has finished.
        Raises the timeout APIError at the deadline; leaving early cancels every unfinished choice."""
        events: asyncio.Queue = asyncio.Queue()

        async def run(index: int, sequence: Sequence):
            try:
                async for piece in sequence.pieces():
                    events.put_nowait((index, piece))
                events.put_nowait((index, None))
            except BaseException as error:  # reported to the consumer, which stops everything
                events.put_nowait((index, error))
                raise

        tasks = [asyncio.create_task(run(i, s)) for i, s in enumerate(self.sequences)]
        next_event = None
        try:
            running = len(tasks)
            while running:
                # Not `asyncio.wait_for`: before Python 3.12 it drops a cancellation that arrives as the awaited
                # item does, and a cancelled request would keep generating to its end.
                next_event = asyncio.ensure_future(events.get())
                await asyncio.wait({next_event}, timeout=max(0.0, self.deadline - time.monotonic()))
                if not next_event.done():
                    raise _timed_out(self.generator.limits.request_timeout)
                index, item = next_event.result()
                if isinstance(item, BaseException):
                    raise item
                running -= item is None
                yield index, item
        finally:
            for task in [*tasks, *([next_event] if next_event else [])]:
                task.cancel()  # closes the sequence's iteration, which cancels it in the engine
            await asyncio.gather(*tasks, return_exceptions=True)


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


# ----------------------------------------------------------------------------------------------------------
# The app
# ----------------------------------------------------------------------------------------------------------


def is_loopback_host(host: str) -> bool:
    """Whether a server bound to `host` is reachable from this machine only: 127.0.0.0/8, ::1 (also written
    [::1] or as ::ffff:127.x.y.z) or localhost. Anything else, a host name or an empty string included, may be
    reachable from other machines."""
    name = host.strip().lower()
    if name.startswith("[") and name.endswith("]"):
        name = name[1:-1]
    if name in ("localhost", "localhost."):
        return True
    try:
        address = ipaddress.ip_address(name)
    except ValueError:
        return False
    return (getattr(address, "ipv4_mapped", None) or address).is_loopback


class _Tokenizers:
    """Renders and tokenizes prompts off the event loop, so that a long prompt does not hold up every other request,
    in a few threads with a copy of the tokenizer each: a fast tokenizer keeps per-call settings (whether special
    tokens are split: chat messages yes, raw prompts no) in the one Rust object it wraps, so two threads tokenizing
    through one copy can each get the other's setting, and a chat message could then open a turn of its own."""

    THREADS = 4

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._local = threading.local()
        self._pool: ThreadPoolExecutor | None = None

    def _own(self):
        tokenizer = getattr(self._local, "tokenizer", None)
        if tokenizer is None:
            tokenizer = self._local.tokenizer = copy.deepcopy(self.tokenizer)
        return tokenizer

    async def run(self, work, *args):
        """`work(tokenizer, *args)` in one of the threads."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.THREADS, thread_name_prefix="minimind-tokenize")
        return await asyncio.get_running_loop().run_in_executor(self._pool, lambda: work(self._own(), *args))

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None


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


OPENMP_RUNTIMES = ("libgomp.so.1", "libomp.so", "libomp.dylib", "libiomp5.so")
OMP_PAUSE_HARD = 2


def release_openmp_workers() -> bool:
    """Gives back the OpenMP worker threads the calling thread keeps after any parallel torch op (the OpenMP 5.0
    call `omp_pause_resource_all`); they come back by themselves if it runs torch again. The server runs the model
    in its engine's thread, and while a thread that ran the model before (the compiled engine's warm-up, a
    benchmark's other rows) still holds a team of workers, GNU OpenMP (torch's on Linux) counts more threads than
    cores and stops its workers spinning between parallel regions, which slows every step down. Returns whether a
    loaded OpenMP runtime took the call."""
    import ctypes
    import os

    for name in OPENMP_RUNTIMES:
        try:  # only a runtime already loaded (torch's own copy), never a second one
            runtime = ctypes.CDLL(name, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
        except (OSError, AttributeError):
            continue
        pause = getattr(runtime, "omp_pause_resource_all", None)
        return pause is not None and pause(OMP_PAUSE_HARD) == 0
    return False


def serve(app: FastAPI, host: str = "127.0.0.1", port: int = 8000) -> None:
    import uvicorn

    release_openmp_workers()  # from here on the model runs in the engine's thread
    uvicorn.run(app, host=host, port=port, log_level="info")


@contextmanager
def serve_in_thread(app: FastAPI, start_timeout: float = 60.0):
    """`app` on uvicorn at a free loopback port in a background thread, for benchmarks and tests; yields the base
    URL and stops the server on exit."""
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    release_openmp_workers()  # the model runs in the engine's thread while this one waits for clients
    thread = threading.Thread(target=server.run, name="minimind-server", daemon=True)
    thread.start()
    deadline = time.monotonic() + start_timeout
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the server did not start")
        time.sleep(0.02)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=60)
        if thread.is_alive():
            raise RuntimeError("the server did not stop")
