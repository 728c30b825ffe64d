"""Validated loading of MiniMind's JSONL training files into tokenised datasets.

File formats (the same as upstream MiniMind, one JSON object per line):

* pretrain: ``{"text": "..."}``
* sft:      ``{"conversations": [{"role": ..., "content": ...}, ...], "tools": [...]?}``
  roles are system / user / assistant / tool; an assistant message may carry
  ``tool_calls`` (OpenAI style) and then may have empty content.
* dpo:      ``{"chosen": [messages...], "rejected": [messages...]}``, each
  ending with the assistant reply being compared.

Every line is checked before anything is tokenised, so a broken file fails
at dataset build time, with file name, line number, the problem and a fix,
instead of in the middle of training.  Blank lines are ignored.

Conventions:

* Pretraining text is wrapped as ``<|im_start|>`` + text + ``<|im_end|>``
  (bos + text + eos, like upstream MiniMind).  Packed (the default), the
  texts are concatenated and cut into blocks of exactly ``max_seq_length``
  tokens; only the final remainder is dropped.  Blocks may span document
  boundaries (standard packing; the eos token marks where one text ends).
  Unpacked (padding-free training), each text is its own row, split into
  pieces of at most ``max_seq_length`` tokens.  ``labels == input_ids``
  because the model shifts labels internally.
* Chat rows are rendered with the tokenizer's chat template.  Only assistant
  replies are trained: the reply's tokens and its closing ``<|im_end|>`` get
  real labels, everything else (system/user/tool turns, the
  ``<|im_start|>assistant\\n`` header, the newline after ``<|im_end|>``) is
  -100.  Rows are truncated to ``max_seq_length`` but not padded.
* :func:`collator` turns rows into batches: padded per batch, or padding-free
  (a batch's rows concatenated into one, positions restarting at each row).
  DPO pairs are only validated here; TRL's DPOTrainer tokenises them.
"""

from __future__ import annotations

import json
import logging
from itertools import chain
from pathlib import Path
from typing import Any

from datasets import Dataset

from minimind.errors import InputError
from minimind.tokenizer import encode_conversation, render_conversation

logger = logging.getLogger(__name__)

IGNORE_INDEX = -100
KINDS = ("pretrain", "sft", "dpo")
ROLES = ("system", "user", "assistant", "tool")


class DataFormatError(InputError):
    """A training file is malformed, or yields no usable examples."""


class _RowError(Exception):
    """A problem with one row; read_jsonl adds the file name and line number."""

    def __init__(self, problem: str, fix: str):
        super().__init__(problem)
        self.problem, self.fix = problem, fix


# --------------------------------------------------------------------------
# Validation
# --------------------------------------------------------------------------


def _type_name(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def _check_tool_calls(tool_calls: Any, where: str) -> None:
    if not isinstance(tool_calls, list) or not tool_calls:
        raise _RowError(
            f"{where} 'tool_calls' must be a non-empty list, got {_type_name(tool_calls)}",
            'write "tool_calls": [{"type": "function", "function": {"name": ..., "arguments": {...}}}]',
        )
    for j, call in enumerate(tool_calls):
        function = call.get("function", call) if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise _RowError(
                f"{where} tool call {j} has no string 'name'",
                'give each tool call {"function": {"name": "...", "arguments": {...}}}',
            )
        if not isinstance(function.get("arguments", {}), (dict, str)):
            raise _RowError(
                f"{where} tool call {j} 'arguments' must be an object or a JSON string",
                'write "arguments": {"param": value}',
            )


def _check_conversation(messages: Any, key: str) -> None:
    """Raise _RowError unless ``messages`` is a trainable chat."""
    if not isinstance(messages, list):
        raise _RowError(
            f"'{key}' must be a list of messages, got {_type_name(messages)}",
            f'write "{key}": [{{"role": "user", "content": "..."}}, {{"role": "assistant", "content": "..."}}]',
        )
    if not messages:
        raise _RowError(f"'{key}' is empty", "add at least a user message and an assistant reply, or delete the line")
    for i, message in enumerate(messages):
        where = f"'{key}' message {i}"
        if not isinstance(message, dict):
            raise _RowError(
                f"{where} must be an object, got {_type_name(message)}",
                'write each message as {"role": "...", "content": "..."}',
            )
        role = message.get("role")
        if role not in ROLES:
            raise _RowError(
                f"{where} has unknown role {role!r}",
                f"use one of {', '.join(ROLES)} (e.g. rename 'human' to 'user', 'gpt' to 'assistant')",
            )
        content = message.get("content")
        has_calls = role == "assistant" and message.get("tool_calls") is not None
        if has_calls:
            _check_tool_calls(message["tool_calls"], where)
        reasoning = message.get("reasoning_content")
        if reasoning is not None:
            if role != "assistant":
                raise _RowError(
                    f"{where} ({role}) has 'reasoning_content', which only assistant messages may carry",
                    "move the reasoning to the assistant reply it belongs to, or drop the key",
                )
            if not isinstance(reasoning, str):
                raise _RowError(
                    f"{where} (assistant) 'reasoning_content' must be a string, got {_type_name(reasoning)}",
                    'write "reasoning_content": "..." (plain text) or drop it',
                )
        if content is None and has_calls:
            continue
        if not isinstance(content, str):
            raise _RowError(
                f"{where} ({role}) 'content' must be a string, got {_type_name(content)}",
                'write "content": "..." (plain text; lists of parts are not supported)',
            )
        if role == "assistant" and not has_calls and not content.strip():
            raise _RowError(
                f"{where} is an assistant reply with empty content", "write the reply text, or delete the message"
            )
    if not any(m["role"] == "assistant" for m in messages):
        raise _RowError(
            f"'{key}' has no assistant message, so there is nothing to train on",
            'add a reply {"role": "assistant", "content": "..."}',
        )


# Far deeper than any training row needs. Deeper rows would fail later, outside the line-numbered checks: in
# json.dumps, the chat template or Arrow (RecursionError), and json.loads itself refuses beyond the recursion limit.
MAX_NESTING = 100
_SKIP_HINT = "or pass --skip_bad_lines to skip such lines"


def _where(path: tuple) -> str:
    return "".join(f"[{step!r}]" for step in path) or "the row"


def _check_strings_and_nesting(row: Any) -> None:
    """Raise _RowError for a string (value or key, at any depth) that is not valid Unicode, or for nesting deeper
    than MAX_NESTING. JSON's \\ud800-style escapes can spell lone surrogates, which json.loads accepts but which
    no UTF-8 encoder (the tokenizer, Arrow) does, so they must be named here, with the line. Iterative, so that
    the walk itself cannot run out of stack."""
    stack = [(row, ())]
    while stack:
        value, path = stack.pop()
        if len(path) > MAX_NESTING:
            raise _RowError(
                f"arrays/objects nested more than {MAX_NESTING} levels deep",
                f"flatten the line (no training format nests that deep), {_SKIP_HINT}",
            )
        if isinstance(value, dict):
            for key, item in value.items():
                _check_unicode(key, f"a key in {_where(path)}")
                stack.append((item, (*path, key)))
        elif isinstance(value, list):
            stack.extend((item, (*path, i)) for i, item in enumerate(value))
        elif isinstance(value, str):
            _check_unicode(value, f"the string at {_where(path)}")


def _check_unicode(text: Any, where: str) -> None:
    if not isinstance(text, str) or text.isascii():
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise _RowError(
            f"{where} is not valid Unicode (lone surrogate {text[error.start]!r} at character "
            f"{error.start}, from a \\uXXXX escape that is half of a pair)",
            f"replace the escape with the intended character, {_SKIP_HINT}",
        ) from None


def _check_row(row: Any, kind: str) -> None:
    _check_strings_and_nesting(row)
    if not isinstance(row, dict):
        raise _RowError(f"expected a JSON object, got {_type_name(row)}", _EXAMPLES[kind])
    if kind == "pretrain":
        if "text" not in row:
            raise _RowError("missing key 'text'", _EXAMPLES[kind])
        if not isinstance(row["text"], str):
            raise _RowError(f"'text' must be a string, got {_type_name(row['text'])}", _EXAMPLES[kind])
        if not row["text"].strip():
            raise _RowError("'text' is empty", "delete the line or put text in it")
    elif kind == "sft":
        if "conversations" not in row:
            raise _RowError("missing key 'conversations'", _EXAMPLES[kind])
        _check_conversation(row["conversations"], "conversations")
        tools = row.get("tools")
        if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
            raise _RowError(
                "'tools' must be a list of objects (JSON schemas)",
                'write "tools": [{"type": "function", "function": {...}}] or drop the key',
            )
    else:
        for key in ("chosen", "rejected"):
            if key not in row:
                raise _RowError(f"missing key '{key}'", _EXAMPLES[kind])
            _check_conversation(row[key], key)
            if row[key][-1]["role"] != "assistant":
                raise _RowError(
                    f"'{key}' must end with the assistant reply being compared",
                    f"make the last message of '{key}' the assistant answer",
                )
        # TRL takes the shared messages as the prompt; pairs whose prompts differ have nothing to compare (and
        # TRL 1.16 fails on them with a bare IndexError).
        chosen_prompt, rejected_prompt = row["chosen"][:-1], row["rejected"][:-1]
        if chosen_prompt != rejected_prompt:
            at = next(
                (i for i, (a, b) in enumerate(zip(chosen_prompt, rejected_prompt)) if a != b),
                min(len(chosen_prompt), len(rejected_prompt)),
            )
            raise _RowError(
                f"'chosen' and 'rejected' have different prompts (they differ at message {at}; "
                f"{len(chosen_prompt)} and {len(rejected_prompt)} messages before the final reply)",
                "give both the same messages up to the final assistant reply; only that reply may differ",
            )


_EXAMPLES = {
    "pretrain": 'each line must look like {"text": "some training text"}',
    "sft": 'each line must look like {"conversations": [{"role": "user", "content": "Hi"}, '
    '{"role": "assistant", "content": "Hello!"}]}',
    "dpo": 'each line must look like {"chosen": [{"role": "user", "content": "Q"}, '
    '{"role": "assistant", "content": "good answer"}], "rejected": [{"role": "user", '
    '"content": "Q"}, {"role": "assistant", "content": "bad answer"}]}',
}


def read_jsonl(path: str | Path, kind: str, skip_bad_lines: bool = False) -> tuple[list[dict], int]:
    """Read and validate a JSONL file of ``kind``; return (rows, number of skipped bad lines).

    Raises DataFormatError naming the file and 1-based line on the first bad
    line, unless ``skip_bad_lines`` (then bad lines are counted and a warning
    is logged).  A missing file, a directory, and a file with no valid rows
    always raise.  A UTF-8 byte order mark (as some Windows editors write) is
    accepted.
    """
    rows, _, skipped = _read_numbered_rows(path, kind, skip_bad_lines)
    return rows, skipped


def _read_numbered_rows(path: str | Path, kind: str, skip_bad_lines: bool) -> tuple[list[dict], list[int], int]:
    """read_jsonl, plus the 1-based line number of every row returned."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    path = Path(path)
    if path.is_dir():
        raise DataFormatError(
            f"{path}: is a directory, not a JSONL file. Fix: pass the path of a .jsonl file "
            "(--data_path DIR/FILE.jsonl)."
        )
    if not path.is_file():
        raise DataFormatError(
            f"{path}: no such file. Fix: check the path (--data_path) or create the file; {_EXAMPLES[kind]}."
        )
    rows: list[dict] = []
    lines: list[int] = []
    skipped = 0
    first_skip = ""
    with path.open("rb") as f:
        for lineno, raw in enumerate(f, start=1):
            try:
                # Decode per line so an encoding error still gets a line number; utf-8-sig drops a leading BOM.
                line = raw.decode("utf-8-sig" if lineno == 1 else "utf-8")
                if not line.strip():
                    continue
                try:
                    row = json.loads(line.rstrip("\r\n"))  # else an error at the end is 'column 1' of the next line
                except json.JSONDecodeError as e:
                    raise _RowError(
                        f"invalid JSON ({e.msg} at column {e.colno})",
                        "check for unbalanced quotes/brackets or a trailing comma; "
                        "each line must be one complete JSON object",
                    ) from None
                except RecursionError:
                    raise _RowError(
                        f"arrays/objects nested more than {MAX_NESTING} levels deep",
                        f"flatten the line (no training format nests that deep), {_SKIP_HINT}",
                    ) from None
                except ValueError as e:  # e.g. an integer of more digits than Python converts
                    raise _RowError(f"invalid JSON ({e})", f"shorten or quote the value, {_SKIP_HINT}") from None
                _check_row(row, kind)
            except UnicodeDecodeError:
                error = _RowError("not valid UTF-8", "re-save the file as UTF-8")
            except _RowError as e:
                error = e
            else:
                rows.append(row)
                lines.append(lineno)
                continue
            message = f"{path}, line {lineno}: {error.problem}. Fix: {error.fix}."
            if not skip_bad_lines:
                raise DataFormatError(message)
            skipped += 1
            first_skip = first_skip or message
    if skipped:
        logger.warning("skipped %d bad line(s) in %s (first: %s)", skipped, path, first_skip)
    if not rows:
        detail = f"all {skipped} non-blank line(s) are malformed" if skipped else "the file has no non-blank lines"
        raise DataFormatError(f"{path}: no valid {kind} examples ({detail}). Fix: {_EXAMPLES[kind]}.")
    return rows, lines, skipped


# --------------------------------------------------------------------------
# Pretraining
# --------------------------------------------------------------------------


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


def build_pretrain_dataset(
    path: str | Path,
    tokenizer,
    max_seq_length: int,
    skip_bad_lines: bool = False,
    packed: bool = True,
) -> Dataset:
    """Pretraining rows (input_ids, labels, attention_mask): packed blocks of exactly ``max_seq_length`` tokens
    spanning documents, or (``packed=False``) one row per document of at most ``max_seq_length`` tokens."""
    rows, _ = read_jsonl(path, "pretrain", skip_bad_lines)
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id

    def tokenize(batch):
        ids = tokenizer(batch["text"], add_special_tokens=False)["input_ids"]
        return {"input_ids": [[bos, *x, eos] for x in ids]}

    dataset = Dataset.from_dict({"text": [row["text"] for row in rows]})
    dataset = dataset.map(tokenize, batched=True, remove_columns=["text"], desc="tokenising pretrain text")
    n_tokens = sum(len(x) for x in dataset["input_ids"])
    # batch_size=None: the whole corpus in one pass, so only the last partial block is lost.
    dataset = dataset.map(
        pack_sequences if packed else split_documents,
        batched=True,
        batch_size=None,
        fn_kwargs={"length": max_seq_length},
        desc="packing" if packed else "splitting documents",
    )
    if len(dataset) == 0:
        raise DataFormatError(
            f"{path}: only {n_tokens} tokens, fewer than max_seq_length={max_seq_length}, so not one "
            "training block can be made. Fix: lower max_seq_length or add more text."
        )
    return dataset


# --------------------------------------------------------------------------
# Chat (SFT)
# --------------------------------------------------------------------------


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

    Tokenisation is ``minimind.tokenizer.encode_conversation``: special tokens inside message text become
    ordinary tokens, as at chat time.  The reply spans are found in the rendered text: rendering the messages
    before an assistant turn with ``add_generation_prompt=True`` gives exactly the text up to the start of its
    reply (the template is prefix-stable), and the reply ends with the next ``<|im_end|>`` token, which can
    only be the template's.  Tokens are then labelled by their character offsets.  A token counts as part of a
    reply when it starts inside it; so if a reply begins with a newline that BPE merges with the header's
    newline, that first newline is not trained (harmless edge case).
    """
    encoding = encode_conversation(tokenizer, messages, tools)
    text, input_ids = encoding.text, encoding.input_ids
    eos_ends = [hi for token, (lo, hi) in zip(input_ids, encoding.offsets) if token == tokenizer.eos_token_id]
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        prefix = _render(tokenizer, messages[:i], tools, add_generation_prompt=True)
        if not text.startswith(prefix):
            raise ValueError("the tokenizer's chat template is not prefix-stable; cannot locate assistant replies")
        start = len(prefix)
        spans.append((start, min(end for end in eos_ends if end > start)))

    labels = [
        token if any(lo <= start < hi for lo, hi in spans) else IGNORE_INDEX
        for token, (start, _) in zip(input_ids, encoding.offsets)
    ]
    if max_seq_length is not None:
        input_ids, labels = input_ids[:max_seq_length], labels[:max_seq_length]
    return {"input_ids": input_ids, "labels": labels, "attention_mask": [1] * len(input_ids)}


def _has_targets(labels: list[int]) -> bool:
    return any(label != IGNORE_INDEX for label in labels)


def _chat_source(rows: list[dict]) -> Dataset:
    # Conversations are stored as JSON strings: Arrow would otherwise merge
    # the keys of all messages / tool arguments into one struct type and add
    # null fields that the chat template would then render.
    return Dataset.from_dict(
        {
            "conversations": [json.dumps(row["conversations"], ensure_ascii=False) for row in rows],
            "tools": [json.dumps(row.get("tools") or [], ensure_ascii=False) for row in rows],
        }
    )


DROPPED_LINES_SHOWN = 5


def _drop_report(path, kind: str, lines: list[int], kept_lines: list[int], max_seq_length: int) -> None:
    """Raise if no example survived truncation; else warn with the count and the first dropped line numbers,
    so the user can find the examples to shorten."""
    if not kept_lines:
        raise DataFormatError(
            f"{path}: no {kind} example keeps any assistant tokens after truncation to "
            f"max_seq_length={max_seq_length}. Fix: raise max_seq_length or shorten the prompts."
        )
    kept = set(kept_lines)
    dropped = [line for line in lines if line not in kept]
    if dropped:
        shown = ", ".join(map(str, dropped[:DROPPED_LINES_SHOWN])) + (
            ", ..." if len(dropped) > DROPPED_LINES_SHOWN else ""
        )
        logger.warning(
            "%s: dropped %d of %d %s examples whose assistant reply starts after max_seq_length=%d (line %s)",
            path,
            len(dropped),
            len(lines),
            kind,
            max_seq_length,
            shown,
        )


def build_sft_dataset(
    path: str | Path,
    tokenizer,
    max_seq_length: int,
    skip_bad_lines: bool = False,
) -> Dataset:
    """SFT rows (input_ids, labels, attention_mask), assistant-only labels, truncated, unpadded.

    Rows whose assistant tokens are all cut off by truncation are dropped (with
    a warning naming their first line numbers).  Batch them with :func:`collator`.
    """
    from jinja2 import TemplateError

    rows, lines, _ = _read_numbered_rows(path, "sft", skip_bad_lines)
    unrenderable = []

    def encode(batch, indices):
        out = {"input_ids": [], "labels": [], "attention_mask": [], "line": []}
        for conversation, tools, index in zip(batch["conversations"], batch["tools"], indices):
            try:
                example = encode_chat(tokenizer, json.loads(conversation), json.loads(tools), max_seq_length)
            except (TemplateError, ValueError, TypeError, KeyError, IndexError, RecursionError) as error:
                # A row that passed validation but that the chat template refuses (e.g. one that opens with the
                # assistant's reply): still this line's problem, named with its number, not a traceback mid-map.
                message = (
                    f"{path}, line {lines[index]}: the chat template cannot render this conversation "
                    f"({type(error).__name__}: {' '.join(str(error).split())}). Fix: check the order of the "
                    f"roles (open with a system or user message), {_SKIP_HINT}."
                )
                if not skip_bad_lines:
                    raise DataFormatError(message) from None
                unrenderable.append((lines[index], message))
                continue
            if _has_targets(example["labels"]):
                for key in ("input_ids", "labels", "attention_mask"):
                    out[key].append(example[key])
                out["line"].append(lines[index])
        return out

    source = _chat_source(rows)
    dataset = source.map(
        encode, batched=True, with_indices=True, remove_columns=source.column_names, desc="tokenising SFT chats"
    )
    if unrenderable:
        first = unrenderable[0][1]
        logger.warning("skipped %d more bad line(s) in %s (first: %s)", len(unrenderable), path, first)
        if len(unrenderable) == len(rows):
            raise DataFormatError(f"{path}: no valid sft examples (every line is malformed; first: {first})")
        skipped = {line for line, _ in unrenderable}
        lines = [line for line in lines if line not in skipped]
    # A map that keeps no row returns no columns at all.
    _drop_report(path, "sft", lines, dataset["line"] if len(dataset) else [], max_seq_length)
    return dataset.remove_columns("line")


def build_dataset(
    kind: str,
    path: str | Path,
    tokenizer,
    max_seq_length: int,
    skip_bad_lines: bool = False,
    padding_free: bool = False,
) -> Dataset:
    """Tokenised rows of a pretrain or sft file; padding-free pretraining keeps documents apart."""
    if kind == "pretrain":
        return build_pretrain_dataset(path, tokenizer, max_seq_length, skip_bad_lines, packed=not padding_free)
    if kind == "sft":
        return build_sft_dataset(path, tokenizer, max_seq_length, skip_bad_lines)
    raise ValueError(f"kind must be 'pretrain' or 'sft', got {kind!r} (DPO pairs are tokenised by TRL)")


# --------------------------------------------------------------------------
# Batching and splitting
# --------------------------------------------------------------------------


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


def split_train_eval(dataset: Dataset, eval_fraction: float, seed: int = 42) -> tuple[Dataset, Dataset | None]:
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
    split = dataset.train_test_split(test_size=n_eval, seed=seed, shuffle=True)
    return split["train"], split["test"]
