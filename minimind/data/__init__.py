"""Validated loading of MiniMind's JSONL training files into tokenised, cached, memory-mapped datasets.

Every name is importable from here; each lives in the module that does its job:

- `validate`: the row checks and the line-numbered reader (`read_jsonl`, `iter_rows`, `DataFormatError`): a bad
  line stops a run with the file, the line, the problem and a fix, or is counted by ``--skip_bad_lines``.
- `pipeline`: the streaming pass: the file in chunks of lines, checked and tokenised by ``num_proc`` processes,
  results in file order, a progress bar in MB/s.
- `pretrain`: text to packed blocks (or, padding-free, documents), packed chunk by chunk
  (`build_pretrain_dataset`).
- `sft`: chats to rows with assistant-only labels (`encode_chat`, `build_sft_dataset`).
- `store`: the flat token files and `TokenDataset`, the memory-mapped dataset the Trainer reads.
- `cache`: the cache root and the key (file identity, tokenizer, settings, format version); atomic entries.
- `prepare`: tokenise once (`prepare_rows`, `build_dataset`), open a prepared directory, DPO pairs in Arrow.
- `collate`: batches (`collator`) and the train/eval split (`split_train_eval`).
"""

from minimind.data.cache import FORMAT_VERSION, cache_key, cache_root, tokenizer_fingerprint
from minimind.data.collate import collator, split_train_eval
from minimind.data.pipeline import CHUNK_BYTES, available_cores
from minimind.data.prepare import (
    build_dataset,
    build_dpo_dataset,
    is_prepared,
    open_prepared,
    prepare_rows,
    summary,
)
from minimind.data.pretrain import build_pretrain_dataset, pack_sequences, split_documents
from minimind.data.sft import DROPPED_LINES_SHOWN, build_sft_dataset, encode_chat
from minimind.data.store import IGNORE_INDEX, TokenDataset, token_dtype
from minimind.data.validate import (
    _EXAMPLES,
    KINDS,
    MAX_NESTING,
    ROLES,
    DataFormatError,
    SkipLog,
    _read_numbered_rows,
    iter_rows,
    no_rows_error,
    read_jsonl,
)

__all__ = [
    "CHUNK_BYTES",
    "DROPPED_LINES_SHOWN",
    "FORMAT_VERSION",
    "IGNORE_INDEX",
    "KINDS",
    "MAX_NESTING",
    "ROLES",
    "_EXAMPLES",
    "DataFormatError",
    "SkipLog",
    "TokenDataset",
    "_read_numbered_rows",
    "available_cores",
    "build_dataset",
    "build_dpo_dataset",
    "build_pretrain_dataset",
    "build_sft_dataset",
    "cache_key",
    "cache_root",
    "collator",
    "encode_chat",
    "is_prepared",
    "iter_rows",
    "no_rows_error",
    "open_prepared",
    "pack_sequences",
    "prepare_rows",
    "read_jsonl",
    "split_documents",
    "split_train_eval",
    "summary",
    "token_dtype",
    "tokenizer_fingerprint",
]
