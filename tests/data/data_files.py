"""What the data tests share: a cache directory per test, the bundled tokenizer, files of lines, small chats."""

import json
import os
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from conftest import ROOT

__all__ = ["data_cache", "tok"]  # the fixtures: `from data_files import *` in each test module


@pytest.fixture(autouse=True)
def data_cache(tmp_path_factory, monkeypatch):
    """Each test tokenises into its own cache directory, never the user's ~/.cache/minimind/data."""
    root = tmp_path_factory.mktemp("minimind-cache")
    monkeypatch.setenv("MINIMIND_CACHE", str(root))
    return root / "data"


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
