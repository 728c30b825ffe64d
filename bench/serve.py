"""The peers table's serve rows: the OpenAI-compatible server on loopback, 1 and 8 clients streaming greedy
completions, total completion tokens per second. The server runs as users run it, `minimind-serve` in a process of
its own (`server_process`), and the clients in the benchmark's."""

import contextlib
import math
import os
import socket
import subprocess
import sys
import time

from bench.measure import CHECKOUT, alternating_rounds, child_env
from bench.workloads import PEER_PROMPT, PeerRow

SERVE_SCRIPT = os.path.join(CHECKOUT, "scripts", "serve.py")
# A first start of the compiled engine builds its steps for every batch size; 16-bit weights autotune their
# kernels while building, which takes minutes on a CPU.
START_TIMEOUT = 3600


def serving_missing():
    for name in ("fastapi", "uvicorn", "httpx"):
        try:
            __import__(name)
        except ImportError as error:
            return f"{name} not installed ({error}); pip install -e .[serve]"
    return ""


def _stream_completion(http, prompt, max_tokens, latencies=None):
    """One streaming greedy completion through `http` (an httpx.Client on the server); the completion tokens the
    server's usage chunk reports. `latencies` (a list) gets (seconds to the first token, seconds to the end, the
    chunks that carried text)."""
    import json

    body = {
        "model": "peers",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    usage, start, first, pieces = None, time.perf_counter(), None, 0
    with http.stream("POST", "/v1/completions", json=body) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[len("data: ") :])
                if any(choice.get("text") for choice in chunk.get("choices") or ()):
                    pieces += 1
                    first = first if first is not None else time.perf_counter() - start
                usage = chunk.get("usage") or usage
    if latencies is not None:
        latencies.append((first if first is not None else float("nan"), time.perf_counter() - start, pieces))
    return usage["completion_tokens"]


def _free_port():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _log_tail(path, lines=20):
    with open(path, encoding="utf-8", errors="replace") as log:
        return "".join(log.readlines()[-lines:])


@contextlib.contextmanager
def server_process(ctx, weights, engine):
    """`minimind-serve` over the peers model (`scripts/serve.py` of this checkout) in a process of its own, for
    these weights and engine: yields its base URL once `/v1/models` answers, and the seconds from launch to then;
    stopped on exit. In the benchmark's own process, the clients' threads would take turns with the server's
    event loop and engine for Python's lock, which no deployment shares, and the models of the rows before it
    would stay resident beside it. Its output goes to a log in the work directory, whose last lines a failed start
    reports."""
    import httpx

    new, port = ctx.sizes["new_tokens"], _free_port()
    flags = {
        "--model_name_or_path": ctx.model_dir,
        "--served_model_name": "peers",
        "--device": "cpu",
        "--dtype": {"fp32": "float32", "bf16": "bfloat16"}[weights],
        "--engine": engine,
        "--port": port,
        # The paged engine sizes its KV cache for max_context x sequences: the model's own 32k context would ask
        # for gigabytes; the prompts here need a few hundred positions.
        "--max_context": 256,
        "--max_tokens": new,
        "--default_max_tokens": new,
        "--max_concurrent_requests": 8,
        "--max_batch": 8,
    }
    command = [sys.executable, SERVE_SCRIPT, *(str(part) for flag in flags.items() for part in flag)]
    if engine == "compiled" and ctx.settings.quick:
        command.append("--no-compile")  # quick: its steps run eagerly (tests/decode checks the compiled ones)
    env = child_env(**({"OMP_NUM_THREADS": str(ctx.threads)} if ctx.threads else {}))
    log_path = os.path.join(ctx.workdir, f"serve-{weights}-{engine}.log")
    with open(log_path, "w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
    url, started = f"http://127.0.0.1:{port}", time.perf_counter()
    try:
        while True:
            if process.poll() is not None:
                raise RuntimeError(
                    f"minimind-serve exited with code {process.returncode} before answering "
                    f"({' '.join(command)}):\n{_log_tail(log_path)}"
                )
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/v1/models", timeout=5).status_code == 200:
                    break
            if time.perf_counter() - started > START_TIMEOUT:
                raise RuntimeError(f"minimind-serve did not answer within {START_TIMEOUT} s:\n{_log_tail(log_path)}")
            time.sleep(0.2)
        yield url, time.perf_counter() - started
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def percentiles(values, points=(50, 90, 99)):
    """The nearest-rank percentiles of `values` (as many as there are requests: no interpolation)."""
    ordered = sorted(values)
    return [ordered[max(0, math.ceil(p / 100 * len(ordered)) - 1)] for p in points]


def measure_serve(workloads, ctx):
    """The OpenAI-compatible server on loopback, one engine and weights: for each of `workloads` (rows of that
    server), N clients each streaming the same number of greedy completions one after another; total completion
    tokens per second of wall time. "minimind server" is the default engine (transformers' continuous batching),
    "minimind server compiled" is `--engine compiled`. The rows run in rounds on one server, as the decode rows
    do (`time_in_rounds`): a run is short, shorter than the host's own swings, so the 8-client row compares with
    the one-client row of its round."""
    from concurrent.futures import ThreadPoolExecutor

    new, per_client = ctx.sizes["new_tokens"], ctx.sizes["serve_requests"]
    rows = [PeerRow(w, shape=f"{_clients(w)} x {per_client} requests (+{new})") for w in workloads]
    missing = serving_missing()
    if missing:
        for row in rows:
            row.skipped = missing
        return rows
    engine = "compiled" if workloads[0].engine.endswith("compiled") else "paged"

    import httpx

    with server_process(ctx, workloads[0].weights, engine) as (url, ready):
        ctx.log(f"serve {workloads[0].weights} {engine}: answering {ready:.0f} s after launch")
        # Each client keeps one client object and its connection, as the openai client does: building one per
        # request (its TLS context included) costs time on the cores the server runs on (docs/performance.md).
        https = [httpx.Client(base_url=url, timeout=600) for _ in range(max(map(_clients, workloads)))]

        # (first token, whole request, chunks with text) of every request
        latencies = {row.workload.row_id: [] for row in rows}

        def client(index, requests):
            return sum(
                _stream_completion(https[index], f"{PEER_PROMPT} ({index}, {k})", new, requests)
                for k in range(per_client)
            )

        def run(row):
            clients = _clients(row.workload)
            requests = latencies[row.workload.row_id]
            start = time.perf_counter()
            with ThreadPoolExecutor(clients) as pool:
                tokens = sum(pool.map(client, range(clients), [requests] * clients))
            seconds = time.perf_counter() - start
            # Greedy completions may end at eos: the row counts its first round's tokens, and a round that got
            # another number is timed at its own rate.
            row.tokens = row.tokens or tokens
            row.seconds.append(seconds * row.tokens / max(tokens, 1))

        _stream_completion(https[0], PEER_PROMPT, new)  # warm-up: the first step, the first pages
        for row in alternating_rounds(rows, ctx.repeats):
            run(row)
        for http in https:
            http.close()
    for row in rows:
        clients = _clients(row.workload)
        first, whole, pieces = zip(*latencies[row.workload.row_id])
        row.note = (
            f"{row.tokens} of {clients * per_client * new} tokens asked for, streaming, greedy, --engine {engine}; "
            f"per request over {len(whole)}, p50 / p90 / p99: first token "
            + " / ".join(f"{s * 1000:.0f}" for s in percentiles(first))
            + " ms, whole "
            + " / ".join(f"{s:.2f}" for s in percentiles(whole))
            + f" s; text in {percentiles(pieces, (50,))[0]} chunks a request (p50)"
        )
        ctx.log(f"{row.workload.row_id}: {row.tokens_per_second:.1f} tok/s")
    return rows


def _clients(workload):
    return int(workload.row_id.split("-")[2])
