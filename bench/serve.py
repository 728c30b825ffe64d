"""The peers table's serve rows: the OpenAI-compatible server on loopback, 1 and 8 clients streaming greedy
completions, total completion tokens per second."""

import math
import time

from bench.measure import alternating_rounds
from bench.workloads import PEER_PROMPT, PeerRow


def serving_missing():
    for name in ("fastapi", "uvicorn", "httpx"):
        try:
            __import__(name)
        except ImportError as error:
            return f"{name} not installed ({error}); pip install -e .[serve]"
    return ""


def _stream_completion(http, prompt, max_tokens, latencies=None):
    """One streaming greedy completion through `http` (an httpx.Client on the server); the completion tokens the
    server's usage chunk reports. `latencies` (a list) gets (seconds to the first token, seconds to the end)."""
    import json

    body = {
        "model": "peers",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    usage, start, first = None, time.perf_counter(), None
    with http.stream("POST", "/v1/completions", json=body) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[len("data: ") :])
                if first is None and any(choice.get("text") for choice in chunk.get("choices") or ()):
                    first = time.perf_counter() - start
                usage = chunk.get("usage") or usage
    if latencies is not None:
        latencies.append((first if first is not None else float("nan"), time.perf_counter() - start))
    return usage["completion_tokens"]


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
    from minimind.serving import create_app, serve_in_thread

    engine = "compiled" if workloads[0].engine.endswith("compiled") else "paged"
    generator = ctx.server(workloads[0].weights, engine)

    import httpx

    with serve_in_thread(create_app(generator)) as url:
        # Each client keeps one client object and its connection, as the openai client does: building one per
        # request (its TLS context included) costs time on the cores the server runs on (docs/performance.md).
        https = [httpx.Client(base_url=url, timeout=600) for _ in range(max(map(_clients, workloads)))]

        latencies = {row.workload.row_id: [] for row in rows}  # (first token, whole request) of every request

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
    # The engine's thread keeps its team of OpenMP workers while it lives: left running beside the next server's,
    # GNU OpenMP would count more threads than cores and stop the workers of both spinning between parallel
    # regions, slowing every server measured after this one (docs/ecosystem-serve.md).
    generator.engine.stop()
    for row in rows:
        clients = _clients(row.workload)
        first, whole = zip(*latencies[row.workload.row_id])
        row.note = (
            f"{row.tokens} of {clients * per_client * new} tokens asked for, streaming, greedy, --engine {engine}; "
            f"per request over {len(whole)}, p50 / p90 / p99: first token "
            + " / ".join(f"{s * 1000:.0f}" for s in percentiles(first))
            + " ms, whole "
            + " / ".join(f"{s:.2f}" for s in percentiles(whole))
            + " s"
        )
        ctx.log(f"{row.workload.row_id}: {row.tokens_per_second:.1f} tok/s")
    return rows


def _clients(workload):
    return int(workload.row_id.split("-")[2])
