"""The default batching engine (`--engine paged`): `BatchEngine`, transformers' continuous batching over a paged
KV cache, with per-sequence temperature/top-k/top-p."""

from __future__ import annotations

import inspect
import math
import threading
import time
import uuid

from transformers import GenerationConfig

from minimind.chat import SamplingParams


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
