"""Batching and the train/eval split.

`collator` turns rows into batches: padded per batch, or padding-free (a batch's rows concatenated into one,
positions restarting at each row). `split_train_eval` holds out a share of the rows, the same rows for a
`TokenDataset` as for a `datasets.Dataset` of the same length and seed.
"""

from __future__ import annotations

import numpy as np

from minimind.data.store import IGNORE_INDEX, TokenDataset


def collator(kind: str, tokenizer, padding_free: bool = False):
    """The data collator for ``kind`` rows.

    Padding-free: the batch's rows concatenated into one row of shape [1, total tokens] with ``position_ids``
    restarting at 0 for each row and no padding tokens (transformers' DataCollatorWithFlattening); the first
    label of each row becomes -100, so no row is trained to predict the next one.  Otherwise packed pretraining
    blocks stack as they are, and chats are right-padded per batch: input_ids with the pad id, attention_mask
    with 0, labels with -100 (DataCollatorForSeq2Seq does exactly that for decoder-only rows too).
    """
    from transformers import DataCollatorForSeq2Seq, DataCollatorWithFlattening, default_data_collator

    if padding_free:
        return DataCollatorWithFlattening(return_position_ids=True, separator_id=IGNORE_INDEX)
    if kind == "pretrain":
        return default_data_collator
    return DataCollatorForSeq2Seq(tokenizer, padding=True, label_pad_token_id=IGNORE_INDEX, return_tensors="pt")


def split_train_eval(dataset, eval_fraction: float, seed: int = 42):
    """Shuffle and hold out ``eval_fraction`` of rows (at least one) for evaluation.

    ``eval_fraction == 0`` returns ``(dataset, None)``.  Raises ValueError if
    the split would leave the training or the eval side empty.
    """
    if not 0 <= eval_fraction < 1:
        raise ValueError(f"eval_fraction must be in [0, 1), got {eval_fraction}")
    if eval_fraction == 0:
        return dataset, None
    n_eval = max(1, round(len(dataset) * eval_fraction))
    if n_eval >= len(dataset):
        raise ValueError(
            f"cannot hold out {n_eval} eval example(s) from a dataset of {len(dataset)}; "
            "add data or set eval_fraction to 0"
        )
    if isinstance(dataset, TokenDataset):
        # The permutation datasets' train_test_split draws, so a split is the same whichever kind holds the rows.
        permutation = np.random.default_rng(seed).permutation(len(dataset))
        return dataset.select(permutation[n_eval:]), dataset.select(permutation[:n_eval])
    split = dataset.train_test_split(test_size=n_eval, seed=seed, shuffle=True)
    return split["train"], split["test"]
