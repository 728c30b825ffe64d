"""Tokenised rows on disk, in flat files that training memory-maps: the writer the builders fill chunk by chunk,
and `TokenDataset`, the map-style dataset the Trainer reads.

A prepared directory holds

* ``tokens.bin``: every row's token ids back to back, uint16 when the vocabulary fits (MiniMind's 6,400 tokens),
  else uint32;
* ``offsets.bin`` (int64, rows + 1 entries): where each row starts, for rows of varying length (SFT chats,
  padding-free documents); packed pretraining blocks all have ``block`` tokens and need none;
* ``targets.bin`` (uint8, one per token, SFT only): 1 where the token is trained (its label is the token), 0 where
  its label is -100;
* ``meta.json``: what the rows are and what made them (written last: a directory without it is not a cache).

Nothing is held in memory but the row being read, so a corpus of any size costs the same RSS.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

IGNORE_INDEX = -100
META = "meta.json"
COLUMNS = ("input_ids", "labels", "attention_mask")


def token_dtype(vocab_size: int) -> np.dtype:
    """The narrowest unsigned integer that holds every token id."""
    return np.dtype(np.uint16 if vocab_size <= 2**16 else np.uint32)


class RowWriter:
    """Appends rows to a directory's flat files: `add_rows` for rows of varying length, `add_blocks` for fixed-size
    blocks (then no offsets are written)."""

    def __init__(self, directory: str | Path, dtype: np.dtype, targets: bool = False):
        self.directory, self.dtype = Path(directory), np.dtype(dtype)
        self.tokens = open(self.directory / "tokens.bin", "wb")
        self.targets = open(self.directory / "targets.bin", "wb") if targets else None
        self.ends: list[np.ndarray] = []  # cumulative row ends, one array per chunk (8 bytes a row)
        self.n_tokens = 0
        self.n_rows = 0

    def add_blocks(self, tokens: np.ndarray, block: int) -> None:
        self.tokens.write(tokens.astype(self.dtype, copy=False).tobytes())
        self.n_tokens += len(tokens)
        self.n_rows += len(tokens) // block

    def add_rows(self, tokens: np.ndarray, lengths: np.ndarray, targets: np.ndarray | None = None) -> None:
        self.tokens.write(tokens.astype(self.dtype, copy=False).tobytes())
        if self.targets is not None:
            self.targets.write(targets.astype(np.uint8, copy=False).tobytes())
        self.ends.append(self.n_tokens + np.cumsum(lengths, dtype=np.int64))
        self.n_tokens += int(np.sum(lengths, dtype=np.int64))
        self.n_rows += len(lengths)

    def close(self, meta: dict) -> dict:
        """Flush everything; write offsets (if any rows had them) and meta.json last. Returns the meta."""
        self.tokens.close()
        if self.targets is not None:
            self.targets.close()
        if self.ends or meta.get("block") is None:
            offsets = np.concatenate([np.zeros(1, np.int64), *self.ends])
            offsets.tofile(self.directory / "offsets.bin")
        meta = {**meta, "rows": self.n_rows, "stored_tokens": self.n_tokens, "dtype": self.dtype.name}
        (self.directory / META).write_text(json.dumps(meta, indent=1) + "\n", encoding="utf-8")
        return meta


def read_meta(directory: str | Path) -> dict | None:
    path = Path(directory) / META
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


class TokenDataset(torch.utils.data.Dataset):
    """The rows of a prepared directory, memory-mapped: ``dataset[i]`` is ``{"input_ids", "labels",
    "attention_mask"}`` (lists of ints, as a `datasets.Dataset` of the same rows gives), ``dataset["input_ids"]``
    a column. `select` makes a view on some rows (the train/eval split); nothing is copied. Pickles without its
    data (DataLoader workers reopen the files)."""

    column_names = list(COLUMNS)

    def __init__(self, directory: str | Path, indices: np.ndarray | None = None):
        self.directory = Path(directory)
        self.meta = read_meta(self.directory)
        if self.meta is None:
            raise FileNotFoundError(f"{self.directory}: no {META}; not a prepared data directory")
        self.indices = None if indices is None else np.asarray(indices, dtype=np.int64)
        self._arrays = None

    # -- files --------------------------------------------------------------------------------------------------

    def _open(self):
        if self._arrays is None:
            meta, d = self.meta, self.directory
            tokens = np.memmap(d / "tokens.bin", dtype=meta["dtype"], mode="r") if meta["stored_tokens"] else None
            offsets = np.fromfile(d / "offsets.bin", dtype=np.int64) if (d / "offsets.bin").exists() else None
            targets = np.memmap(d / "targets.bin", dtype=np.uint8, mode="r") if (d / "targets.bin").exists() else None
            self._arrays = tokens, offsets, targets
        return self._arrays

    def __getstate__(self):
        return {**self.__dict__, "_arrays": None}

    # -- rows ---------------------------------------------------------------------------------------------------

    def __len__(self) -> int:
        return self.meta["rows"] if self.indices is None else len(self.indices)

    def _row(self, i: int) -> dict[str, list[int]]:
        if not -len(self) <= i < len(self):
            raise IndexError(f"row {i} of {len(self)}")
        i = i % len(self)
        if self.indices is not None:
            i = int(self.indices[i])
        tokens, offsets, targets = self._open()
        if offsets is None:
            block = self.meta["block"]
            lo, hi = i * block, (i + 1) * block
        else:
            lo, hi = int(offsets[i]), int(offsets[i + 1])
        ids = tokens[lo:hi].astype(np.int64)
        if targets is None:
            labels = ids
        else:
            labels = np.where(targets[lo:hi].astype(bool), ids, IGNORE_INDEX)
        ids = ids.tolist()
        return {"input_ids": ids, "labels": labels.tolist(), "attention_mask": [1] * len(ids)}

    def __getitem__(self, key):
        if isinstance(key, str):
            if key not in COLUMNS:
                raise KeyError(key)
            return [self._row(i)[key] for i in range(len(self))]
        if isinstance(key, slice):
            return [self._row(i) for i in range(len(self))[key]]
        return self._row(int(key))

    def __iter__(self):
        return (self._row(i) for i in range(len(self)))

    def select(self, indices) -> TokenDataset:
        """A view on the rows at ``indices`` (positions in this dataset)."""
        indices = np.asarray(list(indices) if not isinstance(indices, np.ndarray) else indices, dtype=np.int64)
        if self.indices is not None:
            indices = self.indices[indices]
        return TokenDataset(self.directory, indices)

    def num_tokens(self) -> int:
        """Real (non-padding) tokens in these rows."""
        _, offsets, _ = self._open()
        if offsets is None:
            return len(self) * self.meta["block"]
        lengths = np.diff(offsets)
        return int(lengths.sum() if self.indices is None else lengths[self.indices].sum())

    def __repr__(self) -> str:
        return f"TokenDataset({str(self.directory)!r}, rows={len(self)}, kind={self.meta.get('kind')!r})"
