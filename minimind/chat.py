"""Load a MiniMind checkpoint and stream replies from it: the engine behind `scripts/chat.py` and the server.

`TextStream` runs `model.generate` in a background thread and yields decoded text as tokens arrive
(transformers' `TextIteratorStreamer`). It also cuts the text before a stop string, so the chat loop and
the OpenAI-compatible server share one generation path.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TextIO

import torch
from transformers import StoppingCriteria, StoppingCriteriaList, TextIteratorStreamer

from minimind import loading
from minimind.tokenizer import encode_conversation

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# What the inference commands' --dtype takes: a precision, or "auto" for the one picked for the device.
DTYPE_CHOICES = ("auto", *sorted(DTYPES))
# One reply length and one sampling default for the terminal chat, the web page and the server's requests.
DEFAULT_MAX_NEW_TOKENS = 512
CHAT_TEMPERATURE, CHAT_TOP_P = 0.7, 0.9


def reply_room(max_new_tokens: int, prompt_tokens: int, context: int) -> int:
    """`max_new_tokens` cut to the room the context leaves after the prompt; 0 when the prompt fills it."""
    return max(0, min(max_new_tokens, context - prompt_tokens))


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def load_model_and_tokenizer(
    model_name_or_path: str,
    device: str | None = None,
    dtype: str = "float32",
    int8: bool = False,
    announce: Callable[[str], None] | None = None,
):
    """The model (eval mode, on `device`) and its tokenizer from one MiniMind directory or Hub id, checked and
    loaded with the installed classes (`minimind.loading`). `dtype` "auto": the precision picked for the device
    (`minimind.hardware.pick_dtype`). `int8`: the decoder layers' and the LM head's weights in int8
    (`minimind.decode.quantize_weights_int8`), the rest in `dtype`; where that says float32 or auto, in bfloat16,
    or in float32 on a CPU without bfloat16 arithmetic (`minimind.decode.int8_activations_dtype`). On a
    CPU without arithmetic of its own for the 16-bit weights, prompts are multiplied in float32
    (`minimind.decode.widen_products`). `announce` gets one line saying the precision and the arithmetic."""
    from minimind.decode.int8 import int8_activations_dtype
    from minimind.hardware import pick_dtype

    device = device or default_device()
    why = ""
    if int8 and dtype in ("auto", "float32"):
        dtype = int8_activations_dtype(device)
        why = "this CPU has no bfloat16 arithmetic" if dtype == "float32" else ""
    elif dtype == "auto":
        dtype, why = pick_dtype(device)
    directory = loading.model_directory(model_name_or_path)
    model = loading.load_model(directory, dtype=DTYPES[dtype])
    tokenizer = loading.load_tokenizer(directory)
    model = model.to(device).eval()
    widened = 0
    if int8 or DTYPES[dtype] != torch.float32:
        from minimind.decode import quantize_weights_int8, widen_products

        if int8:
            quantize_weights_int8(model)
        widened = widen_products(model)
    if announce is not None:
        announce(precision_line(dtype, int8, widened, why))
    return model, tokenizer


def precision_line(dtype: str, int8: bool, widened: int, why: str = "") -> str:
    """What `load_model_and_tokenizer` says it loaded: the weights' precision, where prompts are multiplied in
    float32, and why the precision was picked (`--dtype auto`)."""
    line = f"precision: {'int8 decoder weights, the rest in ' if int8 else ''}{dtype}"
    if widened:
        line += f"; prompts multiplied in float32 (this CPU has no {dtype} arithmetic of its own)"
    return line + (f" ({why})" if why else "")


def chat_prompt_ids(tokenizer, messages: list[dict], tools: list[dict] | None = None, **template_kwargs) -> list[int]:
    """Token ids of `messages` rendered with the chat template, ending with the assistant header.

    Special tokens inside message text are tokenised as text (see `encode_conversation`); `template_kwargs`
    reach the template, e.g. `enable_thinking=False`.
    """
    return encode_conversation(tokenizer, messages, tools, add_generation_prompt=True, **template_kwargs).input_ids


THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


def split_reasoning(text: str, *, started_in_reasoning: bool = False) -> tuple[str | None, str]:
    """Split a generated reply into (reasoning, answer) at its ``<think>...</think>`` block.

    reasoning is None when the reply has no think block ("" for an empty one, which is what
    ``enable_thinking=False`` puts in the prompt).  A reply that starts inside the block (its prompt ended
    with ``<think>``) is recognised by a ``</think>`` with no ``<think>`` before it; when such a reply has not
    reached ``</think>`` yet, only the caller knows, so it passes ``started_in_reasoning=True``.  An unclosed
    block (generation stopped while thinking) is all reasoning.  The newlines the chat template puts around
    the reasoning and before the answer are removed, so a rendered ``reasoning_content`` comes back as given.
    """
    open_at, close_at = text.find(THINK_OPEN), text.find(THINK_CLOSE)
    if close_at >= 0 and (open_at < 0 or close_at < open_at):
        reasoning, answer = text[:close_at], text[close_at + len(THINK_CLOSE) :]
    elif open_at >= 0:
        if text[:open_at].strip():
            # Text before <think> is not how the template places reasoning: leave the reply as it is.
            return None, text
        rest = text[open_at + len(THINK_OPEN) :]
        reasoning, found, answer = rest.partition(THINK_CLOSE)
        if not found:
            return reasoning.strip("\n"), ""
    elif started_in_reasoning:
        return text.strip("\n"), ""
    else:
        return None, text
    return reasoning.strip("\n"), answer.lstrip("\n")


@dataclass
class SamplingParams:
    """What a caller may choose per request; `temperature == 0` or `do_sample=False` means greedy."""

    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    do_sample: bool = True
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = no top-k filter
    stop: list[str] = field(default_factory=list)

    @property
    def greedy(self) -> bool:
        return not self.do_sample or self.temperature <= 0

    def generate_kwargs(self, tokenizer) -> dict:
        kwargs = dict(
            max_new_tokens=self.max_new_tokens,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
        )
        if not self.greedy:
            kwargs.update(do_sample=True, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k or None)
        else:
            # Explicit neutral values: otherwise a checkpoint's sampling defaults trigger "not used" warnings.
            kwargs.update(do_sample=False, temperature=None, top_p=None, top_k=None)
        return kwargs


class _StopStringGenerated(StoppingCriteria):
    r"""Ends generation once the generated text contains a stop string.

    Not transformers' `stop_strings`: that matches the end of prompt + generation, so a prompt ending in "\n"
    plus two generated "\n" already stops on "\n\n\n". Decoding only the new tokens matches exactly the text
    the caller sees; the cost is small next to a forward pass at this model size.
    """

    def __init__(self, tokenizer, stops: list[str], prompt_length: int):
        self.tokenizer, self.stops, self.prompt_length = tokenizer, stops, prompt_length

    def __call__(self, input_ids, scores, **kwargs):
        texts = self.tokenizer.batch_decode(input_ids[:, self.prompt_length :], skip_special_tokens=True)
        return torch.tensor([any(stop in text for stop in self.stops) for text in texts], device=input_ids.device)


class _Cancelled(StoppingCriteria):
    """Ends generation when the consumer goes away (a closed HTTP stream, an exception in the loop)."""

    def __init__(self, event: threading.Event):
        self.event = event

    def __call__(self, input_ids, scores, **kwargs):
        return torch.full((input_ids.shape[0],), self.event.is_set(), dtype=torch.bool, device=input_ids.device)


class StopStringCutter:
    """Cuts streamed text before the first stop string: `feed` each piece and send on what it returns, then
    `finish()` once the pieces end. A tail that could be the start of a stop string is held back until the next
    piece decides; once `hit` is set the stop string was found and everything after it is dropped."""

    def __init__(self, stops: list[str]):
        self.stops = [stop for stop in stops if stop]
        self.hold_back = max((len(stop) for stop in self.stops), default=1) - 1
        self.text, self.emitted, self.hit = "", 0, False

    def feed(self, piece: str) -> str:
        if self.hit:
            return ""
        self.text += piece
        cut = min((i for i in (self.text.find(stop) for stop in self.stops) if i >= 0), default=-1)
        end = cut if cut >= 0 else len(self.text) - self.hold_back
        self.hit = cut >= 0
        return self._emit_until(end)

    def finish(self) -> str:
        return "" if self.hit else self._emit_until(len(self.text))

    def _emit_until(self, end: int) -> str:
        if end <= self.emitted:
            return ""
        out, self.emitted = self.text[self.emitted : end], end
        return out


class TextStream:
    """Iterate to get the reply to `prompt_ids` as text pieces, streamed while `model.generate` runs.

    After iteration: `completion_tokens` (tokens the model generated, a stop string's included) and
    `finish_reason` ("stop" for EOS or a stop string, "length" when `max_new_tokens` ran out).
    Text never contains a stop string or anything after it; a piece that could be the start of a stop
    string is held back until the next tokens decide.
    """

    def __init__(self, model, tokenizer, prompt_ids: list[int], params: SamplingParams, decoder=None):
        self.model, self.tokenizer, self.prompt_ids, self.params = model, tokenizer, prompt_ids, params
        # A `minimind.decode.CompiledDecoder` of `model` takes generate's place: same arguments, same ids out.
        self._generate = (decoder or model).generate
        self.completion_tokens = 0
        self.finish_reason: str | None = None
        self._hit_stop_string = False
        self._stops = [stop for stop in params.stop if stop]

    def __iter__(self):
        streamer = TextIteratorStreamer(self.tokenizer, skip_prompt=True, skip_special_tokens=True)
        cancel = threading.Event()
        outcome = {}
        input_ids = torch.tensor([self.prompt_ids], device=self.model.device)

        def generate():
            try:
                outcome["ids"] = self._generate(
                    input_ids,
                    attention_mask=torch.ones_like(input_ids),
                    streamer=streamer,
                    stopping_criteria=self._stopping_criteria(cancel),
                    **self.params.generate_kwargs(self.tokenizer),
                )
            except BaseException as error:  # re-raised in the consumer's thread
                outcome["error"] = error
                streamer.end()  # unblocks the consumer

        worker = threading.Thread(target=generate, daemon=True)
        worker.start()
        try:
            yield from self._cut_at_stop_strings(streamer)
        finally:
            cancel.set()
            # An abandoned stream may be finalised by the garbage collector in any thread, this one included.
            if worker is not threading.current_thread():
                worker.join()
        if "error" in outcome:
            raise outcome["error"]
        self._record_outcome(outcome["ids"][0, len(self.prompt_ids) :].tolist())

    def _stopping_criteria(self, cancel):
        criteria = StoppingCriteriaList([_Cancelled(cancel)])
        if self._stops:
            criteria.append(_StopStringGenerated(self.tokenizer, self._stops, len(self.prompt_ids)))
        return criteria

    def _cut_at_stop_strings(self, pieces):
        cutter = StopStringCutter(self._stops)
        for piece in pieces:
            if text := cutter.feed(piece):
                yield text
            if cutter.hit:
                self._hit_stop_string = True
                return
        if text := cutter.finish():
            yield text

    def _record_outcome(self, new_ids: list[int]):
        self.completion_tokens = len(new_ids)  # a batch of one is never padded
        ended_itself = self._hit_stop_string or (new_ids and new_ids[-1] == self.tokenizer.eos_token_id)
        ran_out = len(new_ids) >= self.params.max_new_tokens
        self.finish_reason = "length" if ran_out and not ended_itself else "stop"


def chat_loop(
    model,
    tokenizer,
    params: SamplingParams,
    system_prompt: str | None = None,
    read_line: Callable[[str], str] = input,
    out: TextIO = sys.stdout,
    enable_thinking: bool = True,
    decoder=None,
) -> None:
    """Multi-turn chat on a plain terminal: `/reset` forgets the conversation; `/exit`, end of input (Ctrl-D) or
    Ctrl-C at the prompt quit; Ctrl-C during a reply stops that reply.

    A reply's reasoning (its `<think>` block) is shown apart from the answer: after "(thinking) ", dimmed on a
    terminal. `enable_thinking=False` asks the model to answer without reasoning (the template's empty think
    block). `decoder` (a `minimind.decode.CompiledDecoder`) replaces `model.generate`. `read_line` and `out` are
    injectable so tests can drive the loop without a terminal.
    """
    history = _fresh_history(system_prompt)
    context = model.config.max_position_embeddings
    print("MiniMind chat. /reset starts a new conversation, /exit (or Ctrl-D) quits.", file=out, flush=True)
    while True:
        try:
            line = read_line("\n>>> ").strip()
        except (EOFError, KeyboardInterrupt):  # Ctrl-D / Ctrl-C at the prompt quit
            print(file=out, flush=True)
            return
        if line == "/exit":
            return
        if line == "/reset":
            history = _fresh_history(system_prompt)
            print("(conversation reset)", file=out, flush=True)
            continue
        if not line:
            continue
        history.append({"role": "user", "content": line})
        # Keep room for a reply, but never more than half the context: a huge max_new_tokens must not make
        # every message "too long".
        prompt_ids = _fit_to_context(
            tokenizer, history, context - min(params.max_new_tokens, context // 2), enable_thinking=enable_thinking
        )
        if prompt_ids is None:
            history.pop()
            print(f"(message too long for the {context}-token context)", file=out, flush=True)
            continue
        turn_params = replace(params, max_new_tokens=reply_room(params.max_new_tokens, len(prompt_ids), context))
        printer, interrupted = _ReplyPrinter(out), False
        try:
            for piece in TextStream(model, tokenizer, prompt_ids, turn_params, decoder=decoder):
                printer.feed(piece)
        except KeyboardInterrupt:  # Ctrl-C during a reply stops it; the partial reply stays in the history
            interrupted = True
        printer.finish()
        print(" (interrupted)" if interrupted else "", file=out, flush=True)
        reasoning, answer = split_reasoning(printer.text)
        message = {"role": "assistant", "content": answer}
        if reasoning is not None:
            message["reasoning_content"] = reasoning
        history.append(message)


class _ReplyPrinter:
    """Prints a streamed reply with its reasoning apart from the answer.

    Each piece is appended to the reply so far, which is split again with `split_reasoning`; what is new in
    the reasoning and in the answer gets printed. The end of the text that could still grow into "<think>" or
    "</think>" waits for the next piece, so a tag cut between pieces is never shown as answer text.
    """

    THINKING = "(thinking) "

    def __init__(self, out: TextIO):
        self.out, self.text = out, ""
        self.dim = out.isatty()
        self._reasoning_shown = self._answer_shown = 0
        self._in_reasoning = False

    def feed(self, piece: str) -> None:
        self.text += piece
        self._show(_without_partial_tag(self.text))

    def finish(self) -> None:
        self._show(self.text)
        self._end_reasoning()

    def _show(self, text: str) -> None:
        if not text.strip():
            return  # leading whitespace may still turn out to come before "<think>"
        reasoning, answer = split_reasoning(text)
        if reasoning is not None and len(reasoning) > self._reasoning_shown:
            if not self._in_reasoning and self._reasoning_shown == 0:
                self._write(("\x1b[2m" if self.dim else "") + self.THINKING)
                self._in_reasoning = True
            self._write(reasoning[self._reasoning_shown :])
            self._reasoning_shown = len(reasoning)
        if len(answer) > self._answer_shown:
            self._end_reasoning()
            self._write(answer[self._answer_shown :])
            self._answer_shown = len(answer)

    def _end_reasoning(self) -> None:
        if self._in_reasoning:
            self._write(("\x1b[0m" if self.dim else "") + "\n")
            self._in_reasoning = False

    def _write(self, text: str) -> None:
        print(text, end="", file=self.out, flush=True)


def _without_partial_tag(text: str) -> str:
    for tag in (THINK_OPEN, THINK_CLOSE):
        for length in range(len(tag) - 1, 0, -1):
            if text.endswith(tag[:length]):
                return text[:-length]
    return text


def _fresh_history(system_prompt):
    return [{"role": "system", "content": system_prompt}] if system_prompt else []


def _fit_to_context(tokenizer, history: list[dict], budget: int, **template_kwargs) -> list[int] | None:
    """Prompt ids for `history`, forgetting the oldest user/assistant exchanges (never the system prompt or the
    new message) until the prompt fits in `budget` tokens; None if even the new message alone does not fit.
    Edits `history`."""
    first_turn = 1 if history and history[0]["role"] == "system" else 0
    while True:
        ids = chat_prompt_ids(tokenizer, history, **template_kwargs)
        if len(ids) <= budget:
            return ids
        if len(history) - first_turn <= 1:
            return None
        del history[first_turn : first_turn + 2]  # a user message and its reply: the rest still starts with "user"
