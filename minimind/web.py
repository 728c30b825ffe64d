"""A chat page in the browser for a MiniMind checkpoint: the engine behind `minimind-web` (Gradio).

The page is a `gr.ChatInterface` with the sampling controls, a system prompt and the model directory beside it.
Replies stream through the same `TextStream` as the terminal chat and the server; a reply's
``<think>...</think>`` block is shown as a folded "Thinking" section above the answer. Gradio is an optional
dependency (`pip install "minimind[web]"`): it is imported only when a page is built, so the message helpers here
work without it.
"""

from __future__ import annotations

import threading
from dataclasses import replace

from minimind.chat import SamplingParams, TextStream, chat_prompt_ids, load_model_and_tokenizer, split_reasoning
from minimind.decode import CompiledDecoder

THINKING_TITLE = "Thinking"


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
    thought = {"role": "assistant", "content": reasoning.strip(),
               "metadata": {"title": THINKING_TITLE, "status": "pending" if still_thinking else "done"}}
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
        elif entry["role"] == "assistant" and messages and "reasoning_content" in messages[-1] \
                and not messages[-1]["content"]:  # the answer after a thought
            messages[-1]["content"] = text
        else:
            messages.append({"role": entry["role"], "content": text})
    messages.append({"role": "user", "content": message})
    return messages


class LoadedModel:
    """The model the page chats with: the one in the directory named on the page, kept until another is named.
    One at a time, so switching models does not double the memory in use."""

    def __init__(self, device: str | None = None, dtype: str = "float32", compile: bool = False, int8: bool = False):
        self.device, self.dtype, self.compile, self.int8 = device, dtype, compile, int8
        self.path = None
        self.model = self.tokenizer = self.decoder = None
        self._lock = threading.Lock()  # a load and a reply may arrive together from two browser events

    def get(self, path: str):
        path = path.strip()
        with self._lock:
            if path != self.path:
                # the old model is freed before the new one loads
                self.model = self.tokenizer = self.decoder = self.path = None
                self.model, self.tokenizer = load_model_and_tokenizer(path, self.device, self.dtype, self.int8)
                self.decoder = CompiledDecoder(self.model) if self.compile else None
                self.path = path
            return self.model, self.tokenizer, self.decoder

    def describe(self) -> str:
        parameters = sum(p.numel() for p in self.model.parameters())
        return f"Loaded `{self.path}`: {parameters:,} parameters, {self.model.dtype}, on {self.model.device}."


def stream_reply(model, tokenizer, messages: list[dict], params: SamplingParams, enable_thinking: bool = True,
                 decoder=None):
    """The page's view of the reply to `messages` after each streamed piece: lists of chat messages, the last
    one for the finished reply (its thinking folded). `enable_thinking=False` puts the template's empty think
    block in the prompt, so the model answers directly; `decoder` (a `CompiledDecoder`) replaces generate."""
    template_kwargs = {} if enable_thinking else {"enable_thinking": False}
    prompt_ids = chat_prompt_ids(tokenizer, messages, **template_kwargs)
    room = model.config.max_position_embeddings - len(prompt_ids)
    if room <= 0:
        raise ValueError(f"the conversation ({len(prompt_ids)} tokens) fills the model's "
                         f"{model.config.max_position_embeddings}-token context: clear the chat to start anew")
    params = replace(params, max_new_tokens=min(params.max_new_tokens, room))
    text = ""
    for piece in TextStream(model, tokenizer, prompt_ids, params, decoder=decoder):
        text += piece
        yield reply_messages(text, finished=False)
    yield reply_messages(text, finished=True)


def build_app(model_name_or_path: str, *, device: str | None = None, dtype: str = "float32",
              defaults: SamplingParams | None = None, system_prompt: str | None = None,
              enable_thinking: bool = True, compile: bool = False, int8: bool = False):
    """The chat page as a `gr.Blocks`, with the model in `model_name_or_path` loaded (so a bad path fails here,
    not on the first message). `compile`: replies through `minimind.decode.CompiledDecoder` (the command's
    default), which Gradio's one-reply-at-a-time queue keeps to one sequence; `int8`: int8 decoder weights
    (`minimind.chat.load_model_and_tokenizer`)."""
    try:
        import gradio as gr
    except ImportError as error:
        raise ImportError('the web chat needs Gradio: pip install "minimind[web]" (or pip install gradio)') from error

    defaults = defaults or SamplingParams(temperature=0.7, top_p=0.9, max_new_tokens=512)
    loaded = LoadedModel(device, dtype, compile, int8)
    loaded.get(model_name_or_path)

    def load(path):
        try:
            loaded.get(path)
        except Exception as error:  # any loading failure is shown on the page; the server keeps running
            return f"Could not load `{path.strip()}`: {error}"
        return loaded.describe()

    def respond(message, history, path, system, thinking, temperature, top_p, max_new_tokens):
        try:
            model, tokenizer, decoder = loaded.get(path)
        except Exception as error:
            raise gr.Error(f"Could not load {path.strip()!r}: {error}") from error
        params = SamplingParams(max_new_tokens=int(max_new_tokens), do_sample=temperature > 0,
                                temperature=temperature, top_p=top_p, top_k=defaults.top_k)
        try:
            yield from stream_reply(model, tokenizer, conversation(history, message, system), params,
                                    enable_thinking=thinking, decoder=decoder)
        except ValueError as error:
            raise gr.Error(str(error)) from error

    with gr.Blocks(title="MiniMind chat") as app:
        with gr.Row():
            # The settings come first: ChatInterface takes already rendered inputs as they are and would put
            # unrendered ones in an accordion under the chat.
            with gr.Column(scale=1):
                model_box = gr.Textbox(value=model_name_or_path, label="Model directory",
                                       info="Enter or leave the box to load another model")
                status = gr.Markdown(loaded.describe())
                system_box = gr.Textbox(value=system_prompt or "", label="System prompt", lines=3)
                thinking = gr.Checkbox(value=enable_thinking, label="Let the model think",
                                       info="Off: an empty think block in the prompt, so it answers directly")
                temperature = gr.Slider(0, 2, value=defaults.temperature if defaults.do_sample else 0, step=0.05,
                                        label="Temperature", info="0 = greedy")
                top_p = gr.Slider(0.05, 1, value=defaults.top_p, step=0.05, label="Top-p")
                max_new_tokens = gr.Slider(1, 2048, value=defaults.max_new_tokens, step=1, label="Max new tokens")
            with gr.Column(scale=3):
                # A labelled message box (the label hidden) so the box can be found by name, as for the others.
                message_box = gr.Textbox(label="Message", show_label=False, placeholder="Type a message...",
                                         scale=7, autofocus=True, submit_btn=True, stop_btn=True)
                gr.ChatInterface(respond, chatbot=gr.Chatbot(label="MiniMind", height=520), textbox=message_box,
                                 additional_inputs=[model_box, system_box, thinking, temperature, top_p,
                                                    max_new_tokens])
        # Not .change: that fires on every keystroke, loading each half-typed path.
        model_box.submit(load, model_box, status)
        model_box.blur(load, model_box, status)
    return app


def launch(app, host: str = "127.0.0.1", port: int = 7860):
    """Serve the page until interrupted."""
    app.queue().launch(server_name=host, server_port=port, share=False, show_error=True)
