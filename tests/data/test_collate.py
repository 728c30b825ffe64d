"""minimind.data.collate: padded and padding-free batches, the train/eval split."""

import pytest
from data_files import *  # noqa: F403 (the fixtures data_cache, tok)
from data_files import GOOD, chat, write_lines

from minimind.data import IGNORE_INDEX, build_pretrain_dataset, build_sft_dataset, collator, split_train_eval


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
def test_padding_free_batch_is_one_row(tmp_path, tok, kind):
    """Padding free batch is one row with restarting positions."""
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
