"""minimind.data.sft: assistant-only labels token by token, truncation and its drop warning, chats the template
cannot render named or skipped."""

import logging

import pytest
from data_files import *  # noqa: F403 (the fixtures data_cache, tok)
from data_files import GOOD, chat, write_lines

from minimind.data import IGNORE_INDEX, DataFormatError, build_sft_dataset, encode_chat


def test_builders_fail_before_tokenising(tmp_path, tok):
    path = write_lines(tmp_path / "bad_sft.jsonl", [GOOD["sft"], {"conversations": []}])
    with pytest.raises(DataFormatError, match=r"bad_sft\.jsonl, line 2: 'conversations' is empty"):
        build_sft_dataset(path, tok, 64)


def assistant_targets(tok, example):
    """Decode the labelled tokens as runs of consecutive positions."""
    runs, current = [], []
    for token, label in zip(example["input_ids"], example["labels"]):
        assert label in (IGNORE_INDEX, token)
        if label != IGNORE_INDEX:
            current.append(token)
        elif current:
            runs.append(current)
            current = []
    if current:
        runs.append(current)
    return [tok.decode(run, skip_special_tokens=False) for run in runs]


def test_labels_token_by_token(tmp_path, tok):
    messages = chat(
        ("What is 3 plus 4?", "3 plus 4 is 7."),
        ("And the colour of the sky?", "\nThe sky is blue. 😀\n"),
        system="Be brief.",
    )
    path = write_lines(tmp_path / "s.jsonl", [{"conversations": messages}])
    example = build_sft_dataset(path, tok, 512)[0]
    assert tok.decode(example["input_ids"], skip_special_tokens=False) == tok.apply_chat_template(
        messages, tokenize=False
    )
    assert assistant_targets(tok, example) == ["3 plus 4 is 7.<|im_end|>", "\nThe sky is blue. 😀\n<|im_end|>"]
    assert example["attention_mask"] == [1] * len(example["input_ids"])


def test_labels_with_tool_calls(tok):
    messages = [
        {"role": "user", "content": "Add 1 and 2."},
        {"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "add", "arguments": {"a": 1}}}]},
        {"role": "tool", "content": "3"},
        {"role": "assistant", "content": "It is 3."},
    ]
    tools = [{"type": "function", "function": {"name": "add"}}]
    example = encode_chat(tok, messages, tools)
    assert assistant_targets(tok, example) == [
        '<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call><|im_end|>',
        "It is 3.<|im_end|>",
    ]


def test_sft_truncation_and_drop(tmp_path, tok, caplog):
    long_prompt = chat(("word " * 200, "late answer"))
    path = write_lines(tmp_path / "t.jsonl", [GOOD["sft"], {"conversations": long_prompt}])
    with caplog.at_level(logging.WARNING, logger="minimind.data"):
        dataset = build_sft_dataset(path, tok, 24)
    assert len(dataset) == 1
    assert (
        "t.jsonl: dropped 1 of 2 sft examples whose assistant reply starts after max_seq_length=24 (line 2)"
        in caplog.text
    )
    assert len(dataset[0]["input_ids"]) <= 24
    only_long = write_lines(tmp_path / "only_long.jsonl", [{"conversations": long_prompt}])
    with pytest.raises(DataFormatError, match="no sft example keeps any assistant tokens"):
        build_sft_dataset(only_long, tok, 24)


def test_drop_warning_names_first_lines(tmp_path, tok, caplog):
    """Line numbers count blank and skipped lines, like every data error; at most five are shown."""
    long_prompt = {"conversations": chat(("word " * 200, "late answer"))}
    lines = [GOOD["sft"], "", long_prompt, "not json", long_prompt] + [long_prompt] * 5 + [GOOD["sft"]]
    path = write_lines(tmp_path / "many.jsonl", lines)
    with caplog.at_level(logging.WARNING, logger="minimind.data"):
        dataset = build_sft_dataset(path, tok, 24, skip_bad_lines=True)
    assert len(dataset) == 2 and set(dataset.column_names) == {"input_ids", "labels", "attention_mask"}
    assert (
        "dropped 7 of 9 sft examples whose assistant reply starts after max_seq_length=24 (line 3, 5, 6, 7, 8, "
        "...)" in caplog.text
    )


def test_unrenderable_chat_named_or_skipped(tmp_path, tok, caplog):
    """A chat that opens with the assistant's reply passes validation, but the template renders no prefix for it:
    the builder names the line instead of failing mid-map, and --skip_bad_lines skips it."""
    opening_reply = {"conversations": [{"role": "assistant", "content": "Hello!"}, *chat(("Hi", "Hi again"))]}
    path = write_lines(tmp_path / "sft.jsonl", [GOOD["sft"], opening_reply, GOOD["sft"]])
    with pytest.raises(DataFormatError) as info:
        build_sft_dataset(path, tok, 64)
    assert str(info.value) == (
        f"{path}, line 2: the chat template cannot render this conversation (ValueError: Cannot apply chat template "
        "to an empty conversation. Provide at least one message.). Fix: check the order of the roles (open with a "
        "system or user message), or pass --skip_bad_lines to skip such lines."
    )
    with caplog.at_level(logging.WARNING, logger="minimind.data"):
        assert len(build_sft_dataset(path, tok, 64, skip_bad_lines=True)) == 2
    assert f"skipped 1 more bad line(s) in {path} (first: {path}, line 2: the chat template" in caplog.text
    assert "dropped" not in caplog.text  # not reported again as cut off by truncation

    path = write_lines(tmp_path / "only.jsonl", [opening_reply])
    with pytest.raises(
        DataFormatError,
        match=r"only\.jsonl: no valid sft examples \(every line is malformed; first: "
        r".*only\.jsonl, line 1: the chat template cannot render",
    ):
        build_sft_dataset(path, tok, 64, skip_bad_lines=True)
