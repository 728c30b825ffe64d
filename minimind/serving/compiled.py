"""The compiled batching engine (`--engine compiled`): `CompiledBatchEngine`, compiled decode steps over a static
cache with a row per sequence, and the rows (`_Row`) and outputs (`_RowOutput`) it keeps and hands out."""

from __future__ import annotations

import threading
import time
import uuid
from dataclasses import dataclass

import torch

from minimind.chat import SamplingParams
from minimind.decode import RowCache, RowDecoder, choose_tokens, sampling_warpers


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
        self.eos_token_id = tokenizer.eos_token_id  # read once: the tokenizer's attribute lookup is not cheap
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
                self.decoder.step(
                    torch.zeros(rows, 1, dtype=torch.long, device=self.cache.positions.device), self._caches[rows]
                )
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
        # One op for the step's input, rows past the busy ones idle: each op between steps costs the one client
        # of a server what it costs the step.
        last = [row.generated[-1] for row in self._rows] + [0] * (rows - busy)
        tokens = torch.tensor(last, dtype=torch.long, device=self.cache.positions.device)[:, None]  # [rows, 1]
        logits = self.decoder.step(tokens, self._caches[rows])[:busy]  # [busy, V]
        self.cache.positions.narrow(0, 0, busy).add_(1)
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
        finished = token == self.eos_token_id or len(row.generated) >= row.params.max_new_tokens
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
