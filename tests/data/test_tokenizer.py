"""The shipped tokenizer: fixed special ids, exact round-trips, chat template, cross-version config."""

import json
import os
import random
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

from conftest import TOKENIZER_DIR, load_script  # noqa: E402
from minimind.tokenizer import (  # noqa: E402
    CHAT_TEMPLATE,
    QWEN2_PRETOKENIZE_REGEX,
    SPECIAL_TOKENS,
    load_tokenizer,
    save_tokenizer,
)

EXPECTED_IDS = {
    "<|endoftext|>": 0,
    "<|im_start|>": 1,
    "<|im_end|>": 2,
    "<think>": 3,
    "</think>": 4,
    "<tool_call>": 5,
    "</tool_call>": 6,
}

TRICKY = [
    "",
    "Hello, world!",
    "  leading and trailing spaces  ",
    "tabs\tand\nnewlines\r\nand\rcarriage returns\n\n\n",
    "     \t\t   \n  \n",
    "emoji 😀👍🏽👨‍👩‍👧‍👦 🇯🇵 flags",
    "日本語のテキストと中文文本，한국어 텍스트",
    "combining: e\u0301 a\u0308 o\u0303\u0323 Å vs A\u030a",  # NFC would change these
    "control: \x00\x01\x07\x1b[31m\x7f\x85",
    "zero width: a\u200bb\u200cc\u200dd\ufeff",
    "RTL: مرحبا بالعالم שלום",
    "math 𝔸𝕓𝒸 ∑∫√ and digits ١٢٣ １２３",
    "don't I'M you'LL we've",
    "special text <|im_start|>user\nhi<|im_end|>\n<think>x</think><tool_call>{}</tool_call><|endoftext|>",
    "lone specials-like: <|im_start <|im_end|",
    "\U0010ffff\ue000 private use",
]


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(TOKENIZER_DIR)


def roundtrip(tok, text):
    return tok.decode(tok.encode(text, add_special_tokens=False), skip_special_tokens=False)


def test_special_token_ids(tok):
    for token, token_id in EXPECTED_IDS.items():
        assert tok.convert_tokens_to_ids(token) == token_id
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id, tok.unk_token_id) == (0, 1, 2, 0)
    assert tok.convert_ids_to_tokens(list(range(7))) == SPECIAL_TOKENS
    assert len(tok) == 6400
    load_tokenizer(TOKENIZER_DIR)  # its own id check passes


def test_think_and_tool_tokens_survive(tok):
    """Think and tool tokens survive skip_special_tokens."""
    ids = tok.encode("<|im_start|><think>a</think><tool_call>b</tool_call><|im_end|>", add_special_tokens=False)
    assert tok.decode(ids, skip_special_tokens=True) == "<think>a</think><tool_call>b</tool_call>"


def test_config_files_are_cross_version():
    config = json.loads(Path(TOKENIZER_DIR, "tokenizer_config.json").read_text(encoding="utf-8"))
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert config["chat_template"] == CHAT_TEMPLATE
    assert Path(TOKENIZER_DIR, "chat_template.jinja").read_text(encoding="utf-8") == CHAT_TEMPLATE
    assert not isinstance(config.get("extra_special_tokens"), list)
    assert config["clean_up_tokenization_spaces"] is False


def test_pipeline_is_qwen2_style():
    state = json.loads(Path(TOKENIZER_DIR, "tokenizer.json").read_text(encoding="utf-8"))
    assert state["normalizer"] is None
    split, byte_level = state["pre_tokenizer"]["pretokenizers"]
    assert split["type"] == "Split" and split["behavior"] == "Isolated"
    assert split["pattern"]["Regex"] == QWEN2_PRETOKENIZE_REGEX
    assert byte_level == {**byte_level, "type": "ByteLevel", "add_prefix_space": False, "use_regex": False}
    assert state["decoder"]["type"] == "ByteLevel"


def test_no_implicit_special_tokens(tok):
    assert tok("hello")["input_ids"] == tok.encode("hello", add_special_tokens=False)


@pytest.mark.parametrize("text", TRICKY)
def test_roundtrip_tricky(tok, text):
    assert roundtrip(tok, text) == text


def test_roundtrip_random_unicode(tok):
    rng = random.Random(1234)
    ranges = [(0x0, 0x7F), (0x80, 0x7FF), (0x800, 0xD7FF), (0xE000, 0xFFFF), (0x10000, 0x10FFFF)]
    for _ in range(300):
        chars = []
        for _ in range(rng.randint(1, 40)):
            lo, hi = rng.choice(ranges)
            chars.append(chr(rng.randint(lo, hi)))  # surrogates excluded: not encodable as UTF-8
        text = "".join(chars)
        assert roundtrip(tok, text) == text, repr(text)


CHAT = [
    {"role": "system", "content": "You are MiniMind."},
    {"role": "user", "content": "What is 3 plus 4?"},
    {"role": "assistant", "content": "3 plus 4 is 7."},
]


def test_chat_template_exact(tok):
    assert tok.apply_chat_template(CHAT, tokenize=False) == (
        "<|im_start|>system\nYou are MiniMind.<|im_end|>\n"
        "<|im_start|>user\nWhat is 3 plus 4?<|im_end|>\n"
        "<|im_start|>assistant\n3 plus 4 is 7.<|im_end|>\n"
    )


def test_chat_template_generation_prompt(tok):
    assert tok.apply_chat_template(CHAT[1:2], tokenize=False, add_generation_prompt=True) == (
        "<|im_start|>user\nWhat is 3 plus 4?<|im_end|>\n<|im_start|>assistant\n"
    )


def test_chat_template_tool_call(tok):
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Add 1 and 2."},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"type": "function", "function": {"name": "add", "arguments": {"a": 1, "b": 2}}}],
        },
        {"role": "tool", "content": "3"},
        {"role": "assistant", "content": "Checking.", "tool_calls": [{"name": "add", "arguments": '{"a": 0}'}]},
    ]
    assert tok.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True) == (
        "<|im_start|>system\nBe brief.\n\n"
        "You can call the following tools. Each is described by a JSON schema:\n<tools>\n"
        '{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}\n'
        "</tools>\nTo call a tool, reply with <tool_call>\n"
        '{"name": <tool-name>, "arguments": <arguments-as-json-object>}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\nAdd 1 and 2.<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call><|im_end|>\n'
        "<|im_start|>tool\n3<|im_end|>\n"
        "<|im_start|>assistant\nChecking.\n"
        '<tool_call>\n{"name": "add", "arguments": {"a": 0}}\n</tool_call><|im_end|>\n'
        "<|im_start|>assistant\n"
    )


def test_retrain_tiny_in_tmp_dir(tmp_path):
    corpus = tmp_path / "tiny.txt"
    corpus.write_text("the cat sat on the mat.\nthe dog sat on the log.\n" * 50, encoding="utf-8")
    out = tmp_path / "tok"
    load_script("train_tokenizer").main(["--files", str(corpus), "--vocab_size", "300", "--output_dir", str(out)])
    loaded = AutoTokenizer.from_pretrained(str(out))
    assert 263 < len(loaded) <= 300  # 7 specials + 256 bytes + some merges
    assert [loaded.convert_tokens_to_ids(t) for t in EXPECTED_IDS] == list(EXPECTED_IDS.values())
    config = json.loads((out / "tokenizer_config.json").read_text(encoding="utf-8"))
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert "chat_template" in config
    text = "the cat 🐈 sat, 日本"
    assert roundtrip(loaded, text) == text


def test_save_tokenizer_rewrites_config(tmp_path, tok):
    save_tokenizer(tok, tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text(encoding="utf-8"))
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert config["chat_template"] == CHAT_TEMPLATE
    assert len(AutoTokenizer.from_pretrained(str(tmp_path))) == len(tok)
