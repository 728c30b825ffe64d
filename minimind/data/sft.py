"""Chats (SFT) to token rows with assistant-only labels.

Chat rows are rendered with the tokenizer's chat template. Only assistant replies are trained: the reply's tokens
and its closing ``<|im_end|>`` get real labels, everything else (system/user/tool turns, the
``<|im_start|>assistant\\n`` header, the newline after ``<|im_end|>``) is -100. Rows are truncated to
``max_seq_length`` but not padded. Rows whose assistant tokens are all cut off are dropped, with a warning that
counts them and names their first lines.

Worker processes check and encode chunks of the file (`SFTEncoder`); the rows go to flat files in file order
(`write_sft`): the tokens, and one byte per token saying whether it is trained.
"""

from __future__ import annotations

import logging
from bisect import bisect_left
from dataclasses import dataclass, field
from itertools import chain
from pathlib import Path

import numpy as np

from minimind.data.pipeline import Progress, map_chunks
from minimind.data.store import IGNORE_INDEX, RowWriter, token_dtype
from minimind.data.validate import (
    _SKIP_HINT,
    DataFormatError,
    SkipLog,
    _RowError,
    bad_line_message,
    no_rows_error,
    parse_line,
)
from minimind.tokenizer import plan_conversation, render_conversation, tokenize_as_text

logger = logging.getLogger(__name__)

DROPPED_LINES_SHOWN = 5


def _render(tokenizer, messages: list[dict], tools: list | None, add_generation_prompt: bool) -> str:
    return "".join(text for text, _ in render_conversation(tokenizer, messages, tools, add_generation_prompt))


def encode_chat(
    tokenizer,
    messages: list[dict],
    tools: list[dict] | None = None,
    max_seq_length: int | None = None,
) -> dict[str, list[int]]:
    """Tokenise one conversation; labels are -100 except assistant replies (reasoning included) and their
    ``<|im_end|>``.

    Tokenisation is ``minimind.tokenizer.encode_conversation``'s: special tokens inside message text become
    ordinary tokens, as at chat time.  The reply spans are found in the rendered text: rendering the messages
    before an assistant turn with ``add_generation_prompt=True`` gives exactly the text up to the start of its
    reply (the template is prefix-stable), and the reply ends with the next ``<|im_end|>`` token, which can
    only be the template's.  A token counts as part of a reply when it starts inside it; so if a reply begins
    with a newline that BPE merges with the header's newline, that first newline is not trained (harmless edge
    case).
    """
    (input_ids, targets), *_ = label_chats(tokenizer, [plan_chat(tokenizer, messages, tools)], max_seq_length)
    labels = [token if trained else IGNORE_INDEX for token, trained in zip(input_ids, targets)]
    return {"input_ids": input_ids, "labels": labels, "attention_mask": [1] * len(input_ids)}


def plan_chat(tokenizer, messages: list[dict], tools: list[dict] | None = None):
    """What `encode_chat` renders (raises what the chat template raises): the conversation's text segments (see
    `minimind.tokenizer.plan_conversation`), and where each assistant reply starts in the rendered text."""
    pieces, segments = plan_conversation(tokenizer, messages, tools)
    text = "".join(piece for piece, _ in pieces)
    starts = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        prefix = _render(tokenizer, messages[:i], tools, add_generation_prompt=True)
        if not text.startswith(prefix):
            raise ValueError("the tokenizer's chat template is not prefix-stable; cannot locate assistant replies")
        starts.append(len(prefix))
    return segments, starts


def label_chats(tokenizer, plans: list, max_seq_length: int | None = None) -> list[tuple[list[int], bytearray]]:
    """Each `plan_chat` result's token ids and one flag per token (1: trained), truncated to ``max_seq_length``;
    one tokenizer call for all of them. Raises ValueError for a reply that no ``<|im_end|>`` closes.

    Tokens are labelled run by run (the text between two markers is tokenised on its own): a run inside a reply
    or outside every reply is labelled whole, and only a run where a reply starts or ends is looked at token by
    token."""
    runs = [text for segments, _ in plans for _, text, is_marker in segments if not is_marker]
    encoded = iter(zip(*tokenize_as_text(tokenizer, runs)))
    eos, marker_ids, rows = tokenizer.eos_token, {}, []
    for segments, starts in plans:
        eos_ends = [start + len(text) for start, text, is_marker in segments if is_marker and text == eos]
        spans = []
        for start in starts:
            ends = [end for end in eos_ends if end > start]
            if not ends:
                raise ValueError(f"the assistant reply at character {start} has no closing {eos}")
            spans.append((start, ends[0]))
        input_ids, targets = [], bytearray()
        for start, text, is_marker in segments:
            if is_marker:
                if text not in marker_ids:
                    marker_ids[text] = tokenizer.convert_tokens_to_ids(text)
                input_ids.append(marker_ids[text])
                targets.append(any(lo <= start < hi for lo, hi in spans))
                continue
            ids, offsets = next(encoded)
            input_ids += ids
            end = start + len(text)
            if any(lo <= start and end <= hi for lo, hi in spans):
                targets += b"\x01" * len(ids)
            elif not any(lo < end and start < hi for lo, hi in spans):
                targets += bytes(len(ids))
            else:  # a reply starts or ends inside this run: its tokens from the first that starts inside it
                firsts, flags = [start + a for a, _ in offsets], bytearray(len(ids))
                for lo, hi in spans:
                    i, j = bisect_left(firsts, lo), bisect_left(firsts, hi)
                    flags[i:j] = b"\x01" * (j - i)
                targets += flags
        if max_seq_length is not None:
            input_ids, targets = input_ids[:max_seq_length], targets[:max_seq_length]
        rows.append((input_ids, targets))
    return rows


@dataclass
class Chunk:
    """One chunk's output: its size, valid rows, renderable rows, the kept rows (tokens, trained-token flags,
    lengths), the lines of rows dropped by truncation, and the messages of bad lines ("invalid": the checks;
    "unrenderable": the chat template)."""

    nbytes: int
    valid: int = 0
    renderable: int = 0
    ids: np.ndarray | None = None
    targets: np.ndarray | None = None
    lengths: np.ndarray | None = None
    dropped: list[int] = field(default_factory=list)
    bad: list[tuple[str, str]] = field(default_factory=list)


@dataclass
class SFTEncoder:
    path: str
    tokenizer: object
    max_seq_length: int
    skip_bad_lines: bool
    dtype: np.dtype

    def __call__(self, first_lineno: int, lines: list[bytes]) -> Chunk:
        from jinja2 import TemplateError

        errors = (TemplateError, ValueError, TypeError, KeyError, IndexError, RecursionError)
        chunk = Chunk(nbytes=sum(map(len, lines)))
        bad: list[tuple[int, str, str]] = []
        planned: list[tuple[int, tuple]] = []
        for lineno, raw in enumerate(lines, start=first_lineno):
            try:
                row = parse_line(raw, lineno, "sft")
            except _RowError as error:
                bad.append((lineno, "invalid", bad_line_message(self.path, lineno, error)))
                if not self.skip_bad_lines:
                    break
                continue
            if row is None:
                continue
            chunk.valid += 1
            try:
                planned.append((lineno, plan_chat(self.tokenizer, row["conversations"], row.get("tools") or [])))
            except errors as error:
                bad.append((lineno, "unrenderable", self._unrenderable(lineno, error)))
                if not self.skip_bad_lines:
                    break
        # One tokenizer call for the whole chunk's chats (each text is still tokenised on its own).
        rows = []
        try:
            rows = label_chats(self.tokenizer, [plan for _, plan in planned], self.max_seq_length)
        except ValueError:  # a reply without its closing marker: find which lines, one by one
            for lineno, plan in planned:
                try:
                    rows += label_chats(self.tokenizer, [plan], self.max_seq_length)
                except ValueError as error:
                    bad.append((lineno, "unrenderable", self._unrenderable(lineno, error)))
                    rows.append(None)
        kept = []
        for (lineno, _), row in zip(planned, rows):
            if row is None:
                continue
            chunk.renderable += 1
            if any(row[1]):
                kept.append(row)
            else:
                chunk.dropped.append(lineno)
        chunk.bad = [(category, message) for _, category, message in sorted(bad)]
        chunk.lengths = np.fromiter((len(ids) for ids, _ in kept), dtype=np.int64, count=len(kept))
        total = int(chunk.lengths.sum())
        chunk.ids = np.fromiter(chain.from_iterable(ids for ids, _ in kept), self.dtype, count=total)
        chunk.targets = np.frombuffer(b"".join(targets for _, targets in kept), dtype=np.uint8).copy()
        return chunk

    def _unrenderable(self, lineno: int, error: Exception) -> str:
        # A row that passed validation but that the chat template refuses (e.g. one that opens with the
        # assistant's reply): still this line's problem, named with its number, not a traceback.
        return (
            f"{self.path}, line {lineno}: the chat template cannot render this conversation "
            f"({type(error).__name__}: {' '.join(str(error).split())}). Fix: check the order of the "
            f"roles (open with a system or user message), {_SKIP_HINT}."
        )


def _drop_warning(path, kind: str, total: int, dropped: list[int], n_dropped: int, max_seq_length: int) -> str:
    shown = ", ".join(map(str, dropped[:DROPPED_LINES_SHOWN])) + (", ..." if n_dropped > DROPPED_LINES_SHOWN else "")
    return (
        f"{path}: dropped {n_dropped} of {total} {kind} examples whose assistant reply starts after "
        f"max_seq_length={max_seq_length} (line {shown})"
    )


def write_sft(directory: Path, path: Path, tokenizer, max_seq_length: int, skip_bad_lines: bool, num_proc: int, **kw):
    """Check and encode the chats of ``path`` into ``directory``'s flat files; returns the meta (counts)."""
    dtype = token_dtype(len(tokenizer))
    encoder = SFTEncoder(str(path), tokenizer, max_seq_length, skip_bad_lines, dtype)
    writer = RowWriter(directory, dtype, targets=True)
    invalid, unrenderable = SkipLog(path, skip_bad_lines), SkipLog(path, skip_bad_lines)
    progress = Progress(path.stat().st_size, "tokenising SFT chats")
    valid = renderable = n_dropped = 0
    dropped: list[int] = []
    results = map_chunks(encoder, path, num_proc, progress, **kw)
    try:
        for chunk in results:
            for category, message in chunk.bad:
                (invalid if category == "invalid" else unrenderable).add(message)  # raises without skipping
            valid, renderable = valid + chunk.valid, renderable + chunk.renderable
            n_dropped += len(chunk.dropped)
            dropped += chunk.dropped[: DROPPED_LINES_SHOWN + 1 - len(dropped)]
            writer.add_rows(chunk.ids, chunk.lengths, chunk.targets)
    finally:
        results.close()
        progress.close()
    warnings = []
    if invalid.count:
        warnings.append(f"skipped {invalid.count} bad line(s) in {path} (first: {invalid.first})")
    invalid.warn()
    if valid == 0:
        raise no_rows_error(path, "sft", invalid.count)
    if unrenderable.count:
        warnings.append(f"skipped {unrenderable.count} more bad line(s) in {path} (first: {unrenderable.first})")
    unrenderable.warn(more=True)
    if renderable == 0:
        raise DataFormatError(f"{path}: no valid sft examples (every line is malformed; first: {unrenderable.first})")
    if writer.n_rows == 0:
        raise DataFormatError(
            f"{path}: no sft example keeps any assistant tokens after truncation to "
            f"max_seq_length={max_seq_length}. Fix: raise max_seq_length or shorten the prompts."
        )
    if n_dropped:
        warnings.append(_drop_warning(path, "sft", renderable, dropped, n_dropped, max_seq_length))
        logger.warning("%s", warnings[-1])
    return writer.close(
        {
            "kind": "sft",
            "block": None,
            "documents": renderable,
            "tokens": writer.n_tokens,
            "dropped_rows": n_dropped,
            "dropped_tokens": 0,
            "skipped_lines": invalid.count + unrenderable.count,
            "warnings": warnings,
            "bytes": progress.done,
            "seconds": round(progress.seconds, 3),
            "num_proc": num_proc,
        }
    )


def build_sft_dataset(path: str | Path, tokenizer, max_seq_length: int, skip_bad_lines: bool = False, **options):
    """SFT rows (input_ids, labels, attention_mask), assistant-only labels, truncated, unpadded: a memory-mapped
    `TokenDataset`, encoded once and cached (``options``: see `minimind.data.prepare_rows`). Rows whose assistant
    tokens are all cut off by truncation are dropped (with a warning naming their first line numbers). Batch
    them with `minimind.data.collator`."""
    from minimind.data.prepare import prepare_rows

    return prepare_rows("sft", path, tokenizer, max_seq_length, skip_bad_lines=skip_bad_lines, **options)
