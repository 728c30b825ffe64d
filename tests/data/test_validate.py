"""minimind.data.validate: every bad line named with its file, line, problem and fix, or skipped and counted; the
bundled corpus valid."""

import json
import logging
from pathlib import Path

import pytest
from data_files import *  # noqa: F403 (the fixtures data_cache, tok)
from data_files import GOOD, chat, write_lines

from conftest import ROOT
from minimind.data import DataFormatError, build_pretrain_dataset, read_jsonl

BAD_LINES = [
    ("pretrain", '{"text": "unterminated', "invalid JSON"),
    ("pretrain", '["a", "list"]', "expected a JSON object, got list"),
    ("pretrain", {"txt": "typo"}, "missing key 'text'"),
    ("pretrain", {"text": 42}, "'text' must be a string, got int"),
    ("pretrain", {"text": "   "}, "'text' is empty"),
    ("sft", {"messages": []}, "missing key 'conversations'"),
    ("sft", {"conversations": "hi"}, "'conversations' must be a list of messages, got str"),
    ("sft", {"conversations": []}, "'conversations' is empty"),
    ("sft", {"conversations": ["hi"]}, "message 0 must be an object, got str"),
    ("sft", {"conversations": [{"role": "human", "content": "hi"}]}, "unknown role 'human'"),
    ("sft", {"conversations": [{"role": "user", "content": None}]}, "'content' must be a string, got null"),
    ("sft", {"conversations": [{"role": "user", "content": "hi"}]}, "has no assistant message"),
    ("sft", {"conversations": chat(("hi", " "))}, "assistant reply with empty content"),
    ("sft", {"conversations": chat(("hi", "yo")), "tools": "add"}, "'tools' must be a list"),
    (
        "sft",
        {
            "conversations": [
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": None, "tool_calls": [{"arguments": {}}]},
            ]
        },
        "tool call 0 has no string 'name'",
    ),
    ("dpo", {"chosen": chat(("Q", "A"))}, "missing key 'rejected'"),
    (
        "dpo",
        {"chosen": chat(("Q", "A")), "rejected": [{"role": "user", "content": "Q"}]},
        "'rejected' has no assistant message",
    ),
    (
        "dpo",
        {"chosen": chat(("Q", "A")) + [{"role": "user", "content": "more"}], "rejected": chat(("Q", "B"))},
        "'chosen' must end with the assistant reply",
    ),
    (
        "dpo",
        {"chosen": chat(("Q", "A")), "rejected": chat(("other Q", "B"))},
        "'chosen' and 'rejected' have different prompts (they differ at message 0; 1 and 1 messages",
    ),
    (
        "dpo",
        {"chosen": chat(("Q", "A"), system="Be brief."), "rejected": chat(("Q", "B"))},
        "'chosen' and 'rejected' have different prompts (they differ at message 0; 2 and 1 messages",
    ),
    (
        "dpo",
        {"chosen": chat(("Q1", "A1"), ("Q2", "A")), "rejected": chat(("Q1", "other A1"), ("Q2", "B"))},
        "'chosen' and 'rejected' have different prompts (they differ at message 1; 3 and 3 messages",
    ),
    (
        "sft",
        {
            "conversations": [
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "yo", "reasoning_content": ["think"]},
            ]
        },
        "'conversations' message 1 (assistant) 'reasoning_content' must be a string, got list",
    ),
    (
        "sft",
        {
            "conversations": [
                {"role": "user", "content": "hi", "reasoning_content": "hmm"},
                {"role": "assistant", "content": "yo"},
            ]
        },
        "'conversations' message 0 (user) has 'reasoning_content', which only assistant messages may carry",
    ),
]


@pytest.mark.parametrize("kind, bad, expected", BAD_LINES)
def test_malformed_line_names_file_and_line(tmp_path, kind, bad, expected):
    # The bad line is line 4: after a good line and a blank line that must still be counted.
    path = write_lines(tmp_path / f"my_{kind}.jsonl", [GOOD[kind], "", GOOD[kind], bad, GOOD[kind]])
    with pytest.raises(DataFormatError) as info:
        read_jsonl(path, kind)
    message = str(info.value)
    assert f"my_{kind}.jsonl, line 4: " in message
    assert expected in message
    assert "Fix: " in message


@pytest.mark.parametrize("kind", ["missing", "directory"])
def test_missing_path_is_a_data_error(tmp_path, kind):
    """Missing file or directory is a data error."""
    path = tmp_path / "absent.jsonl"
    if kind == "directory":
        path.mkdir()
    expected = (
        r"absent\.jsonl: no such file\. Fix: check the path \(--data_path\)"
        if kind == "missing"
        else r"absent\.jsonl: is a directory, not a JSONL file\. Fix: pass the path of a \.jsonl file"
    )
    with pytest.raises(DataFormatError, match=expected):
        read_jsonl(path, "sft")


def test_utf8_bom_at_the_start_is_accepted(tmp_path):
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + json.dumps(GOOD["sft"]).encode() + b"\n")
    assert read_jsonl(path, "sft") == ([GOOD["sft"]], 0)


def test_reasoning_content_is_accepted(tmp_path):
    """Reasoning content on assistant messages is accepted."""
    reply = {"role": "assistant", "content": "7.", "reasoning_content": "3 plus 4 is 7."}
    row = {"conversations": [{"role": "user", "content": "3 plus 4?"}, reply]}
    path = write_lines(
        tmp_path / "r.jsonl", [row, {"conversations": [row["conversations"][0], {**reply, "reasoning_content": None}]}]
    )
    rows, skipped = read_jsonl(path, "sft")
    assert (rows[0], len(rows), skipped) == (row, 2, 0)


def test_invalid_utf8_has_line_number(tmp_path):
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(b'{"text": "ok"}\n{"text": "caf\xe9"}\n')
    with pytest.raises(DataFormatError, match=r"latin1\.jsonl, line 2: not valid UTF-8"):
        read_jsonl(path, "pretrain")


def test_skip_bad_lines_counts(tmp_path, tok, caplog):
    lines = [GOOD["pretrain"], "not json", {"text": 1}, "", GOOD["pretrain"], {"nope": 1}]
    path = write_lines(tmp_path / "mixed.jsonl", lines)
    with caplog.at_level(logging.WARNING, logger="minimind.data"):
        rows, skipped = read_jsonl(path, "pretrain", skip_bad_lines=True)
    assert (len(rows), skipped) == (2, 3)
    assert "skipped 3 bad line(s)" in caplog.text and "mixed.jsonl, line 2" in caplog.text
    assert len(build_pretrain_dataset(path, tok, 4, skip_bad_lines=True)) > 0


@pytest.mark.parametrize("kind", ["pretrain", "sft", "dpo"])
def test_empty_file_raises(tmp_path, kind):
    path = write_lines(tmp_path / "empty.jsonl", ["", "   "])
    with pytest.raises(DataFormatError, match=r"empty\.jsonl: no valid .* examples \(the file has no non-blank"):
        read_jsonl(path, kind)


def test_all_bad_with_skip_raises(tmp_path):
    path = write_lines(tmp_path / "allbad.jsonl", ["{", "}"])
    with pytest.raises(DataFormatError, match=r"all 2 non-blank line\(s\) are malformed"):
        read_jsonl(path, "pretrain", skip_bad_lines=True)


def test_bundled_corpus_is_valid():
    for name, kind in (("pretrain.jsonl", "pretrain"), ("sft.jsonl", "sft"), ("dpo.jsonl", "dpo")):
        rows, skipped = read_jsonl(Path(ROOT, "data", name), kind)
        assert rows and skipped == 0


@pytest.mark.parametrize(
    "kind, bad, message",
    [
        (
            "pretrain",
            '{"text": "unterminated"',
            "invalid JSON (Expecting ',' delimiter at column 24). Fix: check for "
            "unbalanced quotes/brackets or a trailing comma; each line must be one complete JSON object.",
        ),
        ("pretrain", {"text": "   "}, "'text' is empty. Fix: delete the line or put text in it."),
        (
            "sft",
            {"conversations": []},
            "'conversations' is empty. Fix: add at least a user message and an assistant reply, or delete the line.",
        ),
        (
            "sft",
            {
                "conversations": [
                    {"role": "user", "content": "hi"},
                    {"role": "assistant", "content": None, "tool_calls": [{"name": "add", "arguments": 5}]},
                ]
            },
            "'conversations' message 1 tool call 0 'arguments' must be an object or a JSON string. Fix: write "
            '"arguments": {"param": value}.',
        ),
    ],
)
def test_malformed_line_message_is_exact(tmp_path, kind, bad, message):
    """Malformed line message is exact problem and fix."""
    path = write_lines(tmp_path / "data.jsonl", [bad])
    with pytest.raises(DataFormatError) as info:
        read_jsonl(path, kind)
    assert str(info.value) == f"{path}, line 1: {message}"


def test_goes_on_after_tool_call_only_reply(tmp_path):
    """Validation goes on after an assistant message with only tool calls."""
    tool_call = {"role": "assistant", "content": None, "tool_calls": [{"name": "add", "arguments": {"a": 1}}]}
    bad_after = [
        {"role": "user", "content": "add"},
        tool_call,
        {"role": "tool", "content": "1"},
        {"role": "assistant", "content": 7},
    ]
    path = write_lines(tmp_path / "data.jsonl", [{"conversations": bad_after}])
    with pytest.raises(
        DataFormatError,
        match=r"line 1: 'conversations' message 3 \(assistant\) 'content' must be "
        r"a string, got int",
    ):
        read_jsonl(path, "sft")


@pytest.mark.parametrize("kind", ["pretrain", "sft", "dpo"])
def test_skip_bad_lines_keeps_good_rows(tmp_path, tok, kind):
    """--skip_bad_lines reaches the reader for each data kind (DPO pairs are read apart from the others)."""
    from minimind.training import DataArguments, load_datasets

    path = write_lines(tmp_path / f"{kind}.jsonl", [GOOD[kind], '{"broken', GOOD[kind], GOOD[kind]])
    tokenizer, length = tok, 16 if kind == "pretrain" else 64
    strict = DataArguments(data_path=str(path), max_seq_length=length, eval_fraction=0)
    with pytest.raises(DataFormatError, match=r"line 2: invalid JSON"):
        load_datasets(kind, strict, tokenizer)
    train, held_out = load_datasets(
        kind,
        DataArguments(data_path=str(path), max_seq_length=length, eval_fraction=0, skip_bad_lines=True),
        tokenizer,
    )
    assert held_out is None
    # pretraining packs the three texts (7 tokens each with bos/eos) into one 16-token block
    assert len(train) == (1 if kind == "pretrain" else 3)


SURROGATE_MESSAGE = (
    "is not valid Unicode (lone surrogate '\\ud800' at character {at}, from a \\uXXXX escape that is "
    "half of a pair). Fix: replace the escape with the intended character, or pass --skip_bad_lines "
    "to skip such lines."
)

NESTED_MESSAGE = (
    "arrays/objects nested more than 100 levels deep. Fix: flatten the line (no training format nests "
    "that deep), or pass --skip_bad_lines to skip such lines."
)

DEEP = "[" * 100_000 + "]" * 100_000

SFT_REPLY = '{"role": "user", "content": "hi"}, {"role": "assistant", "content": "%s"}'

# (kind, bad line as written in the file, the exact problem and fix). Each used to pass validation and end training
# later with a traceback (UnicodeEncodeError in the tokenizer or Arrow, RecursionError in json.loads or json.dumps).

UNREADABLE_LINES = [
    ("pretrain", '{"text": "caf\\ud800"}', "the string at ['text'] " + SURROGATE_MESSAGE.format(at=3)),
    ("pretrain", DEEP, NESTED_MESSAGE),
    (
        "pretrain",
        '{"text": 1' + "0" * 5000 + "}",
        "invalid JSON (Exceeds the limit (4300 digits) for integer string "
        "conversion: value has 5001 digits; use sys.set_int_max_str_digits() to increase the limit). Fix: shorten or "
        "quote the value, or pass --skip_bad_lines to skip such lines.",
    ),
    (
        "sft",
        '{"conversations": [%s]}' % (SFT_REPLY % "ok\\ud800"),
        "the string at ['conversations'][1]['content'] " + SURROGATE_MESSAGE.format(at=2),
    ),
    (
        "sft",
        '{"conversations": [{"role": "user", "content": "hi", "\\ud800": 1}, {"role": "assistant", "content": "yo"}]}',
        "a key in ['conversations'][0] " + SURROGATE_MESSAGE.format(at=0),
    ),
    ("sft", DEEP, NESTED_MESSAGE),
    # Parses (json.loads' limit is deeper), but the chat template's JSON encoding would not.
    (
        "sft",
        '{"conversations": [%s], "tools": [{"parameters": %s}]}' % (SFT_REPLY % "yo", "[" * 150 + "]" * 150),  # noqa: UP031
        NESTED_MESSAGE,
    ),
]


@pytest.mark.parametrize("kind, bad, message", UNREADABLE_LINES)
def test_unencodable_lines_named_or_skipped(tmp_path, tok, kind, bad, message):
    """Unencodable or too deep lines are named or skipped."""
    from minimind.data import build_dataset

    path = tmp_path / f"{kind}.jsonl"
    path.write_text("\n".join([json.dumps(GOOD[kind]), "", bad, json.dumps(GOOD[kind])]) + "\n", encoding="utf-8")
    with pytest.raises(DataFormatError) as info:
        read_jsonl(path, kind)
    assert str(info.value) == f"{path}, line 3: {message}"
    with pytest.raises(DataFormatError) as info:  # the builders too, before any tokenising
        build_dataset(kind, path, tok, 64, padding_free=True)
    assert str(info.value) == f"{path}, line 3: {message}"

    assert read_jsonl(path, kind, skip_bad_lines=True) == ([GOOD[kind], GOOD[kind]], 1)
    # One row per document or chat: both good lines, and nothing of the bad one.
    assert len(build_dataset(kind, path, tok, 64, skip_bad_lines=True, padding_free=True)) == 2
