"""The OpenAI-compatible server: a real uvicorn on a loopback port, driven by the official `openai` client
(streaming and not) and by raw httpx for malformed requests. Greedy decoding throughout, so every answer can be
compared with the same generation run directly."""

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import uvicorn
from conftest import load_script, model_dir

from minimind.chat import SamplingParams, TextStream, chat_prompt_ids, load_model_and_tokenizer
from minimind.serving import Generator, create_app

MODEL_ID = "tiny-minimind"
MAX_CONTEXT = 128  # below the model's 256, to check the --max_context limit


def _served_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("served")
    model_dir(path, std=0.3)  # sharp logits: greedy replies vary with the prompt
    return path


@pytest.fixture(scope="module")
def generator(tmp_path_factory):
    model, tokenizer = load_model_and_tokenizer(str(_served_dir(tmp_path_factory)), "cpu")
    return Generator(model, tokenizer, MODEL_ID, max_context=MAX_CONTEXT, default_max_tokens=8)


@pytest.fixture(scope="module")
def base_url(generator):
    server = uvicorn.Server(uvicorn.Config(create_app(generator), host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "server did not start"
        time.sleep(0.02)
    port = server.servers[0].sockets[0].getsockname()[1]
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(timeout=30)
    assert not thread.is_alive(), "server did not stop"


@pytest.fixture(scope="module")
def client(base_url):
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=60)


def direct(generator, prompt_ids, max_tokens, stop=()):
    """The text, finish reason and token count of the same greedy generation without the server."""
    stream = TextStream(generator.model, generator.tokenizer, prompt_ids,
                        SamplingParams(max_new_tokens=max_tokens, do_sample=False, stop=list(stop)))
    return "".join(stream), stream.finish_reason, stream.completion_tokens


def chat_ids(generator, text):
    return chat_prompt_ids(generator.tokenizer, [{"role": "user", "content": text}])


def test_lists_the_served_model(client):
    assert [m.id for m in client.models.list().data] == [MODEL_ID]


def test_chat_completion_equals_direct_generation_with_usage(client, generator):
    response = client.chat.completions.create(model=MODEL_ID, messages=[{"role": "user", "content": "hello"}],
                                              max_tokens=6, temperature=0)
    text, reason, tokens = direct(generator, chat_ids(generator, "hello"), 6)
    choice = response.choices[0]
    assert (choice.message.role, choice.message.content, choice.finish_reason) == ("assistant", text, reason)
    prompt_tokens = len(chat_ids(generator, "hello"))
    assert (response.usage.prompt_tokens, response.usage.completion_tokens, response.usage.total_tokens) == (
        prompt_tokens, tokens, prompt_tokens + tokens)
    assert reason == "length" and tokens == 6


def test_chat_streaming_sends_the_same_text_then_usage(client):
    kwargs = dict(model=MODEL_ID, messages=[{"role": "system", "content": "be nice"},
                                            {"role": "user", "content": [{"type": "text", "text": "hi"}]}],
                  max_tokens=10, temperature=0)
    whole = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    content = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert len(content) > 1  # really streamed, not one block
    assert "".join(content) == whole.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.model_dump() == whole.usage.model_dump()


def test_completions_with_n_choices_stream_and_not(client, generator):
    prompt = "Once upon a time"
    response = client.completions.create(model=MODEL_ID, prompt=prompt, max_tokens=5, temperature=0, n=2)
    text, reason, tokens = direct(generator, generator.tokenizer(prompt)["input_ids"], 5)
    assert [(c.index, c.text, c.finish_reason) for c in response.choices] == [(0, text, reason), (1, text, reason)]
    assert response.usage.completion_tokens == 2 * tokens
    assert response.usage.prompt_tokens == len(generator.tokenizer(prompt)["input_ids"])

    streamed = {0: "", 1: ""}
    for chunk in client.completions.create(model=MODEL_ID, prompt=prompt, max_tokens=5, temperature=0, n=2,
                                           stream=True):
        streamed[chunk.choices[0].index] += chunk.choices[0].text
    assert streamed == {0: text, 1: text}


def test_stop_strings_cut_the_output(client, generator):
    full, _, _ = direct(generator, chat_ids(generator, "a story"), 16)
    stop = full[len(full) // 2: len(full) // 2 + 2]
    expected = full[:full.index(stop)]
    for stops in (stop, ["zzzz-not-there", stop]):
        response = client.chat.completions.create(model=MODEL_ID, messages=[{"role": "user", "content": "a story"}],
                                                  max_tokens=16, temperature=0, stop=stops)
        assert (response.choices[0].message.content, response.choices[0].finish_reason) == (expected, "stop")
    chunks = client.chat.completions.create(model=MODEL_ID, messages=[{"role": "user", "content": "a story"}],
                                            max_tokens=16, temperature=0, stop=stop, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected


def test_sampling_honours_seed_temperature_and_top_p(client):
    kwargs = dict(model=MODEL_ID, prompt="The", max_tokens=8, temperature=1.5, top_p=0.95, seed=7)
    first, again = client.completions.create(**kwargs), client.completions.create(**kwargs)
    assert first.choices[0].text == again.choices[0].text
    other_seeds = {client.completions.create(**{**kwargs, "seed": seed}).choices[0].text for seed in (1, 2, 3)}
    assert len(other_seeds | {first.choices[0].text}) > 1  # really sampling


@pytest.mark.parametrize("body, status, param, code", [
    ({"model": "gpt-4", "messages": [{"role": "user", "content": "x"}]}, 404, "model", "model_not_found"),
    ({"model": MODEL_ID, "messages": [{"role": "user", "content": "x"}], "max_tokens": -1}, 400, "max_tokens",
     "invalid_value"),
    ({"model": MODEL_ID, "messages": [{"role": "user", "content": "x"}], "temperature": 3}, 400, "temperature",
     "invalid_value"),
    ({"model": MODEL_ID, "messages": []}, 400, "messages", "invalid_value"),
    ({"model": MODEL_ID, "messages": [{"role": "user", "content": "word " * MAX_CONTEXT}]}, 400, "messages",
     "context_length_exceeded"),
])
def test_bad_chat_requests_get_openai_errors(base_url, body, status, param, code):
    response = httpx.post(f"{base_url}/v1/chat/completions", json=body, timeout=30)
    assert response.status_code == status
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert (error["param"], error["code"]) == (param, code)


def test_malformed_and_misrouted_requests_get_openai_errors(base_url):
    bad_json = httpx.post(f"{base_url}/v1/completions", content=b'{"model": "x", "prompt": ',
                          headers={"Content-Type": "application/json"}, timeout=30)
    assert bad_json.status_code == 400 and bad_json.json()["error"]["code"] == "invalid_json"
    too_long = httpx.post(f"{base_url}/v1/completions", json={"model": MODEL_ID, "prompt": "word " * MAX_CONTEXT},
                          timeout=30)
    assert too_long.status_code == 400 and too_long.json()["error"]["param"] == "prompt"
    empty = httpx.post(f"{base_url}/v1/completions", json={"model": MODEL_ID, "prompt": ""}, timeout=30)
    assert empty.status_code == 400 and empty.json()["error"]["param"] == "prompt"
    missing = httpx.get(f"{base_url}/v1/nothing-here", timeout=30)
    assert missing.status_code == 404 and missing.json()["error"]["type"] == "not_found_error"


def test_concurrent_requests_get_their_own_answers(client, generator):
    greedy = [{"prompt": p, "temperature": 0} for p in ("red apples", "the sea", "numbers 1 2 3", "good morning")]
    # Seeded sampling is reproducible only if no other request samples in between: generation is serialised.
    seeded = [{"prompt": p, "temperature": 1.5, "seed": 11} for p in ("the sea", "blue sky")]
    requests = greedy + seeded
    expected = [direct(generator, chat_ids(generator, r["prompt"]), 8)[0] for r in greedy]
    expected += [ask_chat(client, r, stream=False) for r in seeded]
    start = threading.Barrier(len(requests))

    def ask(index):
        start.wait(timeout=30)
        return ask_chat(client, requests[index], stream=bool(index % 2))  # streams and plain requests overlap

    with ThreadPoolExecutor(len(requests)) as pool:
        answers = list(pool.map(ask, range(len(requests)), timeout=120))
    assert answers == expected


def ask_chat(client, request, stream):
    kwargs = dict(model=MODEL_ID, messages=[{"role": "user", "content": request["prompt"]}], max_tokens=8,
                  temperature=request["temperature"], seed=request.get("seed"))
    if stream:
        return "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(**kwargs, stream=True))
    return client.chat.completions.create(**kwargs).choices[0].message.content


def test_serve_script_binds_loopback_by_default(monkeypatch, generator, tmp_path):
    import minimind.chat
    import minimind.serving

    calls = []
    monkeypatch.setattr(minimind.chat, "load_model_and_tokenizer", lambda *args: (generator.model, generator.tokenizer))
    monkeypatch.setattr(minimind.serving, "serve", lambda app, host, port: calls.append((app, host, port)))
    load_script("serve").main(["--model_name_or_path", str(tmp_path / "my-model"), "--max_context", "64"])
    app, host, port = calls[0]
    assert (host, port) == ("127.0.0.1", 8000)
    assert {route.path for route in app.routes} >= {"/v1/models", "/v1/chat/completions", "/v1/completions"}


def test_raw_stream_is_server_sent_events_ending_with_done(base_url):
    body = {"model": MODEL_ID, "prompt": "Hello", "max_tokens": 4, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{base_url}/v1/completions", json=body, timeout=30) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        raw = response.read().decode()
    events = raw.split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""]
    assert all(event.startswith("data: {") for event in events[:-2])


def test_client_leaving_mid_stream_stops_its_generation(base_url, generator):
    steps = []
    hook = generator.model.register_forward_hook(lambda *args: steps.append(1))
    try:
        body = {"model": MODEL_ID, "prompt": "Hello", "max_tokens": 100, "temperature": 0, "stream": True}
        with httpx.stream("POST", f"{base_url}/v1/completions", json=body, timeout=30) as response:
            next(line for line in response.iter_lines() if line.startswith("data: {"))
        deadline = time.monotonic() + 30
        while generator.lock.locked() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not generator.lock.locked()
        assert len(steps) < 50  # cancelled, not run to max_tokens
    finally:
        hook.remove()


def test_a_failing_generation_is_a_500_in_openai_shape_and_frees_the_server(base_url, generator, monkeypatch):
    def broken_generate(*args, **kwargs):
        raise RuntimeError("device on fire")

    body = {"model": MODEL_ID, "prompt": "Hello", "max_tokens": 2, "temperature": 0}
    with monkeypatch.context() as patch:
        patch.setattr(generator.model, "generate", broken_generate)
        failed = httpx.post(f"{base_url}/v1/completions", json=body, timeout=30)
    assert failed.status_code == 500
    assert failed.json()["error"]["type"] == "server_error" and "device on fire" in failed.json()["error"]["message"]
    assert httpx.post(f"{base_url}/v1/completions", json=body, timeout=30).status_code == 200
