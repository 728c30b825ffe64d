"""The server's detokenizer (`minimind.serving.generator._Detokenizer`): the text it streams, token by token, is the
text of the whole reply decoded at once."""

import pytest
from transformers import AutoTokenizer

from conftest import TOKENIZER_DIR
from minimind.serving.generator import _Detokenizer

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
