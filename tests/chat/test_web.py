"""The web chat page (`minimind.web`, `scripts/web_demo.py`): the message helpers on fixed replies, the streamed reply
against greedy `generate`, and the page itself in a real headless browser (Chromium driven by Playwright)."""

import os
import shutil
import socket
import subprocess
import sys
import time

import pytest
import torch

from conftest import ROOT, TOKENIZER_DIR, TOKENIZER_FILES, load_script, model_dir, tiny_model
from minimind.chat import SamplingParams, chat_prompt_ids, load_model_and_tokenizer
from minimind.web import THINKING_TITLE, conversation, reply_messages, stream_reply

CHROMIUM = "/usr/bin/chromium"


# --------------------------------------------------------------------------------------------------------------
# The message helpers
# --------------------------------------------------------------------------------------------------------------


def test_reasoning_folds_before_the_answer():
    """A reply with reasoning is a folded thought, then the answer."""
    reply = "<think>\nThree plus four: count on from three.\n</think>\n\nIt is 7."
    assert reply_messages(reply) == [
        {
            "role": "assistant",
            "content": "Three plus four: count on from three.",
            "metadata": {"title": THINKING_TITLE, "status": "done"},
        },
        {"role": "assistant", "content": "It is 7."},
    ]


def test_streamed_thought_stays_open_until_answer():
    thinking = reply_messages("<think>\nCount on", finished=False)
    assert thinking == [
        {"role": "assistant", "content": "Count on", "metadata": {"title": THINKING_TITLE, "status": "pending"}}
    ]
    answering = reply_messages("<think>\nCount on\n</think>\n\nIt", finished=False)
    assert [m.get("metadata", {}).get("status") for m in answering] == ["done", None]
    assert answering[1]["content"] == "It"
    # Stopped while still thinking (max tokens): the reasoning is all there is, folded.
    assert reply_messages("<think>\nCount on", finished=True)[0]["metadata"]["status"] == "done"


def test_reply_without_reasoning_is_one_message():
    assert reply_messages("It is 7.") == [{"role": "assistant", "content": "It is 7."}]
    # The empty block a template writes when thinking is off is not shown as an empty thought.
    assert reply_messages("<think>\n\n</think>\n\nIt is 7.") == [{"role": "assistant", "content": "It is 7."}]
    assert reply_messages("") == [{"role": "assistant", "content": ""}]
    assert reply_messages(" It is 7.\n") == [{"role": "assistant", "content": "It is 7."}]


def test_page_history_keeps_reasoning():
    """The conversation built from the page's history keeps the reasoning and adds the system prompt."""
    # History as Gradio 6 hands it to the chat function: content as typed parts, thoughts with a title.
    thought = {"title": THINKING_TITLE, "status": "done"}
    history = [
        {"role": "user", "content": [{"type": "text", "text": "What is 3 plus 4?"}], "metadata": None},
        {"role": "assistant", "content": [{"type": "text", "text": "Count on."}], "metadata": thought},
        {"role": "assistant", "content": [{"type": "text", "text": "It is 7."}], "metadata": None},
        {"role": "user", "content": [{"type": "text", "text": "Hi"}], "metadata": None},
        {"role": "assistant", "content": [{"type": "text", "text": "Hello."}], "metadata": None},
        {"role": "user", "content": [{"type": "text", "text": "Think long"}], "metadata": None},
        {"role": "assistant", "content": [{"type": "text", "text": "First"}], "metadata": thought},  # stopped
    ]
    assert conversation(history, "And 2 plus 2?", "Be brief.") == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 3 plus 4?"},
        {"role": "assistant", "content": "It is 7.", "reasoning_content": "Count on."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Think long"},
        {"role": "assistant", "content": "", "reasoning_content": "First"},
        {"role": "user", "content": "And 2 plus 2?"},
    ]
    assert conversation([], "Hi", "  ") == [{"role": "user", "content": "Hi"}]


# --------------------------------------------------------------------------------------------------------------
# The streamed reply against greedy generate
# --------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def chat_model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("web-model")
    model_dir(path, std=0.3)  # sharp logits: greedy replies differ from prompt to prompt
    return str(path)


def greedy_reply(path, messages, max_new_tokens, **template_kwargs):
    """What the page must show: `generate` with greedy decoding, the new tokens decoded as the stream decodes."""
    model, tokenizer = load_model_and_tokenizer(path, device="cpu")
    prompt = torch.tensor([chat_prompt_ids(tokenizer, messages, **template_kwargs)])
    output = model.generate(
        prompt,
        attention_mask=torch.ones_like(prompt),
        do_sample=False,
        max_new_tokens=max_new_tokens,
        pad_token_id=tokenizer.pad_token_id,
    )
    return tokenizer.decode(output[0, prompt.shape[1] :], skip_special_tokens=True)


def test_stream_reply_ends_with_the_greedy_reply(chat_model_dir):
    model, tokenizer = load_model_and_tokenizer(chat_model_dir, device="cpu")
    messages = [{"role": "user", "content": "hello"}]
    views = list(stream_reply(model, tokenizer, messages, SamplingParams(max_new_tokens=12, do_sample=False)))
    expected = greedy_reply(chat_model_dir, messages, 12)
    assert expected.strip() and "<think>" not in expected
    assert len(views) > 2  # streamed: the page is updated while tokens arrive
    assert views[-1] == [{"role": "assistant", "content": expected.strip()}]
    # Every update extends the one before it.
    texts = [view[0]["content"] for view in views]
    assert all(later.startswith(earlier) for earlier, later in zip(texts, texts[1:]))


def test_no_thinking_answers_after_empty_think(chat_model_dir):
    """stream_reply without thinking answers after an empty think block."""
    model, tokenizer = load_model_and_tokenizer(chat_model_dir, device="cpu")
    messages = [{"role": "user", "content": "hello"}]
    greedy = SamplingParams(max_new_tokens=12, do_sample=False)
    direct = list(stream_reply(model, tokenizer, messages, greedy, enable_thinking=False))[-1]
    expected = greedy_reply(chat_model_dir, messages, 12, enable_thinking=False)
    assert direct == [{"role": "assistant", "content": expected.strip()}]
    assert expected != greedy_reply(chat_model_dir, messages, 12)  # the prompt did change


def test_stream_reply_refuses_a_full_context(chat_model_dir):
    """stream_reply refuses a conversation that fills the context."""
    model, tokenizer = load_model_and_tokenizer(chat_model_dir, device="cpu")
    messages = [{"role": "user", "content": "hello " * model.config.max_position_embeddings}]
    with pytest.raises(ValueError, match=r"fills the model's 256-token context"):
        next(stream_reply(model, tokenizer, messages, SamplingParams(max_new_tokens=4, do_sample=False)))


def scripted_model_dir(path, reply: list[int], after: int):
    """A model directory whose greedy reply to any chat prompt is `reply` (token ids), whatever came before.

    Attention and MLP outputs are zeroed, so the last hidden state is the current token's embedding alone; each
    token of the chain `after, *reply` gets its own embedding axis, and the output head maps that axis to the next
    token of the chain. `after` is the last prompt token (the newline of the assistant header)."""
    chain = [after, *reply]
    assert len(set(chain)) == len(chain), "a token twice in the chain would have two successors"
    model = tiny_model(vocab_size=6400, tie_word_embeddings=False)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.model.embed_tokens.weight.zero_()
        model.lm_head.weight.zero_()
        for axis, (token, successor) in enumerate(zip(chain, chain[1:])):
            model.model.embed_tokens.weight[token, axis] = 1.0
            model.lm_head.weight[successor, axis] = 1.0
    model.save_pretrained(path)
    for name in TOKENIZER_FILES:
        shutil.copy(os.path.join(TOKENIZER_DIR, name), path)


REASONING, ANSWER = "Let me see", "Hello!"


@pytest.fixture(scope="module")
def thinking_model_dir(tmp_path_factory):
    from minimind.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(TOKENIZER_DIR)
    encode = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    reply = [*encode("<think>"), *encode(REASONING), *encode("</think>"), *encode(ANSWER), tokenizer.eos_token_id]
    after = chat_prompt_ids(tokenizer, [{"role": "user", "content": "hi"}])[-1]
    path = tmp_path_factory.mktemp("web-thinking-model")
    scripted_model_dir(path, reply, after)
    return str(path)


def test_scripted_model_thinks_then_answers(thinking_model_dir):
    for messages in (
        [{"role": "user", "content": "hi"}],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What now?"}],
    ):
        assert greedy_reply(thinking_model_dir, messages, 32) == f"<think>{REASONING}</think>{ANSWER}"


# --------------------------------------------------------------------------------------------------------------
# The page in a browser
# --------------------------------------------------------------------------------------------------------------


def browser_missing():
    """Why the browser test cannot run here, or None."""
    for module in ("gradio", "playwright"):
        try:
            __import__(module)
        except ImportError:
            return f"{module} is not installed (pip install gradio playwright)"
    if not os.path.exists(CHROMIUM):
        return f"no browser at {CHROMIUM} (apt-get install chromium)"
    return None


def test_command_starts_page_with_its_flags(chat_model_dir, thinking_model_dir, monkeypatch, capsys):
    pytest.importorskip("gradio")
    import minimind.web

    launched = []
    monkeypatch.setattr(minimind.web, "launch", lambda app, host, port, auth: launched.append((app, host, port, auth)))
    app = load_script("web_demo").main(
        [
            "--model_name_or_path",
            chat_model_dir,
            "--model_name_or_path",
            thinking_model_dir,
            "--port",
            "7999",
            "--temperature",
            "0",
            "--top_p",
            "0.8",
            "--max_new_tokens",
            "33",
            "--system_prompt",
            "Be brief.",
            "--no-enable_thinking",
            "--auth",
            "me:pass:word",
        ]
    )
    assert launched == [(app, "127.0.0.1", 7999, ("me", "pass:word"))]
    values = {block.label: block.value for block in app.blocks.values() if getattr(block, "label", None)}
    assert {
        label: values[label]
        for label in ("Model", "System prompt", "Let the model think", "Temperature", "Top-p", "Max new tokens")
    } == {
        "Model": "web-model0",
        "System prompt": "Be brief.",
        "Let the model think": False,
        "Temperature": 0,
        "Top-p": 0.8,
        "Max new tokens": 33,
    }
    model_box = next(block for block in app.blocks.values() if getattr(block, "label", None) == "Model")
    assert [value for _, value in model_box.choices] == ["web-model0", "web-thinking-model0"]
    assert "warning" not in capsys.readouterr().err  # loopback: no warning


@pytest.mark.parametrize("flags, notice", [([], True), (["--int8"], True), (["--no-compile"], False)])
def test_command_says_how_its_decode_step_compiles(chat_model_dir, monkeypatch, capsys, flags, notice):
    """The web command says once that the decode step compiles (int8 weights too: their step is packaged);
    nothing with --no-compile."""
    pytest.importorskip("gradio")
    if "--int8" in flags:
        pytest.importorskip("torchao")
    import minimind.web
    from conftest import decode_uncompiled
    from minimind.cli.generate import COMPILE_NOTICE

    decode_uncompiled(monkeypatch)
    monkeypatch.setattr(minimind.web, "launch", lambda app, host, port, auth: None)
    load_script("web_demo").main(["--model_name_or_path", chat_model_dir, *flags])
    assert capsys.readouterr().err.count(COMPILE_NOTICE) == (1 if notice else 0)


@pytest.mark.parametrize("auth, warned", [(None, True), ("me:secret", False)])
def test_open_host_without_auth_warns(chat_model_dir, monkeypatch, capsys, auth, warned):
    """The web command on an open host warns when no auth is set."""
    pytest.importorskip("gradio")
    import minimind.web

    monkeypatch.setattr(minimind.web, "launch", lambda app, host, port, auth: None)
    load_script("web_demo").main(
        [
            "--model_name_or_path",
            chat_model_dir,
            "--host",
            "0.0.0.0",
            "--no-compile",
            *(["--auth", auth] if auth else []),
        ]
    )
    warning = (
        "warning: the page is served on 0.0.0.0:7860 without --auth: anyone who can reach this port can chat "
        "with the model; pass --auth USER:PASSWORD"
    )
    warnings = [line for line in capsys.readouterr().err.splitlines() if "warning" in line]
    assert warnings == ([warning] if warned else [])


@pytest.mark.parametrize("auth", ["me", "me:", ":secret"])
def test_auth_needs_user_and_password(chat_model_dir, capsys, auth):
    """The web command refuses an auth without both user and password."""
    with pytest.raises(SystemExit) as exited:
        load_script("web_demo").main(["--model_name_or_path", chat_model_dir, "--auth", auth])
    assert exited.value.code == 2
    assert capsys.readouterr().err.endswith("error: --auth takes USER:PASSWORD, both non-empty\n")


def test_endpoints_refuse_paths_and_run_no_code(chat_model_dir, tmp_path):
    """The page's endpoints refuse any path and run no code from it."""
    pytest.importorskip("gradio")
    from gradio_client import Client

    from conftest import plant_code_dir
    from minimind.web import build_app

    marker = plant_code_dir(tmp_path / "planted")
    app = build_app([chat_model_dir])
    app.queue().launch(server_name="127.0.0.1", server_port=free_port(), prevent_thread_lock=True, quiet=True)
    try:
        client = Client(app.local_url, verbose=False)
        assert client.predict("web-model0", api_name="/load").startswith("Loaded `web-model0`: ")
        for path in (str(tmp_path / "planted"), chat_model_dir, "../../etc", "someone/model"):
            with pytest.raises(Exception) as refused:
                client.predict(path, api_name="/load")
            assert f"Value: {path} is not in the list of choices: ['web-model0']" in str(refused.value)
            with pytest.raises(Exception) as refused:
                client.predict("hi", path, "", True, 0, 1, 4, api_name="/respond")
            assert f"Value: {path} is not in the list of choices: ['web-model0']" in str(refused.value)
    finally:
        app.close()
    assert not marker.exists()


def test_load_failure_names_no_server_path(chat_model_dir, thinking_model_dir, tmp_path, caplog):
    """When a model cannot be loaded, the page names no path on the server."""
    from minimind.web import LoadedModel, UnknownModel, model_choices

    copy = tmp_path / "copy"
    shutil.copytree(thinking_model_dir, copy)
    loaded = LoadedModel(model_choices([chat_model_dir, str(copy)]), device="cpu")
    assert list(loaded.choices) == ["web-model0", "copy"]
    with pytest.raises(UnknownModel) as unknown:
        loaded.get(str(copy))  # a path is no name, even one of the page's own
    assert loaded.visitor_message(str(copy), unknown.value) == "Unknown model: choose one from the list."
    (copy / "model.safetensors").unlink()  # gone after the page started
    with pytest.raises(Exception) as failed:
        loaded.get("copy")
    assert loaded.visitor_message("copy", failed.value) == "Could not load `copy`; the server's log says why."
    assert f"{copy} holds no weights" in caplog.text  # the cause is in the server's log


def free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_page(model_path, port, log_path, *extra_args):
    """`scripts/web_demo.py` in its own process, its output into `log_path`; returns it once the page answers. A file,
    not a pipe: nobody reads a pipe while the browser waits, and a page blocked on a full pipe would never reply."""
    import urllib.request

    env = {**os.environ, "GRADIO_ANALYTICS_ENABLED": "False", "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
    log = open(log_path, "w")
    process = subprocess.Popen(
        [
            sys.executable,
            os.path.join(ROOT, "scripts", "web_demo.py"),
            "--model_name_or_path",
            model_path,
            "--port",
            str(port),
            "--device",
            "cpu",
            *extra_args,
        ],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    log.close()  # the child holds its own copy
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the page exited with {process.returncode}:\n{page_log(log_path)}")
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=2)
            return process
        except OSError:
            time.sleep(0.5)
    process.kill()
    raise RuntimeError(f"the page did not answer within 60 s:\n{page_log(log_path)}")


def page_log(log_path) -> str:
    with open(log_path, errors="replace") as log:
        return log.read()[-3000:]


def send(page, message, replies_before):
    """Type `message`, press Enter, and wait until the reply has finished streaming: the Retry button, shown
    under the last reply, appears only when it is complete."""
    box = page.get_by_label("Message", exact=True)
    box.fill(message)
    box.press("Enter")
    page.wait_for_function(
        """n => document.querySelectorAll('[data-testid=user]').length === n + 1
               && document.querySelector('button[aria-label=Retry]') !== null
               && document.querySelector('[data-testid=stop-button]') === null""",
        arg=replies_before,
        timeout=60_000,
    )


def bot_texts(page):
    return [element.inner_text() for element in page.query_selector_all("[data-testid=bot]")]


def assert_bot_texts(page, expected, timeout=5.0):
    """The bot messages' texts equal `expected` exactly, once the browser has drawn the last update."""
    deadline = time.monotonic() + timeout
    while bot_texts(page) != expected and time.monotonic() < deadline:
        time.sleep(0.1)
    assert bot_texts(page) == expected


@pytest.mark.skipif(browser_missing() is not None, reason=browser_missing() or "")
def test_browser_streams_and_folds_thinking(chat_model_dir, thinking_model_dir, tmp_path):
    """In a browser the page streams the greedy replies and folds the thinking."""
    from playwright.sync_api import expect, sync_playwright

    port, max_new_tokens, log_path = free_port(), 12, tmp_path / "page.log"
    process = start_page(
        chat_model_dir,
        port,
        log_path,
        # model.generate: the page's streaming and folding are what this checks; the compiled decoder's replies
        # equal generate's (tests/decode), and its two builds here would cost minutes on a CPU another worker loads
        "--no-compile",
        "--dtype",
        "float32",  # the replies are compared with float32 greedy ones
        "--max_new_tokens",
        str(max_new_tokens),  # temperature 0.7
        "--model_name_or_path",
        thinking_model_dir,
    )
    try:
        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
            page = browser.new_page(viewport={"width": 1280, "height": 760})
            page.goto(f"http://127.0.0.1:{port}/")
            temperature = page.get_by_label("number input for Temperature")
            temperature.fill("0")
            temperature.press("Tab")
            assert page.get_by_label("range slider for Temperature").input_value() == "0"

            send(page, "hello", 0)
            first = greedy_reply(chat_model_dir, [{"role": "user", "content": "hello"}], max_new_tokens)
            assert_bot_texts(page, [first.strip()])
            # The second reply answers the whole conversation as the page shows it: the first reply stripped.
            send(page, "and then?", 1)
            second = greedy_reply(
                chat_model_dir,
                [
                    {"role": "user", "content": "hello"},
                    {"role": "assistant", "content": first.strip()},
                    {"role": "user", "content": "and then?"},
                ],
                max_new_tokens,
            )
            assert second != first
            assert_bot_texts(page, [first.strip(), second.strip()])

            # The other model the page was started with, chosen by its name; the thinking model's reasoning comes
            # folded above its answer.
            page.get_by_role("combobox", name="Model").click()
            page.get_by_role("option", name="web-thinking-model0").click()
            page.get_by_text("Loaded web-thinking-model0:").wait_for(timeout=30_000)
            page.get_by_role("button", name="Clear").click()
            send(page, "What now?", 0)
            assert_bot_texts(page, [THINKING_TITLE, ANSWER])
            # Folded: Gradio closes the section once the finished reply marks it done.
            expect(page.get_by_text(REASONING, exact=True)).to_be_hidden(timeout=5_000)
            page.get_by_text(THINKING_TITLE, exact=True).click()
            page.get_by_text(REASONING, exact=True).wait_for(state="visible", timeout=5_000)
            # The thought goes back with the history (as reasoning_content) and the next reply is shown the same.
            send(page, "And then?", 1)
            # The first thought stays open as the user left it; the new one is folded.
            assert_bot_texts(page, [f"{THINKING_TITLE}\n\n{REASONING}", ANSWER, THINKING_TITLE, ANSWER])
            browser.close()
    except Exception as error:
        error.add_note(f"the page's output:\n{page_log(log_path)}")
        raise
    finally:
        process.terminate()
        process.wait(timeout=30)
