"""Pretraining text to token rows.

Each text is wrapped as ``<|im_start|>`` + text + ``<|im_end|>`` (bos + text + eos, like upstream MiniMind).
Packed (the default), the texts are concatenated and cut into blocks of exactly ``max_seq_length`` tokens; only
the final remainder is dropped. Blocks may span document boundaries (standard packing; the eos token marks where
one text ends). Unpacked (padding-free training), each text is its own row, split into pieces of at most
``max_seq_length`` tokens (1-token pieces predict nothing and are dropped). ``labels == input_ids`` because the
model shifts labels internally.

The file is read in chunks that worker processes check and tokenise (`PretrainEncoder`); packing runs chunk by
chunk in file order, carrying the partial block over, into a flat token file (`write_pretrain`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import chain
from pathlib import Path

import numpy as np

from minimind.data.pipeline import Progress, map_chunks
from minimind.data.store import RowWriter, token_dtype
from minimind.data.validate import DataFormatError, SkipLog, _RowError, bad_line_message, no_rows_error, parse_line


def _rows(pieces: list[list[int]]) -> dict[str, list]:
    return {"input_ids": pieces, "labels": [list(p) for p in pieces], "attention_mask": [[1] * len(p) for p in pieces]}


def pack_sequences(batch: dict[str, list], length: int) -> dict[str, list]:
    """Concatenate ``batch["input_ids"]`` and cut into full blocks of ``length``; drop the remainder."""
    stream = list(chain.from_iterable(batch["input_ids"]))
    return _rows([stream[i : i + length] for i in range(0, len(stream) // length * length, length)])


def split_documents(batch: dict[str, list], length: int) -> dict[str, list]:
    """One row per document, long documents cut into pieces of at most ``length`` tokens. A 1-token piece is
    dropped: it predicts nothing."""
    pieces = [ids[i : i + length] for ids in batch["input_ids"] for i in range(0, len(ids), length)]
    return _rows([piece for piece in pieces if len(piece) > 1])


@dataclass
class Chunk:
    """One chunk's output: its size in bytes, documents, tokens (bos/eos included, before splitting), the token
    stream (packed) or the kept pieces and their lengths (unpacked), and the bad lines' messages."""

    nbytes: int
    documents: int = 0
    tokens: int = 0
    ids: np.ndarray | None = None
    lengths: np.ndarray | None = None
    bad: list[str] = field(default_factory=list)


@dataclass
class PretrainEncoder:
    path: str
    tokenizer: object
    max_seq_length: int
    packed: bool
    skip_bad_lines: bool
    dtype: np.dtype

    def __call__(self, first_lineno: int, lines: list[bytes]) -> Chunk:
        chunk = Chunk(nbytes=sum(map(len, lines)))
        texts = []
        for lineno, raw in enumerate(lines, start=first_lineno):
            try:
                row = parse_line(raw, lineno, "pretrain")
            except _RowError as error:
                chunk.bad.append(bad_line_message(self.path, lineno, error))
                if not self.skip_bad_lines:
                    break  # the run stops here: tokenising the rest would be wasted
                continue
            if row is not None:
                texts.append(row["text"])
        ids = _encode(self.tokenizer, texts) if texts else []
        bos, eos = [self.tokenizer.bos_token_id], [self.tokenizer.eos_token_id]
        lengths = np.fromiter((len(x) + 2 for x in ids), dtype=np.int64, count=len(ids))
        chunk.documents, chunk.tokens = len(ids), int(lengths.sum())
        stream = np.fromiter(
            chain.from_iterable(chain(bos, x, eos) for x in ids), dtype=self.dtype, count=chunk.tokens
        )
        if self.packed:
            chunk.ids = stream
        else:
            chunk.ids, chunk.lengths = _split(stream, lengths, self.max_seq_length)
        return chunk


def _encode(tokenizer, texts: list[str]) -> list[list[int]]:
    """``tokenizer(texts, add_special_tokens=False)["input_ids"]``, straight from the Rust tokenizer when there is
    one (no offsets, no BatchEncoding: a quarter faster)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or getattr(tokenizer, "split_special_tokens", False) or backend.truncation or backend.padding:
        return tokenizer(texts, add_special_tokens=False)["input_ids"]
    encode = getattr(backend, "encode_batch_fast", backend.encode_batch)
    return [encoding.ids for encoding in encode(texts, add_special_tokens=False)]


def _split(stream: np.ndarray, lengths: np.ndarray, length: int) -> tuple[np.ndarray, np.ndarray]:
    """Each document cut into pieces of at most ``length``; 1-token pieces dropped (with their token)."""
    pieces, keep = [], np.ones(len(stream), dtype=bool)
    start = 0
    for n in lengths.tolist():
        for lo in range(0, n, length):
            piece = min(length, n - lo)
            if piece > 1:
                pieces.append(piece)
            else:
                keep[start + lo] = False
        start += n
    return (stream if keep.all() else stream[keep]), np.asarray(pieces, dtype=np.int64)


def write_pretrain(
    directory: Path,
    path: Path,
    tokenizer,
    max_seq_length: int,
    packed: bool,
    skip_bad_lines: bool,
    num_proc: int,
    **kw,
) -> dict:
    """Check, tokenise and pack/split ``path`` into ``directory``'s flat files; returns the meta (counts)."""
    dtype = token_dtype(len(tokenizer))
    encoder = PretrainEncoder(str(path), tokenizer, max_seq_length, packed, skip_bad_lines, dtype)
    writer = RowWriter(directory, dtype)
    skips = SkipLog(path, skip_bad_lines)
    progress = Progress(path.stat().st_size, "tokenising pretrain text")
    documents = tokens = 0
    carry = np.zeros(0, dtype=dtype)
    results = map_chunks(encoder, path, num_proc, progress, **kw)
    try:
        for chunk in results:
            for message in chunk.bad:
                skips.add(message)  # raises without --skip_bad_lines
            documents, tokens = documents + chunk.documents, tokens + chunk.tokens
            if packed:
                stream = np.concatenate([carry, chunk.ids])
                full = len(stream) // max_seq_length * max_seq_length
                writer.add_blocks(stream[:full], max_seq_length)
                carry = stream[full:]
            else:
                writer.add_rows(chunk.ids, chunk.lengths)
    finally:
        results.close()
        progress.close()
    warnings = [] if not skips.count else [f"skipped {skips.count} bad line(s) in {path} (first: {skips.first})"]
    skips.warn()
    if documents == 0:
        raise no_rows_error(path, "pretrain", skips.count)
    if writer.n_rows == 0:
        raise DataFormatError(
            f"{path}: only {tokens} tokens, fewer than max_seq_length={max_seq_length}, so not one "
            "training block can be made. Fix: lower max_seq_length or add more text."
        )
    return writer.close(
        {
            "kind": "pretrain",
            "block": max_seq_length if packed else None,
            "documents": documents,
            "tokens": tokens,
            "dropped_tokens": tokens - writer.n_tokens,
            "skipped_lines": skips.count,
            "warnings": warnings,
            "bytes": progress.done,
            "seconds": round(progress.seconds, 3),
            "num_proc": num_proc,
        }
    )


def build_pretrain_dataset(
    path: str | Path,
    tokenizer,
    max_seq_length: int,
    skip_bad_lines: bool = False,
    packed: bool = True,
    **options,
):
    """Pretraining rows (input_ids, labels, attention_mask): packed blocks of exactly ``max_seq_length`` tokens
    spanning documents, or (``packed=False``) one row per document of at most ``max_seq_length`` tokens. A
    memory-mapped `TokenDataset`, tokenised once and cached (``options``: see `minimind.data.prepare_rows`)."""
    from minimind.data.prepare import prepare_rows

    return prepare_rows(
        "pretrain", path, tokenizer, max_seq_length, skip_bad_lines=skip_bad_lines, packed=packed, **options
    )
