"""A chat page in the browser for a MiniMind checkpoint: the engine behind `minimind-web` (Gradio).

The page is a `gr.ChatInterface` with the sampling controls, a system prompt and a choice among the models the
command was started with beside it. A visitor picks a model by its name on the page and never types a path: no
input from the page reaches a loader, and messages shown on the page name no file.
Replies stream through the same `TextStream` as the terminal chat and the server; a reply's
``<think>...</think>`` block is shown as a folded "Thinking" section above the answer. Gradio is an optional
dependency (`pip install "minimind[web]"`): it is imported only when a page is built, so the message helpers here
work without it.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import replace

from minimind import loading
from minimind.chat import (
    CHAT_TEMPERATURE,
    CHAT_TOP_P,
    SamplingParams,
    TextStream,
    chat_prompt_ids,
    load_model_and_tokenizer,
    reply_room,
    split_reasoning,
)
from minimind.decode import CompiledDecoder
from minimind.errors import InputError

THINKING_TITLE = "Thinking"
logger = logging.getLogger(__name__)


def _announce(line: str) -> None:
    import sys

    print(line, file=sys.stderr, flush=True)


def reply_messages(text: str, finished: bool = True) -> list[dict]:
    """The chat messages that show one reply, complete or still streaming: its reasoning as a thought (a folded
    section titled "Thinking"), then the answer. A reply without reasoning is a single message. Both texts are
    stripped of whitespace at their ends."""
    reasoning, answer = split_reasoning(text)
    # Whitespace at the ends (a tokenizer's words start with a space) is dropped explicitly: HTML would not show
    # it and Gradio sends the history back without it, so the conversation the model sees is the one shown.
    answer = answer.strip()
    if not reasoning or not reasoning.strip():  # None, or the empty block a template writes when thinking is off
        return [{"role": "assistant", "content": answer}]
    # "pending" keeps the section open with a spinner while the model is still thinking; "done" folds it.
    still_thinking = not finished and not answer
    thought = {
        "role": "assistant",
        "content": reasoning.strip(),
        "metadata": {"title": THINKING_TITLE, "status": "pending" if still_thinking else "done"},
    }
    return [thought, {"role": "assistant", "content": answer}] if answer else [thought]


def _text(content) -> str:
    # Gradio hands history content back as a list of typed parts ({"type": "text", "text": ...}).
    if isinstance(content, str):
        return content
    return "".join(part.get("text", "") for part in content if isinstance(part, dict))


def conversation(history: list[dict], message: str, system_prompt: str | None = None) -> list[dict]:
    """The messages to render with the chat template for `message` after the page's `history`. A thought shown
    on the page goes back as the `reasoning_content` of the answer after it, as the terminal chat keeps it (the
    template renders earlier reasoning, see docs/chat-format.md)."""
    messages = [{"role": "system", "content": system_prompt}] if system_prompt and system_prompt.strip() else []
    for entry in history:
        text = _text(entry["content"])
        if (entry.get("metadata") or {}).get("title"):
            # A reply that stopped while thinking has a thought and no answer after it.
            messages.append({"role": "assistant", "content": "", "reasoning_content": text})
        elif (
            entry["role"] == "assistant"
            and messages
            and "reasoning_content" in messages[-1]
            and not messages[-1]["content"]
        ):  # the answer after a thought
            messages[-1]["content"] = text
        else:
            messages.append({"role": entry["role"], "content": text})
    messages.append({"role": "user", "content": message})
    return messages


def model_choices(paths: list[str]) -> dict[str, str]:
    """The page's name for each model directory -> its path: the directory's name, with as many parent names as
    it takes to tell the directories apart. Every directory is checked here (a MiniMind checkpoint whose
    config.json matches its weights), so a bad one stops the command at start with one line."""
    directories = []
    for path in dict.fromkeys(paths):
        directory, _ = loading.check_model_directory(path)
        directories.append((path, directory.resolve()))
    for depth in range(1, max((len(resolved.parts) for _, resolved in directories), default=1) + 1):
        names = {path: "/".join(resolved.parts[-depth:]) for path, resolved in directories}
        if len(set(names.values())) == len(names):
            return {name: path for path, name in names.items()}
    raise InputError("the same model directory is named twice under different paths")


class UnknownModel(ValueError):
    """A model name the page was not started with."""


class LoadedModel:
    """The model the page chats with, one of `choices` (page name -> path), kept until the visitor picks another.
    One at a time, so switching models does not double the memory in use."""

    def __init__(
        self,
        choices: dict[str, str],
        device: str | None = None,
        dtype: str = "float32",
        compile: bool = False,
        int8: bool = False,
        compile_cache_dir=None,
    ):
        self.choices = choices
        self.device, self.dtype, self.compile, self.int8 = device, dtype, compile, int8
        self.compile_cache_dir = compile_cache_dir  # `CompiledDecoder.keep_steps`
        self.name = None
        self.model = self.tokenizer = self.decoder = None
        self._lock = threading.Lock()  # a load and a reply may arrive together from two browser events

    def get(self, name: str):
        if not isinstance(name, str) or name not in self.choices:
            raise UnknownModel("this page serves only the models in its list")
        with self._lock:
            if name != self.name:
                # the old model is freed before the new one loads
                self.model = self.tokenizer = self.decoder = self.name = None
                self.model, self.tokenizer = load_model_and_tokenizer(
                    self.choices[name], self.device, self.dtype, self.int8, announce=_announce
                )
                self.decoder = CompiledDecoder(self.model) if self.compile else None
                if self.decoder is not None:
                    # the step for a reply's first bucket, loaded (or compiled) now, the reply waiting for it
                    self.decoder.keep_steps(self.compile_cache_dir, announce=_announce)
                    self.decoder.prepare(1, 1, background=True)
                self.name = name
            return self.model, self.tokenizer, self.decoder

    def describe(self) -> str:
        parameters = sum(p.numel() for p in self.model.parameters())
        return f"Loaded `{self.name}`: {parameters:,} parameters, {self.model.dtype}, on {self.model.device}."

    def visitor_message(self, name, error: Exception) -> str:
        """What the page says when `name` cannot be loaded: no path and no detail, which go to the server's log."""
        if isinstance(error, UnknownModel):
            return "Unknown model: choose one from the list."
        logger.error("could not load the page's model %r from %s: %s", name, self.choices.get(name), error)
        return f"Could not load `{name}`; the server's log says why."


def stream_reply(
    model, tokenizer, messages: list[dict], params: SamplingParams, enable_thinking: bool = True, decoder=None
):
    """The page's view of the reply to `messages` after each streamed piece: lists of chat messages, the last
    one for the finished reply (its thinking folded). `enable_thinking=False` puts the template's empty think
    block in the prompt, so the model answers directly; `decoder` (a `CompiledDecoder`) replaces generate."""
    template_kwargs = {} if enable_thinking else {"enable_thinking": False}
    prompt_ids = chat_prompt_ids(tokenizer, messages, **template_kwargs)
    context = model.config.max_position_embeddings
    room = reply_room(params.max_new_tokens, len(prompt_ids), context)
    if room <= 0:
        raise ValueError(
            f"the conversation ({len(prompt_ids)} tokens) fills the model's {context}-token context: "
            "clear the chat to start anew"
        )
    params = replace(params, max_new_tokens=room)
    text = ""
    for piece in TextStream(model, tokenizer, prompt_ids, params, decoder=decoder):
        text += piece
        yield reply_messages(text, finished=False)
    yield reply_messages(text, finished=True)


def build_app(
    model_paths: str | list[str],
    *,
    device: str | None = None,
    dtype: str = "float32",
    defaults: SamplingParams | None = None,
    system_prompt: str | None = None,
    enable_thinking: bool = True,
    compile: bool = False,
    int8: bool = False,
    compile_cache_dir=None,
):
    """The chat page as a `gr.Blocks` that offers the models in `model_paths` (every one checked, the first
    loaded, so a bad path fails here, not on the first message). `compile`: replies through
    `minimind.decode.CompiledDecoder` (the command's default), which Gradio's one-reply-at-a-time queue keeps to
    one sequence; `int8`: int8 decoder weights (`minimind.chat.load_model_and_tokenizer`)."""
    try:
        import gradio as gr
    except ImportError as error:
        raise ImportError('the web chat needs Gradio: pip install "minimind[web]" (or pip install gradio)') from error

    defaults = defaults or SamplingParams(temperature=CHAT_TEMPERATURE, top_p=CHAT_TOP_P)
    choices = model_choices([model_paths] if isinstance(model_paths, str) else list(model_paths))
    loaded = LoadedModel(choices, device, dtype, compile, int8, compile_cache_dir)
    first = next(iter(choices))
    loaded.get(first)

    def load(name):
        try:
            loaded.get(name)
        except Exception as error:  # any loading failure is shown on the page; the server keeps running
            return loaded.visitor_message(name, error)
        return loaded.describe()

    def respond(message, history, name, system, thinking, temperature, top_p, max_new_tokens):
        try:
            model, tokenizer, decoder = loaded.get(name)
        except Exception as error:
            raise gr.Error(loaded.visitor_message(name, error)) from None
        params = SamplingParams(
            max_new_tokens=int(max_new_tokens),
            do_sample=temperature > 0,
            temperature=temperature,
            top_p=top_p,
            top_k=defaults.top_k,
        )
        try:
            yield from stream_reply(
                model,
                tokenizer,
                conversation(history, message, system),
                params,
                enable_thinking=thinking,
                decoder=decoder,
            )
        except ValueError as error:
            raise gr.Error(str(error)) from error

    with gr.Blocks(title="MiniMind chat") as app:
        with gr.Row():
            # The settings come first: ChatInterface takes already rendered inputs as they are and would put
            # unrendered ones in an accordion under the chat.
            with gr.Column(scale=1):
                model_box = gr.Dropdown(
                    choices=list(choices), value=first, label="Model", info="The models this page was started with"
                )
                status = gr.Markdown(loaded.describe())
                system_box = gr.Textbox(value=system_prompt or "", label="System prompt", lines=3)
                thinking = gr.Checkbox(
                    value=enable_thinking,
                    label="Let the model think",
                    info="Off: an empty think block in the prompt, so it answers directly",
                )
                temperature = gr.Slider(
                    0,
                    2,
                    value=defaults.temperature if defaults.do_sample else 0,
                    step=0.05,
                    label="Temperature",
                    info="0 = greedy",
                )
                top_p = gr.Slider(0.05, 1, value=defaults.top_p, step=0.05, label="Top-p")
                max_new_tokens = gr.Slider(1, 2048, value=defaults.max_new_tokens, step=1, label="Max new tokens")
            with gr.Column(scale=3):
                # A labelled message box (the label hidden) so the box can be found by name, as for the others.
                message_box = gr.Textbox(
                    label="Message",
                    show_label=False,
                    placeholder="Type a message...",
                    scale=7,
                    autofocus=True,
                    submit_btn=True,
                    stop_btn=True,
                )
                gr.ChatInterface(
                    respond,
                    chatbot=gr.Chatbot(label="MiniMind", height=520),
                    textbox=message_box,
                    additional_inputs=[model_box, system_box, thinking, temperature, top_p, max_new_tokens],
                )
        model_box.change(load, model_box, status)
    return app


def launch(app, host: str = "127.0.0.1", port: int = 7860, auth: tuple[str, str] | None = None):
    """Serve the page until interrupted; `auth`: (user, password) that Gradio's login page asks for. Only
    `gr.Error` messages reach the visitor (show_error off): other exceptions may name the server's files."""
    app.queue().launch(server_name=host, server_port=port, share=False, show_error=False, auth=auth)
