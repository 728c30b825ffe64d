"""From a request to text: `Generator` (the model, its tokenizer, its name, the limits and the engine), `Sequence`
(one choice, its text as it is detokenized), `_Deliveries` (outputs from the engine's thread to the event loop),
`_Job` (one request's choices generating together, under its deadline) and `_Tokenizers` (the threads that render
and tokenize prompts off the event loop)."""

from __future__ import annotations

import asyncio
import collections
import copy
import math
import threading
import time
import weakref
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor

import torch
from transformers import TextStreamer

from minimind.chat import SamplingParams, StopStringCutter, reply_room
from minimind.serving.compiled import CompiledBatchEngine
from minimind.serving.errors import APIError, _timed_out
from minimind.serving.limits import DEFAULT_MAX_TOKENS, ServerLimits
from minimind.serving.paged import BatchEngine
from minimind.serving.schema import _Sampling


class _Detokenizer:
    """A sequence's text as its tokens arrive: `put(tokens)`, `end()` after the last, `take()` the text finished
    since the last take.

    tokenizers' `DecodeStream` decodes each token against the few before it and holds back the bytes of a character
    not yet complete, so a token costs the same however long the reply; transformers' `TextStreamer` re-decodes the
    reply since its last line break at every token. The latter remains for a tokenizer without a Rust backend or one
    that cleans up spaces over the whole text, which a token-by-token decoder cannot reproduce."""

    def __init__(self, tokenizer):
        self.pieces: list[str] = []
        self._backend = getattr(tokenizer, "backend_tokenizer", None)
        self._streamer = None
        if self._backend is not None and not getattr(tokenizer, "clean_up_tokenization_spaces", False):
            from tokenizers.decoders import DecodeStream

            self._stream = DecodeStream(skip_special_tokens=True)
            self._held: list[int] = []  # tokens since the last piece: bytes of a character not yet complete
        else:
            self._streamer = TextStreamer(tokenizer, skip_prompt=False, skip_special_tokens=True)
            self._streamer.on_finalized_text = lambda text, stream_end=False: text and self.pieces.append(text)

    def put(self, tokens: list[int]) -> None:
        if self._streamer is not None:
            self._streamer.put(torch.tensor(tokens))
            return
        for token in tokens:
            if piece := self._stream.step(self._backend, token):
                self.pieces.append(piece)
                self._held = []
            else:
                self._held.append(token)

    def end(self) -> None:
        """A reply that ends inside a character ends with what decoding it whole gives there (U+FFFD)."""
        if self._streamer is not None:
            self._streamer.end()
        elif self._held and (rest := self._backend.decode(self._held, skip_special_tokens=True)):
            self.pieces.append(rest)
            self._held = []

    def take(self) -> str:
        text, self.pieces = "".join(self.pieces), []
        return text


class _Deliveries:
    """Hands outputs from an engine's thread to an event loop: one wake-up of the loop carries every output posted
    since the last, so a step over eight sequences wakes the loop once instead of eight times. With a stream
    interval, the outputs between a sequence's first and its last wait up to that long and go together: the loop
    and the socket then work once for several tokens instead of once a token, on the cores the steps run on. One
    per loop."""

    _of_loop: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.pending: collections.deque = collections.deque()
        self.scheduled = False  # a drain is on its way: False, "now" or "later"
        self.drained = 0.0  # time.monotonic() of the last drain

    @classmethod
    def of(cls, loop: asyncio.AbstractEventLoop) -> _Deliveries:
        if (deliveries := cls._of_loop.get(loop)) is None:
            deliveries = cls._of_loop[loop] = cls(loop)
        return deliveries

    def post(self, target: asyncio.Queue, item, interval: float = 0.0) -> None:
        """From any thread: `item` (an engine's output) goes into `target` on the loop's thread, at once if it is its
        sequence's first or last output or `interval` seconds have passed since the last drain, else at the end of
        that interval. deque's append and popleft are atomic, and `_drain` clears `scheduled` before it empties the
        deque, so an item is either taken by a drain already on its way or schedules one."""
        self.pending.append((target, item))
        if self.scheduled == "now":
            return
        due = self.drained + interval
        if time.monotonic() >= due or item.is_finished() or len(item.generated_tokens) <= 1:
            self.scheduled = "now"
            self.loop.call_soon_threadsafe(self._drain)
        elif not self.scheduled:
            self.scheduled = "later"
            self.loop.call_soon_threadsafe(self._drain_at, due)

    def _drain_at(self, due: float) -> None:
        self.loop.call_later(max(0.0, due - time.monotonic()), self._drain)

    def _drain(self) -> None:
        self.drained = time.monotonic()  # first: a post from now on counts its interval from this drain
        self.scheduled = False
        while self.pending:
            target, item = self.pending.popleft()
            target.put_nowait(item)


_DEADLINE = object()  # put in a sequence's outputs when its request's time is up


class Sequence:
    """One choice being generated: iterate `pieces()` for its text; then `finish_reason` and `completion_tokens`.

    Leaving the iteration early (a client gone, a timeout, a stop string) cancels it in the engine."""

    def __init__(
        self, engine: BatchEngine, prompt_ids: list[int], params: SamplingParams, stream_interval: float = 0.0
    ):
        self.engine, self.prompt_ids, self.params = engine, prompt_ids, params
        self.stream_interval = stream_interval  # seconds its outputs may wait to go together (`_Deliveries`)
        self.completion_tokens = 0
        self.finish_reason: str | None = None

    async def pieces(self, deadline: float = math.inf) -> AsyncIterator[str]:
        """The text as it is detokenized; raises TimeoutError once `time.monotonic()` passes `deadline`."""
        loop = asyncio.get_running_loop()
        outputs: asyncio.Queue = asyncio.Queue()
        # One timer for the whole sequence, not a timed wait per token: the loop's work per token is the server's
        # cost per token, and on a small machine it runs on the cores the model's step uses.
        deliveries = _Deliveries.of(loop)
        timer = loop.call_later(max(0.0, deadline - time.monotonic()), outputs.put_nowait, _DEADLINE)
        interval = self.stream_interval
        request_id = self.engine.submit(
            self.prompt_ids, self.params, lambda output: deliveries.post(outputs, output, interval)
        )
        detokenizer, cutter = _Detokenizer(self.engine.tokenizer), StopStringCutter(self.params.stop)
        output = None
        try:
            while True:
                item = await outputs.get()
                # outputs are cumulative: the latest one waiting will do, up to the last (then the deadline is moot)
                while item is not _DEADLINE and not item.is_finished() and not outputs.empty():
                    item = outputs.get_nowait()
                if item is _DEADLINE or time.monotonic() >= deadline:
                    raise TimeoutError
                output = item
                if output.error is not None:
                    raise RuntimeError(output.error)
                new_tokens = output.generated_tokens[self.completion_tokens :]
                self.completion_tokens = len(output.generated_tokens)
                if new_tokens:
                    detokenizer.put(new_tokens)
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
            timer.cancel()
            self.engine.release(request_id, cancel=output is None or not output.is_finished())


class Generator:
    """What the server serves: the model, its tokenizer, its name, the limits and the batching engine."""

    ENGINES = ("paged", "compiled")
    # A stream's text waits up to this long to go out with what follows it: a reader sees no difference, and the
    # event loop and the socket work once for several tokens instead of once for every token.
    STREAM_INTERVAL = 0.05

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
        stream_interval: float = STREAM_INTERVAL,
    ):
        limits = limits or ServerLimits(
            max_context=max_context,
            default_max_tokens=default_max_tokens,
            max_tokens=max(default_max_tokens, ServerLimits.max_tokens),
        )
        self.limits = limits.check(model.config.max_position_embeddings)
        self.model, self.tokenizer, self.model_id = model, tokenizer, model_id
        self.max_context = self.limits.max_context
        if not 0 <= stream_interval <= self.limits.request_timeout:
            raise ValueError(
                f"stream_interval must be between 0 (every token at once) and request_timeout "
                f"({self.limits.request_timeout} s), got {stream_interval}"
            )
        self.stream_interval = stream_interval
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
            Sequence(generator.engine, ids, p, generator.stream_interval)
            for ids, p in zip(prompts, params)
            for _ in range(request.n)
        ]
        self.deadline = time.monotonic() + generator.limits.request_timeout

    @property
    def completion_tokens(self) -> int:
        return sum(sequence.completion_tokens for sequence in self.sequences)

    async def events(self) -> AsyncIterator[tuple[int, str | None]]:
        """(choice index, text piece) as the choices generate together; (index, None) when one has finished.
        Raises the timeout APIError at the deadline; leaving early cancels every unfinished choice."""
        try:
            if len(self.sequences) == 1:  # the usual request: its pieces straight through, no task in between
                async for piece in self.sequences[0].pieces(self.deadline):
                    yield 0, piece
                yield 0, None
            else:
                async for event in self._interleaved():
                    yield event
        except TimeoutError:
            raise _timed_out(self.generator.limits.request_timeout) from None

    async def _interleaved(self) -> AsyncIterator[tuple[int, str | None]]:
        events: asyncio.Queue = asyncio.Queue()

        async def run(index: int, sequence: Sequence):
            try:
                async for piece in sequence.pieces(self.deadline):
                    events.put_nowait((index, piece))
                events.put_nowait((index, None))
            except BaseException as error:  # reported to the consumer, which stops everything
                events.put_nowait((index, error))
                raise

        tasks = [asyncio.create_task(run(i, s)) for i, s in enumerate(self.sequences)]
        try:
            running = len(tasks)
            while running:
                index, item = await events.get()
                if isinstance(item, BaseException):
                    raise item
                running -= item is None
                yield index, item
        finally:
            for task in tasks:
                task.cancel()  # closes the sequence's iteration, which cancels it in the engine
            await asyncio.gather(*tasks, return_exceptions=True)


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
