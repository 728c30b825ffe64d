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

Where things live (every name below is importable from `minimind.serving` itself):

- `schema.py`: the request models (`ChatCompletionRequest`, `CompletionRequest`) and `check_unicode`.
- `errors.py`: `APIError` (OpenAI's error shape) and the helpers that build its timeout, body-size and
  body-parse errors.
- `limits.py`: `ServerLimits` (the `minimind-serve` flags), `Admission` (the 429) and `BodyLimit` (the 413).
- `paged.py`: `BatchEngine`, transformers' continuous batching over a paged KV cache (`--engine paged`).
- `compiled.py`: `CompiledBatchEngine`, compiled steps over a static cache, a row per sequence (`--engine compiled`).
- `generator.py`: `Generator` (what the server serves), `Sequence` (one choice), `_Job` (one request's choices)
  and `_Tokenizers` (the tokenizer threads).
- `app.py`: `create_app`: the routes, the API key check, whole and streamed (server-sent events) responses.
- `server.py`: `serve`, `serve_in_thread`, `release_openmp_workers` and `is_loopback_host`.

`minimind.cli` and the benchmark look `serve`, `create_app` and `serve_in_thread` up on this package when they
run, so a test patches them here; a name a module looks up itself (`chat_prompt_ids` in `app.py`) is patched in
that module.
"""

from minimind.serving.app import ClientGone, create_app
from minimind.serving.compiled import CompiledBatchEngine
from minimind.serving.errors import APIError
from minimind.serving.generator import Generator, Sequence, _Tokenizers, max_chars_per_token
from minimind.serving.limits import DEFAULT_MAX_TOKENS, Admission, BodyLimit, ServerLimits
from minimind.serving.paged import BatchEngine
from minimind.serving.schema import ChatCompletionRequest, CompletionRequest, check_unicode
from minimind.serving.server import (
    OMP_PAUSE_HARD,
    OPENMP_RUNTIMES,
    is_loopback_host,
    release_openmp_workers,
    serve,
    serve_in_thread,
)

__all__ = [
    "APIError",
    "Admission",
    "BatchEngine",
    "BodyLimit",
    "ChatCompletionRequest",
    "ClientGone",
    "CompiledBatchEngine",
    "CompletionRequest",
    "DEFAULT_MAX_TOKENS",
    "Generator",
    "OMP_PAUSE_HARD",
    "OPENMP_RUNTIMES",
    "Sequence",
    "ServerLimits",
    "_Tokenizers",
    "check_unicode",
    "create_app",
    "is_loopback_host",
    "max_chars_per_token",
    "release_openmp_workers",
    "serve",
    "serve_in_thread",
]
