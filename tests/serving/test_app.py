"""The OpenAI-compatible server: a real uvicorn on a loopback port, driven by the official `openai` client
(streaming and not) and by raw httpx for malformed requests. Greedy replies are compared with `generate` on a
separately loaded copy of the model (continuous batching leaves the served model's attention in paged mode
under transformers 5.17). Every test that serves runs on both engines, `--engine paged` and `--engine compiled`."""

import json
import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import httpx
import openai
import pytest
import torch

from conftest import load_script, model_dir
from minimind.chat import SamplingParams, TextStream, chat_prompt_ids, load_model_and_tokenizer
from minimind.serving import Generator, ServerLimits, create_app, release_openmp_workers, serve_in_thread

MODEL_ID = "tiny-minimind"
MAX_CONTEXT = 128  # below the model's 256, to check the --max_context limit
LIMITS = ServerLimits(
    max_context=MAX_CONTEXT,
    default_max_tokens=8,
    max_tokens=100,
    max_n=4,
    max_prompt_tokens=100,
    max_concurrent_requests=16,
    request_timeout=60,
)


@pytest.fixture(scope="module")
def served_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("served")
    model_dir(path, std=0.3)  # sharp logits: greedy replies vary with the prompt
    return path


@pytest.fixture(scope="module", params=["paged", "compiled"])
def generator(served_dir, request):
    """Every test of the server runs on both engines. The compiled engine's steps run eagerly here (the compiled
    graphs are checked against generate in tests/decode/test_compiled.py), two rows at a time: more concurrent
    sequences than rows wait, and a row that finishes takes over the last busy row's sequence."""
    model, tokenizer = load_model_and_tokenizer(str(served_dir), "cpu")
    if request.param == "paged":
        return Generator(model, tokenizer, MODEL_ID, limits=LIMITS)
    return Generator(model, tokenizer, MODEL_ID, limits=replace(LIMITS, max_batch=2), engine="compiled", compile=False)


@pytest.fixture(scope="module")
def reference(served_dir):
    """The same weights, generating alone with `model.generate`."""
    return load_model_and_tokenizer(str(served_dir), "cpu")


@pytest.fixture(scope="module")
def app(generator):
    return create_app(generator)


@pytest.fixture(scope="module")
def base_url(app):
    with serve_in_thread(app) as url:
        yield url


@pytest.fixture(scope="module")
def client(base_url):
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=60)


def direct(reference, prompt_ids, max_tokens, stop=()):
    """The text, finish reason and token count of the same greedy generation without the server."""
    model, tokenizer = reference
    stream = TextStream(
        model, tokenizer, prompt_ids, SamplingParams(max_new_tokens=max_tokens, do_sample=False, stop=list(stop))
    )
    return "".join(stream), stream.finish_reason, stream.completion_tokens


def chat_ids(generator, text):
    return chat_prompt_ids(generator.tokenizer, [{"role": "user", "content": text}])


def wait_until_idle(generator, timeout=30):
    """Until no sequence is in the engine; returns the seconds it took."""
    start = time.monotonic()
    while generator.engine.active_sequences and time.monotonic() - start < timeout:
        time.sleep(0.005)
    assert generator.engine.active_sequences == 0
    return time.monotonic() - start


def test_lists_the_served_model(client):
    assert [m.id for m in client.models.list().data] == [MODEL_ID]


def test_chat_completion_equals_generate(client, generator, reference):
    """A chat completion equals direct generation, with its usage."""
    response = client.chat.completions.create(
        model=MODEL_ID, messages=[{"role": "user", "content": "hello"}], max_tokens=6, temperature=0
    )
    text, reason, tokens = direct(reference, chat_ids(generator, "hello"), 6)
    choice = response.choices[0]
    assert (choice.message.role, choice.message.content, choice.finish_reason) == ("assistant", text, reason)
    prompt_tokens = len(chat_ids(generator, "hello"))
    assert (response.usage.prompt_tokens, response.usage.completion_tokens, response.usage.total_tokens) == (
        prompt_tokens,
        tokens,
        prompt_tokens + tokens,
    )
    assert reason == "length" and tokens == 6


def test_chat_stream_sends_same_text_then_usage(client):
    kwargs = dict(
        model=MODEL_ID,
        messages=[
            {"role": "system", "content": "be nice"},
            {"role": "user", "content": [{"type": "text", "text": "hi"}]},
        ],
        max_tokens=10,
        temperature=0,
    )
    whole = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    content = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert len(content) > 1  # really streamed, not one block
    assert "".join(content) == whole.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.model_dump() == whole.usage.model_dump()


def test_completions_n_choices_streamed_or_not(client, generator, reference):
    prompt = "Once upon a time"
    response = client.completions.create(model=MODEL_ID, prompt=prompt, max_tokens=5, temperature=0, n=2)
    text, reason, tokens = direct(reference, generator.tokenizer(prompt)["input_ids"], 5)
    assert [(c.index, c.text, c.finish_reason) for c in response.choices] == [(0, text, reason), (1, text, reason)]
    assert response.usage.completion_tokens == 2 * tokens
    assert response.usage.prompt_tokens == len(generator.tokenizer(prompt)["input_ids"])

    streamed = {0: "", 1: ""}
    for chunk in client.completions.create(
        model=MODEL_ID, prompt=prompt, max_tokens=5, temperature=0, n=2, stream=True
    ):
        streamed[chunk.choices[0].index] += chunk.choices[0].text
    assert streamed == {0: text, 1: text}


def test_stop_strings_cut_the_output(client, generator, reference):
    full, _, _ = direct(reference, chat_ids(generator, "a story"), 16)
    stop = full[len(full) // 2 : len(full) // 2 + 2]
    expected = full[: full.index(stop)]
    for stops in (stop, ["zzzz-not-there", stop]):
        response = client.chat.completions.create(
            model=MODEL_ID, messages=[{"role": "user", "content": "a story"}], max_tokens=16, temperature=0, stop=stops
        )
        assert (response.choices[0].message.content, response.choices[0].finish_reason) == (expected, "stop")
    chunks = client.chat.completions.create(
        model=MODEL_ID,
        messages=[{"role": "user", "content": "a story"}],
        max_tokens=16,
        temperature=0,
        stop=stop,
        stream=True,
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected


def completion_text(client, top_k=None, **kwargs):
    extra = {"extra_body": {"top_k": top_k}} if top_k is not None else {}  # not a field of OpenAI's client
    return client.completions.create(model=MODEL_ID, prompt="The", max_tokens=8, **kwargs, **extra).choices[0].text


def test_temperature_zero_is_greedy(client, reference, generator):
    """Temperature changes the reply, and zero is greedy."""
    greedy, _, _ = direct(reference, generator.tokenizer("The")["input_ids"], 8)
    hot = {completion_text(client, temperature=2.0, seed=seed) for seed in (1, 2, 3, 4)}
    assert len(hot) > 1  # really sampling (seed is best effort: draws share one random stream)
    assert {completion_text(client, temperature=0, seed=seed) for seed in (1, 2)} == {greedy}


@pytest.mark.parametrize("filters", [{"top_p": 1e-6}, {"top_k": 1}], ids=["top_p tiny", "top_k 1"])
def test_tiny_top_p_or_top_k_one_is_greedy(client, reference, generator, filters):
    """A tiny top_p or top_k 1 gives the greedy reply at any temperature."""
    greedy, _, _ = direct(reference, generator.tokenizer("The")["input_ids"], 8)
    assert [completion_text(client, temperature=t, **filters) for t in (1.0, 2.0)] == [greedy, greedy]


def test_max_completion_tokens_is_exact(client):
    """max_completion_tokens bounds the completion exactly."""

    def completion(**kwargs):
        response = client.chat.completions.create(
            model=MODEL_ID, messages=[{"role": "user", "content": "hello"}], temperature=0, **kwargs
        )
        return response.usage.completion_tokens, response.choices[0].finish_reason

    assert completion(max_completion_tokens=3) == (3, "length")
    assert completion(max_completion_tokens=3, max_tokens=5) == (3, "length")  # the newer name wins
    assert completion() == (LIMITS.default_max_tokens, "length")


def test_context_overflow_finishes_with_length(client, generator, reference):
    """A completion longer than the context ends with "length" where the context is full."""
    prompt = "word " * 60
    prompt_ids = generator.tokenizer(prompt)["input_ids"]
    room = MAX_CONTEXT - len(prompt_ids)
    assert 0 < room < LIMITS.max_tokens
    response = client.completions.create(model=MODEL_ID, prompt=prompt, max_tokens=LIMITS.max_tokens, temperature=0)
    text, reason, tokens = direct(reference, prompt_ids, room)
    assert (response.choices[0].text, response.choices[0].finish_reason) == (text, reason)
    assert (response.usage.completion_tokens, reason) == (room, "length")


@pytest.mark.parametrize(
    "body, status, param, code",
    [
        ({"model": "gpt-4", "messages": [{"role": "user", "content": "x"}]}, 404, "model", "model_not_found"),
        (
            {"model": MODEL_ID, "messages": [{"role": "user", "content": "x"}], "max_tokens": -1},
            400,
            "max_tokens",
            "invalid_value",
        ),
        (
            {"model": MODEL_ID, "messages": [{"role": "user", "content": "x"}], "temperature": 3},
            400,
            "temperature",
            "invalid_value",
        ),
        ({"model": MODEL_ID, "messages": []}, 400, "messages", "invalid_value"),
        (
            {"model": MODEL_ID, "messages": [{"role": "user", "content": "word " * MAX_CONTEXT}]},
            400,
            "messages",
            "context_length_exceeded",
        ),
        (
            {"model": MODEL_ID, "messages": [{"role": "user", "content": "x"}], "max_tokens": LIMITS.max_tokens + 1},
            400,
            "max_tokens",
            "invalid_value",
        ),
        (
            {
                "model": MODEL_ID,
                "messages": [{"role": "user", "content": "x"}],
                "max_completion_tokens": LIMITS.max_tokens + 1,
            },
            400,
            "max_completion_tokens",
            "invalid_value",
        ),
        (
            {"model": MODEL_ID, "messages": [{"role": "user", "content": "x"}], "n": LIMITS.max_n + 1},
            400,
            "n",
            "invalid_value",
        ),
        (
            {"model": MODEL_ID, "messages": [{"role": "user", "content": "x"}], "top_k": -1},
            400,
            "top_k",
            "invalid_value",
        ),
    ],
)
def test_bad_chat_requests_get_openai_errors(base_url, body, status, param, code):
    response = httpx.post(f"{base_url}/v1/chat/completions", json=body, timeout=30)
    assert response.status_code == status
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert (error["param"], error["code"]) == (param, code)
    assert error["type"] == "invalid_request_error"


def test_prompt_over_max_prompt_tokens_is_refused(base_url, generator):
    """A prompt longer than max_prompt_tokens is refused, naming the limit."""
    prompt = "word " * 60
    assert LIMITS.max_prompt_tokens < len(generator.tokenizer(prompt * 2)["input_ids"]) < MAX_CONTEXT + 100
    response = httpx.post(f"{base_url}/v1/completions", json={"model": MODEL_ID, "prompt": prompt * 2}, timeout=30)
    error = response.json()["error"]
    assert (response.status_code, error["param"], error["code"]) == (400, "prompt", "context_length_exceeded")
    assert "at most 100" in error["message"]


def test_prompt_list_bounded_by_max_n_choices(base_url):
    """A prompt list may not ask for more than max_n_choices in all."""
    body = {"model": MODEL_ID, "prompt": ["a", "b"], "n": LIMITS.max_n // 2 + 1, "max_tokens": 1}
    response = httpx.post(f"{base_url}/v1/completions", json=body, timeout=30)
    error = response.json()["error"]
    assert (response.status_code, error["param"], error["code"]) == (400, "prompt", "invalid_value")
    assert f"2 prompts x n={LIMITS.max_n // 2 + 1}" in error["message"]
    ok = httpx.post(f"{base_url}/v1/completions", json={**body, "n": LIMITS.max_n // 2}, timeout=30).json()
    assert [c["index"] for c in ok["choices"]] == list(range(LIMITS.max_n))


def test_malformed_requests_get_openai_errors(base_url):
    """Malformed and misrouted requests get OpenAI-shaped errors."""
    bad_json = httpx.post(
        f"{base_url}/v1/completions",
        content=b'{"model": "x", "prompt": ',
        headers={"Content-Type": "application/json"},
        timeout=30,
    )
    assert bad_json.status_code == 400 and bad_json.json()["error"]["code"] == "invalid_json"
    too_long = httpx.post(
        f"{base_url}/v1/completions", json={"model": MODEL_ID, "prompt": "word " * MAX_CONTEXT}, timeout=30
    )
    assert too_long.status_code == 400 and too_long.json()["error"]["param"] == "prompt"
    empty = httpx.post(f"{base_url}/v1/completions", json={"model": MODEL_ID, "prompt": ""}, timeout=30)
    assert empty.status_code == 400 and empty.json()["error"]["param"] == "prompt"
    missing = httpx.get(f"{base_url}/v1/nothing-here", timeout=30)
    assert missing.status_code == 404 and missing.json()["error"]["type"] == "not_found_error"


def test_concurrent_requests_get_greedy_replies(client, generator, reference):
    """Concurrent requests of different lengths each get their own greedy reply."""
    prompts = [
        "red apples",
        "the sea " * 9,
        "numbers 1 2 3",
        "good morning, how are you today my friend",
        "x",
        "a story about a fox " * 3,
    ]
    lengths = [8, 5, 12, 3, 8, 10]
    expected = [direct(reference, chat_ids(generator, p), n)[0] for p, n in zip(prompts, lengths)]
    start = threading.Barrier(len(prompts))

    def ask(index):
        start.wait(timeout=30)
        kwargs = dict(
            model=MODEL_ID,
            messages=[{"role": "user", "content": prompts[index]}],
            max_tokens=lengths[index],
            temperature=0,
        )
        if index % 2:  # streams and plain requests overlap
            return "".join(
                c.choices[0].delta.content or "" for c in client.chat.completions.create(**kwargs, stream=True)
            )
        return client.chat.completions.create(**kwargs).choices[0].message.content

    with ThreadPoolExecutor(len(prompts)) as pool:
        answers = list(pool.map(ask, range(len(prompts)), timeout=120))
    assert answers == expected


def test_script_binds_loopback_and_takes_limits(monkeypatch, generator, tmp_path):
    """The serve script binds loopback by default and takes the limits."""
    import minimind.chat
    import minimind.serving

    calls = []
    monkeypatch.setattr(
        minimind.chat, "load_model_and_tokenizer", lambda *args, **kwargs: (generator.model, generator.tokenizer)
    )
    monkeypatch.setattr(minimind.serving, "serve", lambda app, host, port: calls.append((app, host, port)))
    monkeypatch.setenv("MINIMIND_API_KEY", "from-env")
    load_script("serve").main(["--model_name_or_path", str(tmp_path / "my-model"), "--max_context", "64"])
    load_script("serve").main(
        [
            "--model_name_or_path",
            str(tmp_path / "my-model"),
            "--max_tokens",
            "32",
            "--max_n",
            "2",
            "--max_prompt_tokens",
            "50",
            "--max_concurrent_requests",
            "3",
            "--request_timeout",
            "9.5",
            "--default_max_tokens",
            "16",
            "--api_key",
            "k",
            "--kv_cache_tokens",
            "4096",
            "--stream_interval",
            "0.2",
        ]
    )
    load_script("serve").main(["--model_name_or_path", str(tmp_path / "my-model"), "--api_key", ""])
    (app, host, port), (limited, _, _), (keyless, _, _) = calls
    assert (host, port) == ("127.0.0.1", 8000)
    assert set(app.openapi()["paths"]) >= {"/v1/models", "/v1/chat/completions", "/v1/completions"}
    assert limited.state.admission.limit == 3
    assert limited.state.generator.limits == ServerLimits(
        max_context=256,
        default_max_tokens=16,
        max_tokens=32,
        max_n=2,
        max_prompt_tokens=50,
        max_concurrent_requests=3,
        request_timeout=9.5,
        kv_cache_tokens=4096,
    )
    assert limited.state.generator.engine.cache_tokens == 4096
    assert (limited.state.generator.stream_interval, app.state.generator.stream_interval) == (0.2, 0.05)
    # the defaults: every one of the 64 admitted requests at the full 64-token context, plus the spare context
    assert app.state.generator.limits == ServerLimits(max_context=64, max_prompt_tokens=63, kv_cache_tokens=65 * 64)
    from starlette.testclient import TestClient

    def status(app, key=None):
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return TestClient(app).get("/v1/models", headers=headers).status_code

    assert (status(app), status(app, "from-env")) == (401, 200)  # the key came from the environment
    assert (status(limited, "from-env"), status(limited, "k")) == (401, 200)  # the flag wins over it
    assert status(keyless) == 200  # an empty --api_key is no key, even with the variable set


def test_script_rejects_bad_limits_naming_flag(monkeypatch, generator, tmp_path, capsys):
    import minimind.chat

    monkeypatch.setattr(
        minimind.chat, "load_model_and_tokenizer", lambda *args, **kwargs: (generator.model, generator.tokenizer)
    )
    with pytest.raises(SystemExit) as exit_info:
        load_script("serve").main(["--model_name_or_path", str(tmp_path / "m"), "--max_prompt_tokens", "300"])
    assert exit_info.value.code == 2
    assert "max_prompt_tokens (300) must be below max_context (256)" in capsys.readouterr().err


@pytest.mark.parametrize(
    "limits, message",
    [
        (ServerLimits(max_context=999), "max_context must be in [2, 256]"),
        (ServerLimits(max_n=0), "max_n must be at least 1, got 0"),
        (ServerLimits(max_tokens=8), "default_max_tokens (512) must not exceed max_tokens (8)"),
        (ServerLimits(request_timeout=0), "request_timeout must be positive seconds, got 0"),
        (
            ServerLimits(kv_cache_tokens=511),
            "kv_cache_tokens (511) must hold two full contexts (2 x max_context = 512). "
            "Fix: raise --kv_cache_tokens or lower --max_context",
        ),
        (ServerLimits(max_batch=0), "max_batch must be at least 1, got 0"),
    ],
)
def test_bad_limits_are_refused(generator, limits, message):
    with pytest.raises(ValueError) as error:
        Generator(generator.model, generator.tokenizer, MODEL_ID, limits=limits)
    assert message in str(error.value)


@pytest.mark.parametrize("interval", [-0.01, 61.0])
def test_a_stream_interval_outside_the_request_timeout_is_refused(generator, interval):
    with pytest.raises(ValueError) as error:
        Generator(generator.model, generator.tokenizer, MODEL_ID, limits=LIMITS, stream_interval=interval)
    assert str(error.value) == (
        f"stream_interval must be between 0 (every token at once) and request_timeout (60 s), got {interval}"
    )


def test_compiled_engine_rows_fit_the_kv_cache(generator):
    """The engines are named, and the compiled one fits its rows in the KV cache."""
    model, tokenizer = generator.model, generator.tokenizer
    with pytest.raises(ValueError) as error:
        Generator(model, tokenizer, MODEL_ID, engine="vllm")
    assert str(error.value) == "engine must be one of paged, compiled, got 'vllm'"
    with pytest.raises(ValueError) as error:
        Generator(
            model,
            tokenizer,
            MODEL_ID,
            engine="compiled",
            compile=False,
            limits=ServerLimits(max_batch=9, kv_cache_tokens=2048),
        )
    assert str(error.value) == (
        "the compiled engine keeps max_batch x max_context = 9 x 256 = 2304 tokens of keys and "
        "values, more than kv_cache_tokens (2048). Fix: lower --max_context or --max_batch, "
        "or raise --kv_cache_tokens"
    )
    fits = Generator(
        model,
        tokenizer,
        MODEL_ID,
        engine="compiled",
        compile=False,
        limits=ServerLimits(max_batch=8, kv_cache_tokens=2048),
    )
    config = model.config
    assert fits.engine.batch_sizes == [1, 2, 4, 8]
    assert fits.engine.cache.keys.shape == (
        config.num_hidden_layers,
        8,
        config.num_key_value_heads,
        256,
        config.head_dim,
    )


def test_script_takes_the_engine(monkeypatch, generator, tmp_path):
    import minimind.chat
    import minimind.serving

    calls = []
    monkeypatch.setattr(
        minimind.chat, "load_model_and_tokenizer", lambda *args, **kwargs: (generator.model, generator.tokenizer)
    )
    monkeypatch.setattr(minimind.serving, "serve", lambda app, host, port: calls.append(app))
    monkeypatch.setattr(minimind.serving.CompiledBatchEngine, "warm_up", lambda engine: calls.append(engine) or 0.0)
    load_script("serve").main(
        [
            "--model_name_or_path",
            str(tmp_path / "m"),
            "--engine",
            "compiled",
            "--max_batch",
            "3",
            "--max_context",
            "64",
            "--no-compile",
        ]
    )
    load_script("serve").main(
        [
            "--model_name_or_path",
            str(tmp_path / "m"),
            "--engine",
            "compiled",
            "--max_batch",
            "4",
            "--max_context",
            "64",
        ]
    )
    uncompiled, warmed, compiled = calls
    engine = uncompiled.state.generator.engine
    assert isinstance(engine, minimind.serving.CompiledBatchEngine) and not engine.decoder.compiled
    assert (engine.max_batch, engine.batch_sizes, engine.cache.length) == (3, [1, 2, 3], 64)
    assert warmed is compiled.state.generator.engine and warmed.decoder.compiled  # compiled before serving


def test_api_key_guards_every_route(generator):
    """The API key guards every route, and the OpenAI client given the key works."""
    with serve_in_thread(create_app(generator, api_key="s3cret")) as url:
        for headers, message in (
            ({}, "You didn't provide an API key"),
            ({"Authorization": "Bearer wrong"}, "Incorrect API key provided"),
            ({"Authorization": "Basic s3cret"}, "You didn't provide an API key"),
        ):
            for method, path in (("GET", "/v1/models"), ("POST", "/v1/completions")):
                response = httpx.request(
                    method,
                    f"{url}{path}",
                    headers=headers,
                    timeout=30,
                    json={"model": MODEL_ID, "prompt": "x", "max_tokens": 1},
                )
                error = response.json()["error"]
                assert response.status_code == 401 and error["message"].startswith(message)
                assert (error["type"], error["param"], error["code"]) == (
                    "invalid_request_error",
                    None,
                    "invalid_api_key",
                )
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0).models.list()
        keyed = openai.OpenAI(base_url=f"{url}/v1", api_key="s3cret", max_retries=0, timeout=60)
        assert [m.id for m in keyed.models.list().data] == [MODEL_ID]
        reply = keyed.completions.create(model=MODEL_ID, prompt="x", max_tokens=2, temperature=0)
        assert reply.usage.completion_tokens == 2
    with pytest.raises(ValueError, match="api_key must not be empty"):
        create_app(generator, api_key="")


def test_over_max_concurrent_requests_is_429(app, base_url, monkeypatch):
    """A request beyond max_concurrent_requests is a 429 with Retry-After."""
    monkeypatch.setattr(app.state.admission, "limit", 0)
    body = {"model": MODEL_ID, "prompt": "x", "max_tokens": 1}
    for stream in (False, True):
        response = httpx.post(f"{base_url}/v1/completions", json={**body, "stream": stream}, timeout=30)
        assert (response.status_code, response.headers["retry-after"]) == (429, "1")
        assert response.json()["error"]["code"] == "rate_limit_exceeded"
        assert "--max_concurrent_requests" in response.json()["error"]["message"]
    monkeypatch.undo()
    assert httpx.post(f"{base_url}/v1/completions", json=body, timeout=30).status_code == 200
    assert app.state.admission.active == 0  # every request gave its slot back


@pytest.mark.parametrize("n", [1, 2])
def test_timeout_is_504_and_stops_generating(base_url, generator, monkeypatch, n):
    """A request past the timeout is a 504 and stops generating: one choice, and several generating together."""
    monkeypatch.setattr(generator.limits, "request_timeout", 0.001)
    body = {"model": MODEL_ID, "prompt": "Hello", "max_tokens": 100, "temperature": 0, "n": n}
    response = httpx.post(f"{base_url}/v1/completions", json=body, timeout=30)
    error = response.json()["error"]
    assert (response.status_code, error["type"], error["code"]) == (504, "timeout_error", "request_timeout")
    with httpx.stream("POST", f"{base_url}/v1/completions", json={**body, "stream": True}, timeout=30) as streamed:
        events = [line for line in streamed.iter_lines() if line.startswith("data: ")]
    assert streamed.status_code == 200 and '"code": "request_timeout"' in events[-1]
    with pytest.raises(openai.APIError, match="request timeout"):
        list(
            openai.OpenAI(base_url=f"{base_url}/v1", api_key="x", max_retries=0).completions.create(
                **body, stream=True
            )
        )
    wait_until_idle(generator, timeout=5)


def test_raw_stream_is_sse_ending_with_done(base_url):
    """The raw stream is server-sent events ending with [DONE]."""
    body = {"model": MODEL_ID, "prompt": "Hello", "max_tokens": 4, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{base_url}/v1/completions", json=body, timeout=30) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        raw = response.read().decode()
    events = raw.split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""]
    assert all(event.startswith("data: {") for event in events[:-2])


def test_stream_interval_sends_the_same_text_in_fewer_pieces(base_url, generator, monkeypatch):
    """Between a stream's first token and its last, the text waits out the stream interval and goes together: the
    same text and usage as with every token sent at once. The last token is never held: the request ends long
    before an hour's interval."""
    body = {
        "model": MODEL_ID,
        "prompt": "Once upon a time",
        "max_tokens": 40,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }

    def stream(interval):
        monkeypatch.setattr(generator, "stream_interval", interval)
        with httpx.stream("POST", f"{base_url}/v1/completions", json=body, timeout=60) as response:
            events = [
                json.loads(line[len("data: ") :]) for line in response.iter_lines() if line.startswith("data: {")
            ]
        pieces = [event["choices"][0]["text"] for event in events if event["choices"] and event["choices"][0]["text"]]
        return pieces, events[-1]["usage"]

    every_token, usage = stream(0.0)
    held, held_usage = stream(3600.0)
    assert usage["completion_tokens"] > 2 and held_usage == usage
    assert "".join(held) == "".join(every_token)
    assert len(held) <= 2  # the first token's text, then the rest with the last token


def test_client_leaving_stream_stops_generation(base_url, generator):
    """A client leaving mid-stream stops its generation."""
    steps = []
    hook = generator.model.register_forward_hook(lambda *args: steps.append(1))
    try:
        body = {"model": MODEL_ID, "prompt": "Hello", "max_tokens": 100, "temperature": 0, "stream": True}
        with httpx.stream("POST", f"{base_url}/v1/completions", json=body, timeout=30) as response:
            next(line for line in response.iter_lines() if '"text": "' in line and '"text": ""' not in line)
        wait_until_idle(generator)
        ran = len(steps)
        time.sleep(0.3)
        settled = len(steps)
        time.sleep(0.3)
        # The manager sees the cancel before its next step: at most the step in flight and one more ran.
        assert settled - ran <= 2 and len(steps) == settled < 50
    finally:
        hook.remove()


def test_failed_generation_is_500_and_frees_server(base_url, generator, monkeypatch):
    """A failing generation is a 500 in OpenAI shape and frees the server."""

    def broken_forward(*args, **kwargs):
        raise RuntimeError("device on fire")

    body = {"model": MODEL_ID, "prompt": "Hello", "max_tokens": 2, "temperature": 0}
    with monkeypatch.context() as patch:
        patch.setattr(generator.model, "forward", broken_forward)
        failed = httpx.post(f"{base_url}/v1/completions", json=body, timeout=30)
    assert failed.status_code == 500
    assert failed.json()["error"]["type"] == "server_error" and "device on fire" in failed.json()["error"]["message"]
    assert httpx.post(f"{base_url}/v1/completions", json=body, timeout=30).status_code == 200
    with monkeypatch.context() as patch:
        patch.setattr(generator.model, "forward", broken_forward)
        with httpx.stream("POST", f"{base_url}/v1/completions", json={**body, "stream": True}, timeout=30) as streamed:
            events = [line for line in streamed.iter_lines() if line.startswith("data: ")]
    assert streamed.status_code == 200 and '"type": "server_error"' in events[-1] and "device on fire" in events[-1]
    assert httpx.post(f"{base_url}/v1/completions", json=body, timeout=30).status_code == 200


@pytest.mark.parametrize(
    "pieces",
    [
        ["<thi", "nk>\nwhy", " not\n</th", "ink>\n\nBe", "cause."],
        ["\n", "<think>\nwhy not\n</think>\n\nBecause."],
        ["<think>\nwhy not", "\n</think>\n", "\nBecause", "."],
    ],
)
def test_reasoning_returned_as_reasoning_content(base_url, monkeypatch, pieces):
    """Reasoning comes back as reasoning_content, whole and streamed."""
    import json

    import minimind.serving

    async def scripted_pieces(self, deadline):  # the model's text, cut into pieces where tags split
        for piece in pieces:
            yield piece
        self.finish_reason = "stop"

    monkeypatch.setattr(minimind.serving.Sequence, "pieces", scripted_pieces)
    body = {"model": MODEL_ID, "messages": [{"role": "user", "content": "why?"}]}
    message = httpx.post(f"{base_url}/v1/chat/completions", json=body, timeout=30).json()["choices"][0]["message"]
    assert (message["reasoning_content"], message["content"]) == ("why not", "Because.")
    with httpx.stream("POST", f"{base_url}/v1/chat/completions", json={**body, "stream": True}, timeout=30) as sse:
        chunks = [json.loads(line[6:]) for line in sse.iter_lines() if line.startswith("data: {")]
    deltas = [chunk["choices"][0]["delta"] for chunk in chunks]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "why not"
    assert "".join(d.get("content", "") for d in deltas) == "Because."
    assert [chunk["choices"][0]["finish_reason"] for chunk in chunks][-1] == "stop"
    raw = httpx.post(f"{base_url}/v1/completions", json={"model": MODEL_ID, "prompt": "why?"}, timeout=30).json()
    assert raw["choices"][0]["text"] == "".join(pieces)  # completions keep the tags


def test_reply_without_think_has_no_reasoning(client):
    """A reply without a think block has no reasoning_content."""
    message = (
        client.chat.completions.create(
            model=MODEL_ID, messages=[{"role": "user", "content": "hi"}], max_tokens=4, temperature=0
        )
        .choices[0]
        .message
    )
    assert "reasoning_content" not in (message.model_extra or {}) and message.content


def test_sequences_beyond_paged_cache_wait(served_dir, reference):
    """A cache sized for one sequence (--max_concurrent_requests 1, plus the spare context) still serves four
    sequences that need more than it holds, each with exactly its greedy reply; a prompt longer than one batch step
    is prefilled in chunks (max_batch_tokens 256 here), also exactly."""
    import asyncio

    from minimind.serving import Sequence

    model, tokenizer = load_model_and_tokenizer(str(served_dir), "cpu")
    small = Generator(
        model,
        tokenizer,
        MODEL_ID,
        limits=ServerLimits(max_context=256, max_concurrent_requests=1, max_tokens=200, default_max_tokens=8),
    )
    assert small.engine.cache_tokens == 2 * 256  # one request at full context, plus the spare context
    prompts = [tokenizer("word " * 3 + str(i))["input_ids"] for i in range(3)] + [
        tokenizer("long " * 240)["input_ids"]
    ]
    lengths = [150, 120, 100, 12]
    assert len(prompts[-1]) > 256 - 16 and sum(map(len, prompts)) + sum(lengths) > 2 * 256

    async def run(ids, n):
        sequence = Sequence(small.engine, ids, SamplingParams(max_new_tokens=n, do_sample=False))
        return (
            "".join([piece async for piece in sequence.pieces()]),
            sequence.finish_reason,
            sequence.completion_tokens,
        )

    async def run_all():
        return await asyncio.gather(*(run(ids, n) for ids, n in zip(prompts, lengths)))

    try:
        served = asyncio.run(run_all())
    finally:
        small.engine.stop()
    assert served == [direct(reference, ids, n) for ids, n in zip(prompts, lengths)]


def test_developer_messages_are_system_messages(client):
    def reply(role):
        return (
            client.chat.completions.create(
                model=MODEL_ID,
                max_tokens=6,
                temperature=0,
                messages=[{"role": role, "content": "Be brief."}, {"role": "user", "content": "hi"}],
            )
            .choices[0]
            .message
        )

    assert reply("developer").content == reply("system").content != reply("user").content


@pytest.mark.parametrize(
    "context, concurrent, expected",
    [
        (256, 64, 65 * 256),  # every admitted request at full context fits under the cap
        (32768, 64, 2 * 32768),  # the 64M default's context: capped (not 65 x 32768 = 2.1M tokens, 18 GB)
        (2048, 64, 65536),  # the cap itself
        (256, 1, 2 * 256),  # never below two contexts
    ],
)
def test_default_kv_cache_holds_two_contexts(context, concurrent, expected):
    """The default KV cache is capped and holds two full contexts."""
    limits = ServerLimits(max_concurrent_requests=concurrent).check(context)
    assert limits.kv_cache_tokens == expected


def test_ids_and_object_names_match_openai(client):
    """Ids and object names are OpenAI's for each endpoint, streaming or not."""
    chat = client.chat.completions.create(
        model=MODEL_ID, max_tokens=2, temperature=0, messages=[{"role": "user", "content": "hi"}]
    )
    text = client.completions.create(model=MODEL_ID, prompt="hi", max_tokens=2, temperature=0)
    assert (chat.object, text.object) == ("chat.completion", "text_completion")
    assert chat.id.startswith("chatcmpl-") and text.id.startswith("cmpl-") and chat.id != text.id
    chat_chunks = list(
        client.chat.completions.create(
            model=MODEL_ID, max_tokens=2, temperature=0, stream=True, messages=[{"role": "user", "content": "hi"}]
        )
    )
    text_chunks = list(
        client.completions.create(model=MODEL_ID, prompt="hi", max_tokens=2, temperature=0, stream=True)
    )
    assert {c.object for c in chat_chunks} == {"chat.completion.chunk"}
    assert {c.object for c in text_chunks} == {"text_completion"}
    assert len({c.id for c in chat_chunks}) == 1 and chat_chunks[0].id.startswith("chatcmpl-")
    assert len({c.id for c in text_chunks}) == 1 and text_chunks[0].id.startswith("cmpl-")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="counts the process's threads in /proc")
def test_release_openmp_workers_until_torch_runs():
    """release_openmp_workers gives this thread's workers back until torch runs again."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        numbers = torch.ones(1 << 22)
        numbers.add_(1)  # a parallel region: this thread now keeps one OpenMP worker
        before = len(os.listdir("/proc/self/task"))
        assert release_openmp_workers()
        assert len(os.listdir("/proc/self/task")) == before - 1
        numbers.add_(1)
        assert len(os.listdir("/proc/self/task")) == before and numbers[0].item() == 3.0
    finally:
        torch.set_num_threads(threads)
