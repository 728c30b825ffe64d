"""Tokenise once, train many times: a data file becomes a cached, memory-mapped `TokenDataset` (pretrain, SFT),
or a `datasets.Dataset` in Arrow files on disk (DPO pairs, which TRL tokenises).

`prepare_rows` looks the file up in the cache (`minimind.data.cache`) and tokenises it only on a miss, in
parallel (``num_proc``, default: every available core), into a temporary directory renamed into place when
complete. ``--data_path`` may also name such a directory directly (`open_prepared`): what `minimind-prepare`
printed.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from minimind.data.cache import atomic_directory, cache_key, cache_root, entry_dir, file_identity, lookup
from minimind.data.pipeline import CHUNK_BYTES, available_cores
from minimind.data.store import TokenDataset, read_meta
from minimind.data.validate import DataFormatError, SkipLog, check_data_path, iter_rows, no_rows_error

logger = logging.getLogger(__name__)


def is_prepared(path) -> bool:
    """Whether ``path`` is a directory that `prepare_rows` wrote (a cache entry or a copy of one)."""
    return path is not None and Path(path).is_dir() and read_meta(path) is not None


def open_prepared(path, kind: str, max_seq_length: int | None = None) -> TokenDataset:
    """The rows of a prepared directory, checked to be of ``kind``; a different ``max_seq_length`` is reported
    (the rows keep the length they were prepared with)."""
    dataset = TokenDataset(path)
    meta = dataset.meta
    if meta.get("kind") != kind:
        raise DataFormatError(
            f"{path}: prepared {meta.get('kind')} data, not {kind}. Fix: pass a {kind} file or prepare one with "
            f"minimind-prepare --kind {kind}."
        )
    prepared_length = meta.get("key", {}).get("max_seq_length")
    if max_seq_length is not None and prepared_length not in (None, max_seq_length):
        logger.warning(
            "%s was prepared with max_seq_length=%s; its rows keep that length (not %s)",
            path,
            prepared_length,
            max_seq_length,
        )
    dataset.from_cache = True
    return dataset


def summary(meta: dict, directory, cached: bool) -> str:
    """The one line each preparation ends with (and a cache hit starts with)."""
    rows = f"{meta['rows']:,} blocks of {meta['block']}" if meta.get("block") else f"{meta['rows']:,} rows"
    dropped_rows = f", {meta['dropped_rows']:,} chats dropped" if meta.get("dropped_rows") else ""
    how = (
        "cached"
        if cached
        else f"tokenised in {meta['seconds']:.1f} s, {meta['bytes'] / 1e6 / max(meta['seconds'], 1e-9):.2f} MB/s "
        f"on {meta['num_proc']} process(es)"
    )
    return (
        f"{meta['kind']} data: {meta['documents']:,} {'documents' if meta['kind'] == 'pretrain' else 'chats'}, "
        f"{meta['tokens']:,} tokens, {rows}, {meta['dropped_tokens']:,} tokens dropped"
        f"{dropped_rows}; {how}; "
        f"cache: {directory}"
    )


def prepare_rows(
    kind: str,
    path,
    tokenizer,
    max_seq_length: int,
    skip_bad_lines: bool = False,
    packed: bool = True,
    data_cache_dir=None,
    num_proc: int | None = None,
    chunk_bytes: int = CHUNK_BYTES,
) -> TokenDataset:
    """The `TokenDataset` of a pretrain or sft file, from the cache when an entry for exactly this file, tokenizer
    and settings exists, else tokenised now (``num_proc`` processes) and cached under ``data_cache_dir`` (see
    `minimind.data.cache.cache_root`). ``path`` may be a prepared directory. The dataset's ``from_cache`` says
    whether anything was tokenised."""
    if is_prepared(path):
        return open_prepared(path, kind, max_seq_length)
    path = check_data_path(path, kind)
    key = cache_key(kind, path, tokenizer, max_seq_length, packed, skip_bad_lines)
    directory = entry_dir(cache_root(data_cache_dir), key)
    meta = lookup(directory, key)
    if meta is not None:
        for warning in meta.get("warnings", []):
            logger.warning("%s (when it was prepared)", warning)
        dataset = TokenDataset(directory)
        dataset.from_cache = True
        logger.info("%s", summary(meta, directory, cached=True))
        return dataset
    if kind == "pretrain":
        from minimind.data.pretrain import write_pretrain as write

        options = dict(packed=packed)
    else:
        from minimind.data.sft import write_sft as write

        options = {}
    num_proc = num_proc or available_cores()
    with atomic_directory(directory) as temporary:
        meta = write(
            temporary, path, tokenizer, max_seq_length, skip_bad_lines=skip_bad_lines, num_proc=num_proc,
            chunk_bytes=chunk_bytes, **options,
        )  # fmt: skip
        # the key goes in last: only a complete entry has it
        (temporary / "meta.json").write_text(json.dumps({**meta, "key": key}, indent=1) + "\n", encoding="utf-8")
    logger.info("%s", summary(meta, directory, cached=False))
    dataset = TokenDataset(directory)
    dataset.from_cache = False
    return dataset


def build_dataset(
    kind: str,
    path,
    tokenizer,
    max_seq_length: int,
    skip_bad_lines: bool = False,
    padding_free: bool = False,
    **options,
) -> TokenDataset:
    """Tokenised rows of a pretrain or sft file (or prepared directory); padding-free pretraining keeps documents
    apart. ``options``: `prepare_rows`'s ``data_cache_dir``, ``num_proc``."""
    if kind not in ("pretrain", "sft"):
        raise ValueError(f"kind must be 'pretrain' or 'sft', got {kind!r} (DPO pairs are tokenised by TRL)")
    packed = {"packed": not padding_free} if kind == "pretrain" else {}
    return prepare_rows(kind, path, tokenizer, max_seq_length, skip_bad_lines=skip_bad_lines, **packed, **options)


def build_dpo_dataset(path, skip_bad_lines: bool = False, data_cache_dir=None):
    """The checked DPO pairs as a `datasets.Dataset` (chosen, rejected, tools as a JSON string), written to Arrow
    files under the cache root's dpo/ one line at a time and memory-mapped, never a list of the whole file. The
    generator's arguments carry the file's identity, so a changed file is read again."""
    from datasets import Dataset

    path = check_data_path(path, "dpo")
    identity = {"file": file_identity(path), "skip_bad_lines": skip_bad_lines}
    skips = SkipLog(path, skip_bad_lines)
    seen = [0]

    def pairs(path, identity):
        for _, row in iter_rows(path, "dpo", skips):
            seen[0] += 1
            # Tools as a JSON string: TRL parses it back; as a column of nested structs Arrow would merge its keys.
            yield {"chosen": row["chosen"], "rejected": row["rejected"], "tools": json.dumps(row.get("tools") or None)}

    try:
        dataset = Dataset.from_generator(
            pairs,
            gen_kwargs={"path": str(path), "identity": identity},
            cache_dir=str(cache_root(data_cache_dir) / "dpo"),
        )
    except Exception as error:  # datasets wraps the generator's exceptions
        cause = error
        while cause is not None and not isinstance(cause, DataFormatError):
            cause = cause.__cause__ or cause.__context__
        if cause is not None:
            raise cause from None
        if seen[0] == 0:  # Arrow cannot write a table of no rows
            raise no_rows_error(path, "dpo", skips.count) from None
        raise
    skips.warn()
    if len(dataset) == 0:
        raise no_rows_error(path, "dpo", skips.count)
    return dataset
