"""Load a MiniMind checkpoint and stream replies from it: the engine behind `scripts/chat.py` and the server.

`TextStream` runs `model.generate` in a background thread and yields decoded text as tokens arrive
(transformers' `TextIteratorStreamer`). It also cuts the text before a stop string, so the chat loop and
the OpenAI-compatible server share one generation path.
"""

from __future__ import annotations

import sys
import threading
from dataclasses import dataclass, field, replace
from typing import Callable, TextIO

import torch
from transformers import (AutoModelForCausalLM, AutoTokenizer, StoppingCriteria, StoppingCriteriaList,
                          TextIteratorStreamer)

import minimind  # noqa: F401  (registers MiniMind with the Auto classes, so local dirs load without remote code)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def load_model_and_tokenizer(model_name_or_path: str, device: str | None = None, dtype: str = "float32"):
    """The model (eval mode, on `device`) and its tokenizer from one directory or Hub id."""
    tokenizer = AutoTokenizer.from_pretrained(model_name_or_path)
    model = AutoModelForCausalLM.from_pretrained(model_name_or_path, dtype=DTYPES[dtype], trust_remote_code=True)
    return model.to(device or default_device()).eval(), tokenizer


def chat_prompt_ids(tokenizer, messages: list[dict]) -> list[int]:
    """Token ids of `messages` rendered with the chat template, ending with the assistant header."""
    encoded = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)
    return list(encoded["input_ids"])


@dataclass
class SamplingParams:
    """What a caller may choose per request; `temperature == 0` or `do_sample=False` means greedy."""

    max_new_tokens: int = 256
    do_sample: bool = True
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = no top-k filter
    stop: list[str] = field(default_factory=list)

    def generate_kwargs(self, tokenizer) -> dict:
        kwargs = dict(max_new_tokens=self.max_new_tokens, pad_token_id=tokenizer.pad_token_id,
                      eos_token_id=tokenizer.eos_token_id)
        if self.do_sample and self.temperature > 0:
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
        texts = self.tokenizer.batch_decode(input_ids[:, self.prompt_length:], skip_special_tokens=True)
        return torch.tensor([any(stop in text for stop in self.stops) for text in texts], device=input_ids.device)


class _Cancelled(StoppingCriteria):
    """Ends generation when the consumer goes away (a closed HTTP stream, an exception in the loop)."""

    def __init__(self, event: threading.Event):
        self.event = event

    def __call__(self, input_ids, scores, **kwargs):
        return torch.full((input_ids.shape[0],), self.event.is_set(), dtype=torch.bool, device=input_ids.device)


class TextStream:
    """Iterate to get the reply to `prompt_ids` as text pieces, streamed while `model.generate` runs.

    After iteration: `completion_tokens` (tokens the model generated, a stop string's included) and
    `finish_reason` ("stop" for EOS or a stop string, "length" when `max_new_tokens` ran out).
    Text never contains a stop string or anything after it; a piece that could be the start of a stop
    string is held back until the next tokens decide.
    """

    def __init__(self, model, tokenizer, prompt_ids: list[int], params: SamplingParams):
        self.model, self.tokenizer, self.prompt_ids, self.params = model, tokenizer, prompt_ids, params
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
                outcome["ids"] = self.model.generate(
                    input_ids, attention_mask=torch.ones_like(input_ids), streamer=streamer,
                    stopping_criteria=self._stopping_criteria(cancel),
                    **self.params.generate_kwargs(self.tokenizer))
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
        self._record_outcome(outcome["ids"][0, len(self.prompt_ids):].tolist())

    def _stopping_criteria(self, cancel):
        criteria = StoppingCriteriaList([_Cancelled(cancel)])
        if self._stops:
            criteria.append(_StopStringGenerated(self.tokenizer, self._stops, len(self.prompt_ids)))
        return criteria

    def _cut_at_stop_strings(self, pieces):
        stops = self._stops
        hold_back = max((len(s) for s in stops), default=1) - 1
        text, emitted = "", 0
        for piece in pieces:
            text += piece
            cut = min((i for i in (text.find(s) for s in stops) if i >= 0), default=-1)
            if cut >= 0:
                self._hit_stop_string = True
                if cut > emitted:
                    yield text[emitted:cut]
                return
            safe_end = len(text) - hold_back
            if safe_end > emitted:
                yield text[emitted:safe_end]
                emitted = safe_end
        if len(text) > emitted:
            yield text[emitted:]

    def _record_outcome(self, new_ids: list[int]):
        self.completion_tokens = len(new_ids)  # a batch of one is never padded
        ended_itself = self._hit_stop_string or (new_ids and new_ids[-1] == self.tokenizer.eos_token_id)
        ran_out = len(new_ids) >= self.params.max_new_tokens
        self.finish_reason = "length" if ran_out and not ended_itself else "stop"


def chat_loop(model, tokenizer, params: SamplingParams, system_prompt: str | None = None,
              read_line: Callable[[str], str] = input, out: TextIO = sys.stdout) -> None:
    """Multi-turn chat on a plain terminal: `/reset` forgets the conversation; `/exit`, end of input (Ctrl-D) or
    Ctrl-C at the prompt quit; Ctrl-C during a reply stops that reply.

    `read_line` and `out` are injectable so tests can drive the loop without a terminal.
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
        prompt_ids = _fit_to_context(tokenizer, history, context - min(params.max_new_tokens, context // 2))
        if prompt_ids is None:
            history.pop()
            print(f"(message too long for the {context}-token context)", file=out, flush=True)
            continue
        turn_params = replace(params, max_new_tokens=min(params.max_new_tokens, context - len(prompt_ids)))
        reply = []
        try:
            for piece in TextStream(model, tokenizer, prompt_ids, turn_params):
                reply.append(piece)
                print(piece, end="", file=out, flush=True)
        except KeyboardInterrupt:  # Ctrl-C during a reply stops it; the partial reply stays in the history
            print(" (interrupted)", end="", file=out)
        print(file=out, flush=True)
        history.append({"role": "assistant", "content": "".join(reply)})


def _fresh_history(system_prompt):
    return [{"role": "system", "content": system_prompt}] if system_prompt else []


def _fit_to_context(tokenizer, history: list[dict], budget: int) -> list[int] | None:
    """Prompt ids for `history`, forgetting the oldest user/assistant exchanges (never the system prompt or the
    new message) until the prompt fits in `budget` tokens; None if even the new message alone does not fit.
    Edits `history`."""
    first_turn = 1 if history and history[0]["role"] == "system" else 0
    while True:
        ids = chat_prompt_ids(tokenizer, history)
        if len(ids) <= budget:
            return ids
        if len(history) - first_turn <= 1:
            return None
        del history[first_turn:first_turn + 2]  # a user message and its reply: the rest still starts with "user"
