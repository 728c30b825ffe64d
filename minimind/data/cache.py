"""Where tokenised data is kept between runs, and under which key.

The key is everything that determines the result: the data file's identity (resolved path, size, modification
time), the tokenizer's content (its vocabulary and merges, special ids and chat template), the data kind, the
length limit, packed or not, --skip_bad_lines, and `FORMAT_VERSION` (raised whenever the files or the rules
that make them change). Any change gives a new key, so a stale cache is never read.

The root is ``--data_cache_dir``, else ``$MINIMIND_CACHE/data``, else ``~/.cache/minimind/data``. An entry is
written into a temporary directory beside it and renamed into place only once complete (meta.json last), so a
run killed while tokenising leaves nothing that a later run would take for a cache.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

from minimind.data.store import read_meta

FORMAT_VERSION = 1


def cache_root(data_cache_dir: str | Path | None = None) -> Path:
    if data_cache_dir:
        return Path(data_cache_dir).expanduser()
    if os.environ.get("MINIMIND_CACHE"):
        return Path(os.environ["MINIMIND_CACHE"]).expanduser() / "data"
    return Path("~/.cache/minimind/data").expanduser()


def tokenizer_fingerprint(tokenizer) -> str:
    """A hash of what the tokenizer does to text: its whole tokenizer.json content, special ids, chat template."""
    backend = getattr(tokenizer, "backend_tokenizer", None) or getattr(tokenizer, "_tokenizer", None)
    parts = [
        type(tokenizer).__name__,
        backend.to_str() if backend is not None else repr(tokenizer),
        repr((tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id, len(tokenizer))),
        tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else json.dumps(tokenizer.chat_template),
    ]
    return hashlib.sha256("\0".join(parts).encode("utf-8", "surrogatepass")).hexdigest()


def file_identity(path: str | Path) -> dict:
    path = Path(path).resolve()
    stat = path.stat()
    return {"path": str(path), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}


def cache_key(kind: str, path, tokenizer, max_seq_length: int, packed: bool, skip_bad_lines: bool) -> dict:
    return {
        "format_version": FORMAT_VERSION,
        "kind": kind,
        "file": file_identity(path),
        "tokenizer": tokenizer_fingerprint(tokenizer),
        "max_seq_length": max_seq_length,
        "packed": packed if kind == "pretrain" else None,
        "skip_bad_lines": skip_bad_lines,
    }


def entry_dir(root: Path, key: dict) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
    stem = "".join(c if c.isalnum() or c in "-_." else "_" for c in Path(key["file"]["path"]).stem)[:40]
    return root / f"{key['kind']}-{stem}-{digest}"


def lookup(directory: Path, key: dict) -> dict | None:
    """The entry's meta if it is complete and made under exactly this key, else None."""
    meta = read_meta(directory)
    return meta if meta is not None and meta.get("key") == key else None


@contextlib.contextmanager
def atomic_directory(final: Path):
    """Yield a fresh temporary directory beside ``final``; on success rename it to ``final`` (another process that
    finished the same entry first wins, and ours is dropped); on any error remove it."""
    final.parent.mkdir(parents=True, exist_ok=True)
    temporary = Path(tempfile.mkdtemp(prefix=f".tmp-{final.name}-", dir=final.parent))
    try:
        yield temporary
        with contextlib.suppress(OSError):  # fails only if another process renamed its own entry there first
            os.rename(temporary, final)
    finally:
        if temporary.exists():
            shutil.rmtree(temporary, ignore_errors=True)
