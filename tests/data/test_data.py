"""minimind.data: validation messages, packing, assistant-only labels, padded and padding-free batches, splits."""

import json
import logging
import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

from conftest import ROOT  # noqa: E402
from minimind.data import (  # noqa: E402
    IGNORE_INDEX,
    DataFormatError,
    build_pretrain_dataset,
    build_sft_dataset,
    collator,
    encode_chat,
    read_jsonl,
    split_train_eval,
)


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(os.path.join(ROOT, "tokenizer"))


def write_lines(path: Path, lines: list) -> Path:
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines), encoding="utf-8")
    return path


def chat(*pairs, system=None):
    messages = [{"role": "system", "content": system}] if system else []
    for question, answer in pairs:
        messages += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
    return messages


GOOD = {
    "pretrain": {"text": "The sky is blue."},
    "sft": {"conversations": chat(("What is 3 plus 4?", "3 plus 4 is 7."))},
    "dpo": {"chosen": chat(("Q?", "right")), "rejected": chat(("Q?", "wrong"))},
}

# (kind, bad line, words the error must mention)
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
def test_missing_file_or_directory_is_a_data_error(tmp_path, kind):
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


def test_reasoning_content_on_assistant_messages_is_accepted(tmp_path):
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


def test_builders_fail_before_tokenising(tmp_path, tok):
    path = write_lines(tmp_path / "bad_sft.jsonl", [GOOD["sft"], {"conversations": []}])
    with pytest.raises(DataFormatError, match=r"bad_sft\.jsonl, line 2: 'conversations' is empty"):
        build_sft_dataset(path, tok, 64)


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


def test_pretrain_packing_exact_blocks(tmp_path, tok):
    texts = [f"Story {i}: the cat sat on the mat and ate {i} apples." * (1 + i % 3) for i in range(40)]
    path = write_lines(tmp_path / "p.jsonl", [{"text": t} for t in texts])
    block = 32
    dataset = build_pretrain_dataset(path, tok, block)

    stream = []
    for text in texts:
        stream += [tok.bos_token_id, *tok.encode(text, add_special_tokens=False), tok.eos_token_id]
    assert len(dataset) == len(stream) // block
    packed = [t for row in dataset["input_ids"] for t in row]
    assert packed == stream[: len(packed)]  # order kept, nothing lost but the tail
    assert len(stream) - len(packed) < block
    for row in dataset:
        assert len(row["input_ids"]) == block
        assert row["labels"] == row["input_ids"]
        assert row["attention_mask"] == [1] * block


def test_pretrain_too_short_raises(tmp_path, tok):
    path = write_lines(tmp_path / "short.jsonl", [{"text": "hi"}])
    with pytest.raises(DataFormatError, match="fewer than max_seq_length=512"):
        build_pretrain_dataset(path, tok, 512)


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


def test_sft_labels_token_by_token(tmp_path, tok):
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


def test_sft_labels_with_tool_calls(tok):
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


def test_sft_drop_warning_names_the_first_dropped_lines(tmp_path, tok, caplog):
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


def test_sft_collator_pads(tmp_path, tok):
    path = write_lines(tmp_path / "c.jsonl", [GOOD["sft"], {"conversations": chat(("Hi", "Hello there, friend!"))}])
    dataset = build_sft_dataset(path, tok, 128)
    batch = collator("sft", tok)([dataset[0], dataset[1]])
    lengths = [len(dataset[i]["input_ids"]) for i in range(2)]
    assert batch["input_ids"].shape == (2, max(lengths))
    short = lengths.index(min(lengths))
    assert batch["input_ids"][short, min(lengths) :].tolist() == [tok.pad_token_id] * (max(lengths) - min(lengths))
    assert batch["labels"][short, min(lengths) :].tolist() == [IGNORE_INDEX] * (max(lengths) - min(lengths))
    assert batch["attention_mask"].sum().item() == sum(lengths)


@pytest.mark.parametrize("kind", ["pretrain", "sft"])
def test_padding_free_batch_is_one_row_with_restarting_positions(tmp_path, tok, kind):
    if kind == "sft":
        path = write_lines(tmp_path / "c.jsonl", [GOOD["sft"], {"conversations": chat(("Hi", "Hello there!"))}])
        rows = build_sft_dataset(path, tok, 128)
    else:
        path = write_lines(tmp_path / "p.jsonl", [{"text": "The sky is blue."}, {"text": "Snow is white. " * 3}])
        rows = build_pretrain_dataset(path, tok, 8, packed=False)
    features = [rows[i] for i in range(len(rows))]
    batch = collator(kind, tok, padding_free=True)(features)
    lengths = [len(f["input_ids"]) for f in features]
    assert batch["input_ids"].shape == (1, sum(lengths)) and "attention_mask" not in batch
    assert batch["input_ids"][0].tolist() == [t for f in features for t in f["input_ids"]]
    assert batch["position_ids"][0].tolist() == [p for n in lengths for p in range(n)]
    # No row learns to predict the next row's first token; every other label is the row's own.
    expected = [label for f in features for label in [IGNORE_INDEX, *f["labels"][1:]]]
    assert batch["labels"][0].tolist() == expected


def test_unpacked_pretraining_keeps_documents_apart(tmp_path, tok):
    texts = ["The sky is blue.", "Snow is white and coal is black. " * 4]
    path = write_lines(tmp_path / "p.jsonl", [{"text": t} for t in texts])
    dataset = build_pretrain_dataset(path, tok, 16, packed=False)
    documents = [[tok.bos_token_id, *tok.encode(t, add_special_tokens=False), tok.eos_token_id] for t in texts]
    pieces = [d[i : i + 16] for d in documents for i in range(0, len(d), 16)]
    assert dataset["input_ids"] == [p for p in pieces if len(p) > 1]  # split at 16, nothing lost but 1-token tails
    assert dataset["labels"] == dataset["input_ids"]
    assert len(documents[1]) > 32  # the long text really was split


def test_split_train_eval(tmp_path, tok):
    path = write_lines(tmp_path / "s.jsonl", [{"conversations": chat((f"Q{i}", f"A{i}"))} for i in range(20)])
    dataset = build_sft_dataset(path, tok, 64)
    train, held_out = split_train_eval(dataset, 0.1, seed=3)
    assert (len(train), len(held_out)) == (18, 2)
    again_train, again_eval = split_train_eval(dataset, 0.1, seed=3)
    assert again_eval["input_ids"] == held_out["input_ids"]
    assert split_train_eval(dataset, 0.0, seed=3) == (dataset, None)
    with pytest.raises(ValueError):
        split_train_eval(dataset.select([0]), 0.5, seed=3)


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
def test_malformed_line_message_is_exact_problem_and_fix(tmp_path, kind, bad, message):
    path = write_lines(tmp_path / "data.jsonl", [bad])
    with pytest.raises(DataFormatError) as info:
        read_jsonl(path, kind)
    assert str(info.value) == f"{path}, line 1: {message}"


def test_validation_goes_on_after_an_assistant_message_with_only_tool_calls(tmp_path):
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
def test_skip_bad_lines_keeps_the_good_rows_of_every_kind(tmp_path, tok, kind):
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
def test_unencodable_or_too_deep_lines_are_named_or_skipped(tmp_path, tok, kind, bad, message):
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


def test_a_chat_the_template_cannot_render_is_named_or_skipped(tmp_path, tok, caplog):
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
