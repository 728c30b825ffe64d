"""The server's detokenizer (`minimind.serving.generator._Detokenizer`): the text it streams, token by token, is the
text of the whole reply decoded at once. The deliveries from the engine's thread (`_Deliveries`): every output
arrives, in order, and the outputs posted together wake the event loop once; with a stream interval, a sequence's
outputs between its first and its last wait for the interval's end and go together."""

import asyncio
import threading
import time
from dataclasses import dataclass

import pytest
from transformers import AutoTokenizer

from conftest import TOKENIZER_DIR
from minimind.serving.generator import _Deliveries, _Detokenizer

TEXT = "你好，世界！ Hello, world. 🙂 Ünïcödé — tabs\tand\nlines<|im_end|> done ,"


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(TOKENIZER_DIR)


def stream(detokenizer, ids, group):
    pieces = []
    for start in range(0, len(ids), group):
        detokenizer.put(ids[start : start + group])
        pieces.append(detokenizer.take())
    detokenizer.end()
    pieces.append(detokenizer.take())
    return pieces


@pytest.mark.parametrize("group", [1, 3])
def test_streamed_text_is_the_whole_reply_decoded(tokenizer, group):
    ids = tokenizer(TEXT)["input_ids"]
    detokenizer = _Detokenizer(tokenizer)
    assert detokenizer._streamer is None  # the shipped fast tokenizer streams through DecodeStream
    pieces = stream(detokenizer, ids, group)
    assert "".join(pieces) == tokenizer.decode(ids, skip_special_tokens=True)
    assert "<|im_end|>" not in "".join(pieces) and "🙂" in "".join(pieces)
    if group == 1:  # after each token, all of the text whose characters are complete: none held for a word's end
        for count in range(1, len(ids) + 1):
            assert "".join(pieces[:count]) == tokenizer.decode(ids[:count], skip_special_tokens=True).rstrip("\ufffd")


def test_a_reply_ending_inside_a_character_ends_as_decoding_it_whole(tokenizer):
    ids = tokenizer("ok 🙂")["input_ids"]
    emoji = tokenizer("🙂", add_special_tokens=False)["input_ids"]
    assert len(emoji) > 1  # byte-level pieces of one character
    cut = ids[:-1]
    pieces = stream(_Detokenizer(tokenizer), cut, 1)
    assert "".join(pieces) == tokenizer.decode(cut, skip_special_tokens=True)
    assert pieces[-1].endswith("\ufffd")


def test_a_tokenizer_cleaning_up_spaces_streams_through_the_whole_reply_decoder():
    """Cleaning up spaces ("word ," -> "word,") looks at the whole text: such a tokenizer is re-decoded (transformers
    5.2x leaves a BPE tokenizer's text as it is even so)."""
    cleaning = AutoTokenizer.from_pretrained(TOKENIZER_DIR, clean_up_tokenization_spaces=True)
    ids = cleaning(TEXT)["input_ids"]
    detokenizer = _Detokenizer(cleaning)
    assert detokenizer._streamer is not None
    text = "".join(stream(detokenizer, ids, 1))
    assert text == cleaning.decode(ids, skip_special_tokens=True)


def counting_wakeups(loop):
    """Counts the loop's thread-safe wake-ups."""
    wakeups, original = [], loop.call_soon_threadsafe

    def counted(callback, *args, **kwargs):
        wakeups.append(callback)
        return original(callback, *args, **kwargs)

    loop.call_soon_threadsafe = counted
    return wakeups


def test_outputs_posted_together_wake_the_loop_once():
    async def main():
        loop = asyncio.get_running_loop()
        deliveries = _Deliveries.of(loop)
        assert _Deliveries.of(loop) is deliveries  # one per loop
        wakeups = counting_wakeups(loop)
        queues = [asyncio.Queue() for _ in range(8)]
        received = []
        for step in range(3):  # a step's eight outputs, posted before the loop runs again
            for index, queue in enumerate(queues):
                deliveries.post(queue, (step, index))
            received.append([await queue.get() for queue in queues])
        return wakeups, received

    wakeups, received = asyncio.run(main())
    assert len(wakeups) == 3
    assert received == [[(step, index) for index in range(8)] for step in range(3)]


def test_outputs_posted_from_another_thread_all_arrive_in_order():
    async def main():
        loop = asyncio.get_running_loop()
        deliveries = _Deliveries.of(loop)
        wakeups = counting_wakeups(loop)
        queues = [asyncio.Queue() for _ in range(4)]

        def engine():
            for step in range(500):
                for index, queue in enumerate(queues):
                    deliveries.post(queue, (step, index))

        thread = threading.Thread(target=engine)
        thread.start()
        received = [[(await queue.get()) for _ in range(500)] for queue in queues]
        thread.join()
        await asyncio.sleep(0)  # a wake-up scheduled after the last output finds nothing left
        return wakeups, received, [queue.qsize() for queue in queues], len(deliveries.pending)

    wakeups, received, left, pending = asyncio.run(main())
    assert received == [[(step, index) for step in range(500)] for index in range(4)]
    assert (left, pending) == ([0] * 4, 0)
    assert 1 <= len(wakeups) <= 2000


@dataclass
class Output:
    """What `_Deliveries` reads of an engine's output."""

    generated_tokens: list[int]
    finished: bool = False

    def is_finished(self) -> bool:
        return self.finished


def test_a_stream_interval_holds_the_outputs_between_the_first_and_the_last():
    async def main():
        loop = asyncio.get_running_loop()
        deliveries = _Deliveries.of(loop)
        wakeups = counting_wakeups(loop)
        queue = asyncio.Queue()
        outputs = [Output(list(range(n))) for n in range(1, 6)] + [Output(list(range(6)), finished=True)]
        deliveries.post(queue, outputs[0], 3600)
        first = await asyncio.wait_for(queue.get(), 5)
        for output in outputs[1:5]:
            deliveries.post(queue, output, 3600)
        await asyncio.sleep(0.2)
        held = queue.qsize()
        deliveries.post(queue, outputs[5], 3600)
        rest = [await asyncio.wait_for(queue.get(), 5) for _ in range(5)]
        return outputs, first, held, rest, [callback.__name__ for callback in wakeups]

    outputs, first, held, rest, wakeups = asyncio.run(main())
    assert first is outputs[0]  # the first output at once
    assert held == 0  # the next four wait for the interval
    assert rest == outputs[1:]  # the last output at once, and with it the four before, in order
    assert wakeups == ["_drain", "_drain_at", "_drain"]  # one wake-up each, the held ones' setting a timer


def test_held_outputs_go_at_the_end_of_the_interval_without_another_post():
    interval = 0.3

    async def main():
        deliveries = _Deliveries.of(asyncio.get_running_loop())
        queue = asyncio.Queue()
        posted = time.monotonic()
        deliveries.post(queue, Output([1]), interval)
        await asyncio.wait_for(queue.get(), 5)
        deliveries.post(queue, Output([1, 2]), interval)
        held = await asyncio.wait_for(queue.get(), 5)  # no later output comes: the timer sends it
        return held, time.monotonic() - posted

    held, waited = asyncio.run(main())
    assert held == Output([1, 2])
    assert waited >= interval  # not before the interval, counted from the drain that sent the first output
