"""The server against hostile or careless requests: bodies over --max_request_bytes (413 before parsing, with and
without Content-Length), text that is not Unicode, loosely typed numbers, deeply nested JSON, long prompts refused
without tokenizing, the docs behind the API key, the warning for a keyless server off loopback, and small requests
answered while a large one is being tokenized. A real uvicorn on a loopback port, the paged engine (the limits sit in
front of either engine: tests/serving/test_app.py runs both)."""

import itertools
import json
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from conftest import load_script, model_dir
from minimind.chat import load_model_and_tokenizer
from minimind.serving import (
    Generator,
    ServerLimits,
    _Tokenizers,
    create_app,
    is_loopback_host,
    max_chars_per_token,
    serve_in_thread,
)

MODEL_ID = "tiny-minimind"
LIMITS = ServerLimits(
    max_context=128,
    default_max_tokens=4,
    max_tokens=16,
    max_n=2,
    max_prompt_tokens=100,
    max_concurrent_requests=16,
    request_timeout=60,
)
LIMIT = LIMITS.max_request_bytes
JSON = {"Content-Type": "application/json"}


@pytest.fixture(scope="module")
def generator(tmp_path_factory):
    path = tmp_path_factory.mktemp("served-limits")
    model_dir(path)
    model, tokenizer = load_model_and_tokenizer(str(path), "cpu")
    return Generator(model, tokenizer, MODEL_ID, limits=LIMITS)


@pytest.fixture(scope="module")
def base_url(generator):
    with serve_in_thread(create_app(generator)) as url:
        yield url


def post(base_url, path, body: bytes, **kwargs):
    return httpx.post(f"{base_url}{path}", content=body, headers=JSON, timeout=30, **kwargs)


def error_of(response):
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


def body_of_size(size: int, chat: bool) -> bytes:
    """A request of exactly `size` bytes: one long prompt (chat: one long message) of "word "s."""

    def encoded(text):
        body = {"model": MODEL_ID, **({"messages": [{"role": "user", "content": text}]} if chat else {"prompt": text})}
        return json.dumps(body).encode()

    text = "word " * ((size - len(encoded(""))) // 5)
    text += "x" * (size - len(encoded(text)))
    assert len(encoded(text)) == size
    return encoded(text)


# ----------------------------------------------------------------------------------------------------------
# Request size
# ----------------------------------------------------------------------------------------------------------


def test_max_request_bytes_defaults_to_one_mib():
    assert LIMIT == ServerLimits().max_request_bytes == 1_048_576


def assert_too_large(response, limit=LIMIT):
    error = error_of(response)
    assert (response.status_code, error["type"], error["param"], error["code"]) == (
        413,
        "invalid_request_error",
        None,
        "request_too_large",
    )
    assert error["message"] == (
        f"The request body is larger than this server's limit of {limit} bytes "
        "(--max_request_bytes). Send a shorter prompt."
    )
    assert response.headers["connection"] == "close"


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_one_byte_over_the_limit_is_413(base_url, chat):
    """A body one byte over the limit is a 413, and one at the limit is parsed."""
    path = "/v1/chat/completions" if chat else "/v1/completions"
    over = post(base_url, path, body_of_size(LIMIT + 1, chat))
    assert_too_large(over)
    at_limit = post(base_url, path, body_of_size(LIMIT, chat))
    error = error_of(at_limit)
    assert (at_limit.status_code, error["param"], error["code"]) == (
        400,
        "messages" if chat else "prompt",
        "context_length_exceeded",
    )


def test_413_comes_before_parsing(base_url):
    """The 413 comes before parsing, with Content-Length or chunked."""
    # Not JSON at all: parsed, it would be a 400 invalid_json.
    declared = post(base_url, "/v1/completions", b"{" + b" " * LIMIT)
    assert declared.request.headers["content-length"] == str(LIMIT + 1)
    assert_too_large(declared)
    assert post(base_url, "/v1/completions", b"{" + b" " * 100).json()["error"]["code"] == "invalid_json"

    sent = []

    def endless():  # chunked, no Content-Length, never ends: only counting while reading can stop it
        for _ in itertools.count():
            sent.append(65536)
            yield b" " * 65536
            if sum(sent) > 64 * LIMIT:
                raise AssertionError("the server kept reading past its limit")

    chunked = httpx.post(f"{base_url}/v1/completions", content=endless(), headers=JSON, timeout=30)
    assert chunked.request.headers["transfer-encoding"] == "chunked"
    assert "content-length" not in chunked.request.headers
    assert_too_large(chunked)
    assert httpx.get(f"{base_url}/v1/models", timeout=30).status_code == 200  # the server is fine


def test_chunked_body_within_limit_is_served(base_url):
    body = json.dumps({"model": MODEL_ID, "prompt": "Hello", "max_tokens": 2, "temperature": 0}).encode()
    response = httpx.post(f"{base_url}/v1/completions", content=iter([body[:10], body[10:]]), headers=JSON, timeout=30)
    assert response.request.headers["transfer-encoding"] == "chunked"
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 2


# ----------------------------------------------------------------------------------------------------------
# Text, types, nesting
# ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi \ud800 there"}]}, "messages.0.content"),
        (
            "/v1/chat/completions",
            {
                "messages": [
                    {"role": "system", "content": "ok"},
                    {"role": "user", "content": [{"type": "text", "text": "\udfff"}]},
                ]
            },
            "messages.1.content.0.text",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "hi"}], "stop": ["ok", "x\ud800"]},
            "stop.1",
        ),
        ("/v1/completions", {"prompt": "\ud800"}, "prompt"),
        ("/v1/completions", {"prompt": ["fine", "\udbff"]}, "prompt.1"),
        ("/v1/completions", {"prompt": "hi", "stop": "\ud800"}, "stop"),
        ("/v1/completions", {"prompt": "hi", "model": "tiny\ud800"}, "model"),  # before the 404, which echoes it
    ],
)
def test_lone_surrogate_is_400_naming_field(base_url, path, body, param):
    response = post(base_url, path, json.dumps({"model": MODEL_ID, **body}).encode())  # ascii: "\ud800" escapes
    error = error_of(response)
    assert (response.status_code, error["param"], error["code"]) == (400, param, "invalid_value")
    assert error["message"].startswith(
        f"Invalid value for '{param}': the text is not valid Unicode (a lone surrogate, U+D"
    )


def test_raw_surrogate_bytes_are_the_same_400(base_url):
    response = post(base_url, "/v1/completions", b'{"model": "%s", "prompt": "a\xed\xa0\x80"}' % MODEL_ID.encode())
    error = error_of(response)
    assert (response.status_code, error["param"]) == (400, "prompt")
    assert "not valid Unicode (a lone surrogate, U+D800, at character 1)" in error["message"]


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("max_tokens", True, "Input should be a valid integer"),
        ("max_tokens", 1.5, "Input should be a valid integer"),
        ("max_tokens", 2.0, "Input should be a valid integer"),
        ("max_tokens", "2", "Input should be a valid integer"),
        ("max_completion_tokens", True, "Input should be a valid integer"),
        ("max_completion_tokens", 3.0, "Input should be a valid integer"),
        ("n", True, "Input should be a valid integer"),
        ("n", 1.0, "Input should be a valid integer"),
        ("top_k", 2.0, "Input should be a valid integer"),
        ("top_k", False, "Input should be a valid integer"),
        ("seed", False, "Input should be a valid integer"),
        ("seed", 1.5, "Input should be a valid integer"),
        ("temperature", True, "Input should be a valid number"),
        ("temperature", "0.5", "Input should be a valid number"),
        ("top_p", False, "Input should be a valid number"),
        ("stream", "yes", "Input should be a valid boolean"),
        ("stream", 1, "Input should be a valid boolean"),
    ],
)
def test_loose_types_are_400_naming_field(base_url, field, value, message):
    """Loosely typed numbers and flags are a 400 naming the field."""
    for path, prompt in (
        ("/v1/completions", {"prompt": "hi"}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
    ):
        response = post(base_url, path, json.dumps({"model": MODEL_ID, **prompt, field: value}).encode())
        error = error_of(response)
        assert (response.status_code, error["param"], error["code"]) == (400, field, "invalid_value")
        assert error["message"] == f"Invalid value for '{field}': {message}"


def test_floats_still_take_integers(base_url):
    body = {"model": MODEL_ID, "prompt": "hi", "max_tokens": 1, "temperature": 1, "top_p": 1, "seed": 7}
    response = post(base_url, "/v1/completions", json.dumps(body).encode())
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 1


class Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records = []

    def emit(self, record):
        self.records.append(record)


@pytest.mark.parametrize(
    "body",
    [
        b"[" * 100_000 + b"]" * 100_000,
        b'{"model": "%s", "prompt": ' % MODEL_ID.encode() + b"[" * 100_000 + b"]" * 100_000 + b"}",
        b'{"model": "%s", "prompt": "x", "stream_options": ' % MODEL_ID.encode()
        + b'{"a": ' * 100_000
        + b"1"
        + b"}" * 100_001,
    ],
    ids=["top level", "in a field", "in stream_options"],
)
def test_deeply_nested_json_is_a_clean_400(base_url, body):
    """JSON nested 100000 deep is a 400 without a traceback."""
    assert len(body) < LIMIT
    records = Records()
    loggers = [logging.getLogger(name) for name in ("uvicorn.error", "uvicorn", "")]
    for logger in loggers:
        logger.addHandler(records)
    try:
        response = post(base_url, "/v1/completions", body)
    finally:
        for logger in loggers:
            logger.removeHandler(records)
    error = error_of(response)
    assert (response.status_code, error["code"]) == (400, "invalid_json")
    assert error["message"] == "The request body is not valid JSON here: it is nested too deeply."
    assert not [r for r in records.records if r.exc_info or "Recursion" in r.getMessage()]


def test_non_utf8_body_is_400(base_url):
    response = post(base_url, "/v1/completions", b'{"model": "x", "prompt": "\xff"}')
    assert (response.status_code, error_of(response)["code"]) == (400, "invalid_json")


# ----------------------------------------------------------------------------------------------------------
# Long prompts: refused before tokenizing where the count is certain; tokenized off the event loop
# ----------------------------------------------------------------------------------------------------------


def test_character_bound_bounds_token_count(generator):
    """The character bound is the longest token's length and really bounds the token count."""
    tokenizer = generator.tokenizer
    per_token = max_chars_per_token(tokenizer)
    assert per_token == max(len(token) for token in tokenizer.get_vocab()) == len("<|endoftext|>") == 13
    assert generator.max_prompt_chars == 13 * LIMITS.max_prompt_tokens
    longest_words = sorted(tokenizer.get_vocab(), key=len)[-50:]
    texts = [
        "a" * 5000,
        "Netherlands" * 300,
        " Netherlands" * 300,
        "<|endoftext|>" * 300,
        "<think>" * 300,
        "你好，世界。" * 300,
        "🙂" * 500,
        " " * 5000,
        "\n" * 5000,
        "".join(word.replace("Ġ", " ") for word in longest_words),
    ]
    for text in texts:
        assert len(text) <= per_token * len(tokenizer(text)["input_ids"]), text[:40]


def test_no_character_bound_for_unbounded_tokens(generator):
    """No character bound where a token can stand for any length of text."""
    import copy

    from tokenizers import normalizers

    normalized = copy.deepcopy(generator.tokenizer)
    normalized.backend_tokenizer.normalizer = normalizers.NFKC()  # may fold several characters into one
    assert max_chars_per_token(normalized) is None
    assert max_chars_per_token(object()) is None  # not a fast tokenizer: unknown


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_long_prompt_refused_before_tokenizing(base_url, generator, monkeypatch, chat):
    """A prompt over the character bound is refused without tokenizing it."""
    import minimind.serving
    import minimind.serving.app

    tokenized = []
    if chat:  # the rendered conversation is measured in the tokenizer thread, before it is tokenized
        original = minimind.serving.app.chat_prompt_ids
        monkeypatch.setattr(
            minimind.serving.app, "chat_prompt_ids", lambda *args: tokenized.append(1) or original(*args)
        )
    else:  # a raw prompt is measured before it goes to a tokenizer thread
        monkeypatch.setattr(minimind.serving._Tokenizers, "run", lambda *args: tokenized.append(1))
    text = "word " * (generator.max_prompt_chars // 5) + "x"  # 1 character over; about 260 tokens
    assert len(text) == generator.max_prompt_chars + 1
    body = {"messages": [{"role": "user", "content": text}]} if chat else {"prompt": ["fine", text]}
    response = post(
        base_url,
        "/v1/chat/completions" if chat else "/v1/completions",
        json.dumps({"model": MODEL_ID, **body}).encode(),
    )
    error = error_of(response)
    param = "messages" if chat else "prompt"
    assert (response.status_code, error["param"], error["code"]) == (400, param, "context_length_exceeded")
    chars = len(text) + (len("<|im_start|>user\n<|im_end|>\n<|im_start|>assistant\n") if chat else 0)
    assert error["message"] == (
        f"This model's maximum context length is 128 tokens and prompts may have at most 100; "
        f"the {param} has {chars} characters, more than 100 tokens however it is tokenized. "
        "Shorten it."
    )
    assert tokenized == []


def test_each_tokenizer_thread_has_its_own_copy(generator):
    """Chat messages are tokenized with special tokens split, raw prompts without, a setting the fast tokenizer
    keeps in its one Rust object: two threads sharing it could swap settings."""
    import asyncio

    tokenizers = _Tokenizers(generator.tokenizer)
    together = threading.Barrier(2)

    def which(tokenizer):
        together.wait(timeout=10)  # both threads hold a tokenizer at once
        return id(tokenizer), tokenizer("<|im_start|>")["input_ids"]

    async def both():
        return await asyncio.gather(tokenizers.run(which), tokenizers.run(which))

    try:
        (first, ids_1), (second, ids_2) = asyncio.run(both())
    finally:
        tokenizers.close()
    assert len({first, second, id(generator.tokenizer)}) == 3
    assert ids_1 == ids_2 == generator.tokenizer("<|im_start|>")["input_ids"] and len(ids_1) == 1


def test_large_prompt_leaves_small_requests_fast(base_url, generator, monkeypatch):
    """A chat message just under --max_request_bytes that the character bound cannot refuse (here it is switched
    off, as for a tokenizer without one) is rendered and tokenized for about a second, then refused by the prompt
    limit. A burst of small requests on other connections meanwhile (5 /v1/models, 3 one-token completions) answers
    each within 5x its latency in the same burst on the idle server just before (plus 0.5 s for a busy machine)."""
    import minimind.serving.app

    monkeypatch.setattr(generator, "max_prompt_chars", None)
    tokenizing = threading.Event()
    original = minimind.serving.app.chat_prompt_ids
    monkeypatch.setattr(minimind.serving.app, "chat_prompt_ids", lambda *args: tokenizing.set() or original(*args))

    def models():
        response = httpx.get(f"{base_url}/v1/models", timeout=10)
        assert response.status_code == 200

    def completion():
        response = httpx.post(
            f"{base_url}/v1/completions",
            timeout=10,
            json={"model": MODEL_ID, "prompt": "Hello", "max_tokens": 1, "temperature": 0},
        )
        assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 1

    def seconds(ask):
        start = time.monotonic()
        ask()
        return time.monotonic() - start

    burst = [models] * 5 + [completion] * 3
    big = body_of_size(LIMIT - 16, chat=True)

    def large():
        response = post(base_url, "/v1/chat/completions", big)
        assert error_of(response)["code"] == "context_length_exceeded"
        return time.monotonic()

    with ThreadPoolExecutor(len(burst) + 1) as pool:

        def send(asks):
            return [future.result(timeout=15) for future in [pool.submit(seconds, ask) for ask in asks]]

        send(burst)  # warm: connections, the engine, the tokenizer threads' copies
        idle = send(burst)
        large_done = pool.submit(large)
        assert tokenizing.wait(timeout=10)
        loaded = send(burst)
        small_done = time.monotonic()
        large_end = large_done.result(timeout=20)
    assert large_end > small_done, "the large prompt was tokenized before the small requests were answered"
    worst_idle = {ask: max(took for a, took in zip(burst, idle) if a is ask) for ask in set(burst)}
    latencies = [(ask.__name__, took, worst_idle[ask]) for ask, took in zip(burst, loaded)]
    slow = [(name, took, was) for name, took, was in latencies if took > 5 * was + 0.5]
    assert not slow, (slow, latencies)
    print(
        f"large prompt answered {large_end - small_done:.2f} s after the burst; burst latencies (s, idle s): "
        + ", ".join(f"{name} {took:.3f} ({was:.3f})" for name, took, was in latencies)
    )


# ----------------------------------------------------------------------------------------------------------
# Exposure: the docs behind the key, the warning off loopback
# ----------------------------------------------------------------------------------------------------------


def test_key_hides_docs_and_schema(generator):
    """The docs and schema are not served when an API key is set."""
    from starlette.testclient import TestClient

    keyed, open_app = TestClient(create_app(generator, api_key="s3cret")), TestClient(create_app(generator))
    for path in ("/docs", "/redoc", "/openapi.json"):
        for headers in ({}, {"Authorization": "Bearer s3cret"}):
            response = keyed.get(path, headers=headers)
            assert response.status_code == 404 and "paths" not in response.text and "swagger" not in response.text
        assert open_app.get(path).status_code == 200
    assert "/v1/chat/completions" in open_app.get("/openapi.json").json()["paths"]
    assert keyed.get("/v1/models", headers={"Authorization": "Bearer s3cret"}).status_code == 200


@pytest.mark.parametrize(
    "host, loopback",
    [
        ("127.0.0.1", True),
        ("127.1.2.3", True),
        ("::1", True),
        ("[::1]", True),
        ("localhost", True),
        ("LocalHost", True),
        ("::ffff:127.0.0.1", True),
        ("0.0.0.0", False),
        ("::", False),
        ("", False),
        ("192.168.1.10", False),
        ("10.0.0.1", False),
        ("128.0.0.1", False),
        ("example.com", False),
        ("localhost.example.com", False),
        ("fe80::1", False),
    ],
)
def test_is_loopback_host(host, loopback):
    assert is_loopback_host(host) is loopback


@pytest.mark.parametrize(
    "argv, warning",
    [
        (
            ["--host", "0.0.0.0"],
            "warning: serving on 0.0.0.0:8000 without --api_key: anyone who can reach this port "
            "can use the model; pass --api_key (or set MINIMIND_API_KEY)\n",
        ),
        (
            ["--host", "::", "--port", "9000"],
            "warning: serving on [::]:9000 without --api_key: anyone who can reach "
            "this port can use the model; pass --api_key (or set MINIMIND_API_KEY)\n",
        ),
        (["--host", "0.0.0.0", "--api_key", ""], "warning: serving on 0.0.0.0:8000 without --api_key"),
        (["--host", "127.0.0.1"], None),
        ([], None),
        (["--host", "0.0.0.0", "--api_key", "k"], None),
    ],
    ids=["0.0.0.0", "::", "empty key", "127.0.0.1", "default", "with key"],
)
def test_serve_warns_open_host_without_key(monkeypatch, generator, tmp_path, capsys, argv, warning):
    """serve warns when it binds beyond loopback without an API key."""
    import uvicorn

    import minimind.chat

    runs = []
    monkeypatch.delenv("MINIMIND_API_KEY", raising=False)
    monkeypatch.setattr(
        minimind.chat, "load_model_and_tokenizer", lambda *args, **kwargs: (generator.model, generator.tokenizer)
    )
    monkeypatch.setattr(uvicorn, "run", lambda app, **kwargs: runs.append(kwargs))
    load_script("serve").main(["--model_name_or_path", str(tmp_path / "m"), *argv])
    err = capsys.readouterr().err
    assert len(runs) == 1
    if warning is None:
        assert "warning" not in err
    else:
        assert warning in err and err.count("warning:") == 1


def test_serve_takes_max_request_bytes(monkeypatch, generator, tmp_path):
    from starlette.testclient import TestClient

    import minimind.chat
    import minimind.serving

    apps = []
    monkeypatch.setattr(
        minimind.chat, "load_model_and_tokenizer", lambda *args, **kwargs: (generator.model, generator.tokenizer)
    )
    monkeypatch.setattr(minimind.serving, "serve", lambda app, host, port: apps.append(app))
    load_script("serve").main(["--model_name_or_path", str(tmp_path / "m"), "--max_request_bytes", "2048"])
    assert apps[0].state.generator.limits.max_request_bytes == 2048
    client = TestClient(apps[0])
    assert_too_large(client.post("/v1/completions", content=b" " * 2049, headers=JSON), limit=2048)
    assert client.post("/v1/completions", content=b" " * 2048, headers=JSON).json()["error"]["code"] == "invalid_json"
    with pytest.raises(SystemExit):
        load_script("serve").main(["--model_name_or_path", str(tmp_path / "m"), "--max_request_bytes", "0"])
