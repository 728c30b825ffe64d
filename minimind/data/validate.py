"""Row checks and the line-numbered JSONL reader: every training file is validated line by line, and a bad line is
named with its file and 1-based line number, the problem and a fix.

File formats (the same as upstream MiniMind, one JSON object per line; blank lines are ignored):

* pretrain: ``{"text": "..."}``
* sft:      ``{"conversations": [{"role": ..., "content": ...}, ...], "tools": [...]?}``
  roles are system / user / assistant / tool; an assistant message may carry
  ``tool_calls`` (OpenAI style) and then may have empty content.
* dpo:      ``{"chosen": [messages...], "rejected": [messages...]}``, each
  ending with the assistant reply being compared.

`parse_line` checks one line; `iter_rows` streams a file's valid rows with their line numbers (memory independent
of the file's size); `read_jsonl` returns them as a list (small files only). `SkipLog` counts what
``--skip_bad_lines`` skipped, so the streaming builders report exactly what the list reader reports.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from minimind.errors import InputError

logger = logging.getLogger(__name__)

KINDS = ("pretrain", "sft", "dpo")
ROLES = ("system", "user", "assistant", "tool")


class DataFormatError(InputError):
    """A training file is malformed, or yields no usable examples."""


class _RowError(Exception):
    """A problem with one row; read_jsonl adds the file name and line number."""

    def __init__(self, problem: str, fix: str):
        super().__init__(problem)
        self.problem, self.fix = problem, fix


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


def check_data_path(path: str | Path, kind: str) -> Path:
    """The path as a Path; DataFormatError for a kind we do not know, a directory or a missing file."""
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
    return path


def parse_line(raw: bytes, lineno: int, kind: str) -> dict | None:
    """The checked row of one raw line (None for a blank line); _RowError says what is wrong with it."""
    try:
        # Decode per line so an encoding error still gets a line number; utf-8-sig drops a leading BOM.
        line = raw.decode("utf-8-sig" if lineno == 1 else "utf-8")
    except UnicodeDecodeError:
        raise _RowError("not valid UTF-8", "re-save the file as UTF-8") from None
    if not line.strip():
        return None
    try:
        row = json.loads(line.rstrip("\r\n"))  # else an error at the end is 'column 1' of the next line
    except json.JSONDecodeError as e:
        raise _RowError(
            f"invalid JSON ({e.msg} at column {e.colno})",
            "check for unbalanced quotes/brackets or a trailing comma; each line must be one complete JSON object",
        ) from None
    except RecursionError:
        raise _RowError(
            f"arrays/objects nested more than {MAX_NESTING} levels deep",
            f"flatten the line (no training format nests that deep), {_SKIP_HINT}",
        ) from None
    except ValueError as e:  # e.g. an integer of more digits than Python converts
        raise _RowError(f"invalid JSON ({e})", f"shorten or quote the value, {_SKIP_HINT}") from None
    _check_row(row, kind)
    return row


def bad_line_message(path, lineno: int, error: _RowError) -> str:
    return f"{path}, line {lineno}: {error.problem}. Fix: {error.fix}."


class SkipLog:
    """What --skip_bad_lines skipped: the count and the first message. Without skipping, `add` raises the message
    as a DataFormatError instead."""

    def __init__(self, path, skip_bad_lines: bool):
        self.path, self.skip_bad_lines = path, skip_bad_lines
        self.count, self.first = 0, ""

    def add(self, message: str) -> None:
        if not self.skip_bad_lines:
            raise DataFormatError(message)
        self.count += 1
        self.first = self.first or message

    def warn(self, more: bool = False) -> None:
        if self.count:
            logger.warning(
                "skipped %d %sbad line(s) in %s (first: %s)",
                self.count,
                "more " if more else "",
                self.path,
                self.first,
            )


def no_rows_error(path, kind: str, skipped: int) -> DataFormatError:
    detail = f"all {skipped} non-blank line(s) are malformed" if skipped else "the file has no non-blank lines"
    return DataFormatError(f"{path}: no valid {kind} examples ({detail}). Fix: {_EXAMPLES[kind]}.")


def iter_rows(path: str | Path, kind: str, skips: SkipLog) -> Iterator[tuple[int, dict]]:
    """(line number, row) of every valid line, read one line at a time. A bad line raises DataFormatError, or
    with ``skips.skip_bad_lines`` is counted in ``skips``."""
    path = check_data_path(path, kind)
    with path.open("rb") as f:
        for lineno, raw in enumerate(f, start=1):
            try:
                row = parse_line(raw, lineno, kind)
            except _RowError as error:
                skips.add(bad_line_message(path, lineno, error))
                continue
            if row is not None:
                yield lineno, row


def read_jsonl(path: str | Path, kind: str, skip_bad_lines: bool = False) -> tuple[list[dict], int]:
    """Read and validate a JSONL file of ``kind``; return (rows, number of skipped bad lines).

    Raises DataFormatError naming the file and 1-based line on the first bad line, unless ``skip_bad_lines`` (then
    bad lines are counted and a warning is logged). A missing file, a directory, and a file with no valid rows
    always raise. A UTF-8 byte order mark (as some Windows editors write) is accepted. The rows are a list: for
    files of any size the builders stream instead (`iter_rows`).
    """
    rows, _, skipped = _read_numbered_rows(path, kind, skip_bad_lines)
    return rows, skipped


def _read_numbered_rows(path: str | Path, kind: str, skip_bad_lines: bool) -> tuple[list[dict], list[int], int]:
    """read_jsonl, plus the 1-based line number of every row returned."""
    skips = SkipLog(Path(path), skip_bad_lines)
    numbered = list(iter_rows(path, kind, skips))
    skips.warn()
    if not numbered:
        raise no_rows_error(Path(path), kind, skips.count)
    return [row for _, row in numbered], [lineno for lineno, _ in numbered], skips.count
