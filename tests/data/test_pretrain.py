"""minimind.data.pretrain: packed blocks of exactly max_seq_length tokens in order, documents kept apart when
unpacked, too little text refused."""

import pytest
from data_files import *  # noqa: F403 (the fixtures data_cache, tok)
from data_files import write_lines

from minimind.data import DataFormatError, build_pretrain_dataset


def test_packing_gives_exact_blocks(tmp_path, tok):
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


def test_too_short_corpus_raises(tmp_path, tok):
    path = write_lines(tmp_path / "short.jsonl", [{"text": "hi"}])
    with pytest.raises(DataFormatError, match="fewer than max_seq_length=512"):
        build_pretrain_dataset(path, tok, 512)


def test_unpacked_keeps_documents_apart(tmp_path, tok):
    """Unpacked pretraining keeps documents apart."""
    texts = ["The sky is blue.", "Snow is white and coal is black. " * 4]
    path = write_lines(tmp_path / "p.jsonl", [{"text": t} for t in texts])
    dataset = build_pretrain_dataset(path, tok, 16, packed=False)
    documents = [[tok.bos_token_id, *tok.encode(t, add_special_tokens=False), tok.eos_token_id] for t in texts]
    pieces = [d[i : i + 16] for d in documents for i in range(0, len(d), 16)]
    assert dataset["input_ids"] == [p for p in pieces if len(p) > 1]  # split at 16, nothing lost but 1-token tails
    assert dataset["labels"] == dataset["input_ids"]
    assert len(documents[1]) > 32  # the long text really was split
