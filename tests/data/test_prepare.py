"""minimind.data's cached, parallel preparation: the same rows as a plain reference computation whatever the number
of processes and chunks, tokenised once (a second build does not tokenise), a new entry whenever the file, the
tokenizer or the settings change, no half-written entry after a failure, bad lines named or counted exactly in the
middle of a parallel run, prepared directories as --data_path, and the prepare command."""

import json
import logging
import multiprocessing
import os
import pickle
import signal
import types

import numpy as np
import pytest
from data_files import *  # noqa: F403 (the fixtures data_cache, tok)
from data_files import write_lines
from transformers import AutoTokenizer

import minimind.data.pretrain
import minimind.data.sft
from conftest import ROOT
from minimind.data import (
    DataFormatError,
    TokenDataset,
    build_dataset,
    build_dpo_dataset,
    build_pretrain_dataset,
    build_sft_dataset,
    encode_chat,
    read_jsonl,
)
from minimind.data.pipeline import Progress, map_chunks, read_chunks
from minimind.errors import InputError

SMALL_CHUNKS = dict(chunk_bytes=600)  # a few lines per chunk: many chunks even in a tiny file


def texts(n=120):
    return [f"Story {i}: the cat sat on the mat and ate {i} apples. " * (1 + i % 4) for i in range(n)]


def reference_stream(tok, documents):
    stream = []
    for text in documents:
        stream += [tok.bos_token_id, *tok.encode(text, add_special_tokens=False), tok.eos_token_id]
    return stream


def reference_chats(tok, rows, length):
    examples = [encode_chat(tok, row["conversations"], row.get("tools"), length) for row in rows]
    return [e for e in examples if any(label != -100 for label in e["labels"])]


def chats(n=60):
    return [
        {
            "conversations": [
                {"role": "user", "content": f"What is {i} plus {i % 7}?" + " Please answer." * (i % 5)},
                {"role": "assistant", "content": f"{i} plus {i % 7} is {i + i % 7}."},
            ]
        }
        for i in range(n)
    ]


@pytest.mark.parametrize("packed", [True, False])
def test_two_processes_give_reference_rows(tmp_path, tok, packed):
    documents = texts()
    path = write_lines(tmp_path / "p.jsonl", [{"text": t} for t in documents])
    one = build_pretrain_dataset(path, tok, 32, packed=packed, num_proc=1, data_cache_dir=tmp_path / "a")
    two = build_pretrain_dataset(
        path, tok, 32, packed=packed, num_proc=2, data_cache_dir=tmp_path / "b", **SMALL_CHUNKS
    )
    assert two.meta["num_proc"] == 2 and os.path.getsize(path) > 20 * SMALL_CHUNKS["chunk_bytes"]
    assert two["input_ids"] == one["input_ids"] and two["labels"] == two["input_ids"]
    stream = reference_stream(tok, documents)
    if packed:  # the partial block is carried from chunk to chunk: only the corpus' last one is dropped
        blocks = [stream[i : i + 32] for i in range(0, len(stream) // 32 * 32, 32)]
        assert two.meta["dropped_tokens"] == len(stream) % 32
    else:
        ids = [[tok.bos_token_id, *tok.encode(t, add_special_tokens=False), tok.eos_token_id] for t in documents]
        blocks = [p for d in ids for p in (d[i : i + 32] for i in range(0, len(d), 32)) if len(p) > 1]
    assert two["input_ids"] == blocks
    assert (two.meta["documents"], two.meta["tokens"]) == (len(documents), len(stream))


def test_two_process_sft_rows_are_encode_chat(tmp_path, tok):
    """SFT rows of two processes are encode_chat's."""
    rows = chats()
    path = write_lines(tmp_path / "s.jsonl", rows)
    one = build_sft_dataset(path, tok, 24, num_proc=1, data_cache_dir=tmp_path / "a")
    two = build_sft_dataset(path, tok, 24, num_proc=2, data_cache_dir=tmp_path / "b", **SMALL_CHUNKS)
    expected = reference_chats(tok, rows, 24)
    assert 0 < len(expected) < len(rows)  # some chats are dropped by truncation
    for dataset in (one, two):
        assert dataset["input_ids"] == [e["input_ids"] for e in expected]
        assert dataset["labels"] == [e["labels"] for e in expected]
        assert dataset["attention_mask"] == [e["attention_mask"] for e in expected]


def test_narrowest_token_width_and_light_pickle(tmp_path, tok):
    """Tokens are stored in the narrowest width and the dataset pickles without them."""
    path = write_lines(tmp_path / "p.jsonl", [{"text": t} for t in texts()])
    dataset = build_pretrain_dataset(path, tok, 32)
    assert dataset.meta["dtype"] == "uint16"  # 6,400 tokens
    assert os.path.getsize(dataset.directory / "tokens.bin") == 2 * 32 * len(dataset)
    copy = pickle.loads(pickle.dumps(dataset))
    assert len(pickle.dumps(dataset)) < 2_000 and copy[3] == dataset[3]


def forbid_tokenising(monkeypatch):
    def fail(*args, **kwargs):
        raise AssertionError("tokenised again")

    monkeypatch.setattr(minimind.data.pretrain.PretrainEncoder, "__call__", fail)
    monkeypatch.setattr(minimind.data.sft.SFTEncoder, "__call__", fail)


@pytest.mark.parametrize("kind", ["pretrain", "sft"])
def test_second_build_reads_the_cache(tmp_path, tok, kind, monkeypatch, data_cache):
    """A second build reads the cache without tokenising."""
    path = write_lines(tmp_path / "d.jsonl", [{"text": t} for t in texts()] if kind == "pretrain" else chats())
    first = build_dataset(kind, path, tok, 32, num_proc=1)
    assert first.from_cache is False and first.directory.parent == data_cache  # $MINIMIND_CACHE/data
    forbid_tokenising(monkeypatch)
    second = build_dataset(kind, path, tok, 32, num_proc=1)
    assert second.from_cache is True and second.directory == first.directory
    assert second["input_ids"] == first["input_ids"] and second["labels"] == first["labels"]


def test_cache_invalidated_by_its_inputs(tmp_path, tok):
    """The cache is invalidated by the file the tokenizer and the settings."""
    path = write_lines(tmp_path / "p.jsonl", [{"text": t} for t in texts()])
    entries = {build_pretrain_dataset(path, tok, 32).directory}

    def new_entry(dataset):
        assert dataset.from_cache is False and dataset.directory not in entries
        entries.add(dataset.directory)
        return dataset

    new_entry(build_pretrain_dataset(path, tok, 16))  # max length
    new_entry(build_pretrain_dataset(path, tok, 32, packed=False))  # packing mode
    new_entry(build_pretrain_dataset(path, tok, 32, skip_bad_lines=True))
    other = AutoTokenizer.from_pretrained(os.path.join(ROOT, "tokenizer"))
    other.add_tokens(["<extra>"])
    new_entry(build_pretrain_dataset(path, other, 32))  # tokenizer
    other = AutoTokenizer.from_pretrained(os.path.join(ROOT, "tokenizer"))
    other.chat_template = other.chat_template.replace("<|im_start|>", "<|im_start|> ", 1)
    new_entry(build_pretrain_dataset(path, other, 32))  # chat template
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    new_entry(build_pretrain_dataset(path, tok, 32))  # mtime
    with path.open("a") as f:
        f.write(json.dumps({"text": "One more story about the cat."}) + "\n")
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # same mtime as before, larger file
    changed = new_entry(build_pretrain_dataset(path, tok, 32))
    assert changed.meta["documents"] == len(texts()) + 1
    assert build_pretrain_dataset(path, tok, 32).from_cache is True


def test_failed_preparation_leaves_no_entry(tmp_path, tok, monkeypatch, data_cache):
    path = write_lines(tmp_path / "p.jsonl", [{"text": t} for t in texts()])
    original = minimind.data.store.RowWriter.close

    def killed(self, meta):
        original(self, meta)  # every file written, then the process dies before the entry is renamed into place
        raise KeyboardInterrupt

    monkeypatch.setattr(minimind.data.store.RowWriter, "close", killed)
    with pytest.raises(KeyboardInterrupt):
        build_pretrain_dataset(path, tok, 32)
    assert list(data_cache.iterdir()) == []  # nor a temporary directory
    monkeypatch.undo()
    os.environ["MINIMIND_CACHE"] = str(data_cache.parent)
    assert build_pretrain_dataset(path, tok, 32).from_cache is False


@pytest.mark.parametrize("num_proc", [1, 2])
def test_bad_line_mid_file_named_or_skipped(tmp_path, tok, caplog, num_proc):
    """A bad line mid file is named or skipped with exact counts."""
    documents = texts(150)
    lines = [{"text": t} for t in documents]
    bad = {40: "not json", 77: {"text": 3}, 130: {"txt": "typo"}}  # 0-based positions, in different chunks
    for at, line in bad.items():
        lines.insert(at, line)
    path = write_lines(tmp_path / "big.jsonl", lines)
    with pytest.raises(DataFormatError, match=r"big\.jsonl, line 41: invalid JSON"):
        build_pretrain_dataset(path, tok, 32, num_proc=num_proc, **SMALL_CHUNKS)
    with caplog.at_level(logging.WARNING, logger="minimind.data"):
        dataset = build_pretrain_dataset(path, tok, 32, skip_bad_lines=True, num_proc=num_proc, **SMALL_CHUNKS)
    assert f"skipped 3 bad line(s) in {path} (first: {path}, line 41: invalid JSON" in caplog.text
    assert dataset.meta["skipped_lines"] == 3 and dataset.meta["documents"] == len(documents)
    stream = reference_stream(tok, documents)  # every good line kept, in order
    assert [t for row in dataset["input_ids"] for t in row] == stream[: len(stream) // 32 * 32]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="minimind.data"):
        assert build_pretrain_dataset(path, tok, 32, skip_bad_lines=True).from_cache is True
    assert "skipped 3 bad line(s)" in caplog.text  # a cache hit still says what the data lacks


class _ChunkSizes:
    """An encoder for `map_chunks`: a chunk's first line number and its bytes. The process that gets the chunk
    holding line `kill_at` is killed, as the out-of-memory killer would."""

    def __init__(self, kill_at=None):
        self.kill_at = kill_at

    def __call__(self, first_line, lines):
        if self.kill_at is not None and first_line <= self.kill_at < first_line + len(lines):
            os.kill(os.getpid(), signal.SIGKILL)
        return types.SimpleNamespace(first_line=first_line, nbytes=sum(map(len, lines)))


@pytest.mark.timeout(120)  # a pass that waits forever for a dead process fails here instead of hanging the suite
def test_killed_process_stops_the_pass_in_one_line(tmp_path):
    """Two processes hand back the chunks in file order; when one is killed mid pass, the pass ends with an
    InputError naming the file and the fix, and no process is left behind; so does closing the pass early."""
    path = write_lines(tmp_path / "big.jsonl", [{"text": t} for t in texts(150)])
    firsts = [first for first, _ in read_chunks(path, 600)]
    assert len(firsts) > 8  # several rounds of two chunks in flight per process

    results = list(map_chunks(_ChunkSizes(), path, 2, Progress(path.stat().st_size, "test"), chunk_bytes=600))
    assert [r.first_line for r in results] == firsts
    assert sum(r.nbytes for r in results) == path.stat().st_size
    assert multiprocessing.active_children() == []

    passing = map_chunks(_ChunkSizes(kill_at=firsts[6]), path, 2, Progress(1, "test"), chunk_bytes=600)
    with pytest.raises(InputError) as raised:
        list(passing)
    assert str(raised.value) == (
        f"a process tokenising {path} ended without finishing its chunk (killed by the system, as when it runs out "
        "of memory); the pass stops and nothing of it is kept. Fix: free memory or pass a smaller --num_proc (this "
        "pass used 2)"
    )
    assert multiprocessing.active_children() == []

    passing = map_chunks(_ChunkSizes(), path, 2, Progress(1, "test"), chunk_bytes=600)
    assert next(passing).first_line == 1
    passing.close()
    assert multiprocessing.active_children() == []


def test_parallel_sft_bad_lines_and_chats(tmp_path, tok, caplog):
    """SFT bad lines and unrenderable chats in a parallel run."""
    rows = chats(40)
    opening_reply = {"conversations": [{"role": "assistant", "content": "Hi"}, *rows[0]["conversations"]]}
    lines = rows[:10] + ['{"conversations": [}'] + rows[10:30] + [opening_reply] + rows[30:]
    path = write_lines(tmp_path / "s.jsonl", lines)
    with pytest.raises(DataFormatError, match=r"s\.jsonl, line 11: invalid JSON"):
        build_sft_dataset(path, tok, 64, num_proc=2, **SMALL_CHUNKS)
    with caplog.at_level(logging.WARNING, logger="minimind.data"):
        dataset = build_sft_dataset(path, tok, 64, skip_bad_lines=True, num_proc=2, **SMALL_CHUNKS)
    assert "skipped 1 bad line(s)" in caplog.text and "skipped 1 more bad line(s)" in caplog.text
    assert "line 32: the chat template cannot render" in caplog.text
    assert dataset["input_ids"] == [e["input_ids"] for e in reference_chats(tok, rows, 64)]


def test_prepared_directory_is_a_data_path(tmp_path, tok):
    from minimind.training import DataArguments, load_datasets

    path = write_lines(tmp_path / "s.jsonl", chats())
    prepared = build_sft_dataset(path, tok, 64)
    train, held_out = load_datasets("sft", DataArguments(data_path=str(prepared.directory), eval_fraction=0.1), tok)
    again, again_held_out = load_datasets(
        "sft", DataArguments(data_path=str(path), max_seq_length=64, eval_fraction=0.1), tok
    )
    assert train["input_ids"] == again["input_ids"] and held_out["input_ids"] == again_held_out["input_ids"]
    with pytest.raises(DataFormatError, match="prepared sft data, not pretrain"):
        load_datasets("pretrain", DataArguments(data_path=str(prepared.directory)), tok)
    assert isinstance(train, TokenDataset) and train.directory == prepared.directory


def test_dpo_pairs_stream_into_arrow_files(tmp_path):
    pair = {
        "chosen": [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "good"}],
        "rejected": [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "bad"}],
    }
    path = write_lines(tmp_path / "dpo.jsonl", [pair, "", pair])
    dataset = build_dpo_dataset(path)
    assert dataset.cache_files and len(dataset) == 2  # memory-mapped Arrow, not an in-memory table
    assert dataset[1]["chosen"] == pair["chosen"] and dataset[1]["tools"] == "null"
    write_lines(path, [pair, '{"chosen": [}'])
    with pytest.raises(DataFormatError, match=r"dpo\.jsonl, line 2: invalid JSON"):
        build_dpo_dataset(path)
    assert len(build_dpo_dataset(path, skip_bad_lines=True)) == 1
    assert read_jsonl(path, "dpo", skip_bad_lines=True)[1] == 1
    write_lines(path, ["", '{"chosen": [}'])
    with pytest.raises(DataFormatError, match=r"dpo\.jsonl: no valid dpo examples \(all 1 non-blank line"):
        build_dpo_dataset(path, skip_bad_lines=True)


def test_prepare_command_and_prepare_only(tmp_path, capsys, data_cache):
    from minimind import cli

    path = write_lines(tmp_path / "p.jsonl", [{"text": t} for t in texts()])
    dataset = cli.prepare(["--data_path", str(path), "--max_seq_length", "32", "--num_proc", "2"])
    out = capsys.readouterr().out
    assert f"prepared: {dataset.directory} ({dataset.meta['tokens']:,} tokens, {len(dataset):,} rows)" in out
    assert "pretrain data: 120 documents" in out and f"cache: {dataset.directory}" in out
    assert dataset.directory.parent == data_cache

    trainer, metrics = cli.pretrain(
        ["--data_path", str(dataset.directory), "--max_seq_length", "32", "--output_dir", str(tmp_path / "out")]
        + ["--prepare_only", "--eval_fraction", "0.1", "--use_cpu", "--report_to", "none"]
    )
    assert trainer is None and metrics["data"] == str(dataset.directory)
    assert metrics["train_rows"] + metrics["eval_rows"] == len(dataset) and metrics["tokens"] == dataset.meta["tokens"]
    assert f"tokens={dataset.meta['tokens']}" in capsys.readouterr().out
    assert not (tmp_path / "out" / "model.safetensors").exists()


def test_split_holds_out_datasets_rows(tmp_path, tok):
    """split_train_eval holds out the rows datasets would."""
    from datasets import Dataset

    from minimind.data import split_train_eval

    path = write_lines(tmp_path / "s.jsonl", chats())
    rows = build_sft_dataset(path, tok, 64)
    in_memory = Dataset.from_dict({"input_ids": rows["input_ids"]})
    for ours, theirs in zip(split_train_eval(rows, 0.1, seed=5), split_train_eval(in_memory, 0.1, seed=5)):
        assert ours["input_ids"] == theirs["input_ids"]
    assert np.array_equal(rows.select([2, 0])[1]["input_ids"], rows[0]["input_ids"])
