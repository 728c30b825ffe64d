"""Train, save and load MiniMind's byte-level BPE tokenizer.

Design facts (other modules and the GGUF export rely on them):

* Byte-level BPE, so every Unicode string round-trips exactly:
  ``decode(encode(s), skip_special_tokens=False) == s``.  There is no
  normaliser on purpose (NFC would change some strings).
* The pre-tokenizer is the Qwen2 split regex followed by a regex-free
  ByteLevel step.  That is exactly what llama.cpp calls the ``qwen2``
  pre-tokenizer, so a GGUF export can declare ``tokenizer.ggml.pre = qwen2``.
* Special tokens have fixed ids, whatever corpus the tokenizer is trained on:
  ``<|endoftext|>`` 0 (pad and unk), ``<|im_start|>`` 1 (bos),
  ``<|im_end|>`` 2 (eos), then ``<think>`` 3, ``</think>`` 4,
  ``<tool_call>`` 5, ``</tool_call>`` 6.  The last four are ordinary added
  tokens (not "special"), so ``skip_special_tokens=True`` keeps them visible
  to reasoning / tool-call parsers.
* Encoding never inserts bos/eos by itself; callers add them where the
  format needs them (see ``minimind.data``).
* The chat template is ChatML (see ``CHAT_TEMPLATE``).  Conversations are
  tokenised with ``encode_conversation``, which keeps special tokens inside
  message text from acting as markers (docs/chat-format.md).
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

logger = logging.getLogger(__name__)

PAD_TOKEN = UNK_TOKEN = "<|endoftext|>"
BOS_TOKEN = "<|im_start|>"
EOS_TOKEN = "<|im_end|>"
# Order defines the ids: position in this list == token id.
SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
]
# Tokens that must survive ``skip_special_tokens=True`` decoding.
NON_SKIPPED_TOKENS = {"<think>", "</think>", "<tool_call>", "</tool_call>"}

DEFAULT_VOCAB_SIZE = 6400
MODEL_MAX_LENGTH = 32768

# llama.cpp's "qwen2" pre-tokenizer regex (from the Qwen2 tokenizer).
QWEN2_PRETOKENIZE_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# ChatML.  Each message renders as "<|im_start|>{role}\n{content}<|im_end|>\n".
# * ``tools`` (a list of JSON-schema dicts) go into a system message; when the
#   conversation starts with a system message, its content comes first and the
#   tool description is appended to it.
# * An assistant message's ``reasoning_content`` (a string) renders before its
#   content as "<think>\n{reasoning}\n</think>\n\n", as Qwen3 writes it; an
#   empty string gives the empty block that ``enable_thinking=False`` puts in
#   the generation prompt.  A "<think>...</think>" already inside the content is
#   rendered as it is.  Unlike Qwen3, reasoning of earlier turns is kept: that
#   keeps the template prefix-stable.
# * An assistant message's ``tool_calls`` render after its content, each as
#   "<tool_call>\n{"name": ..., "arguments": ...}\n</tool_call>" (one per line);
#   OpenAI-style {"type": "function", "function": {...}} entries are unwrapped,
#   and string ``arguments`` are inserted verbatim (they are already JSON).
# * Everything an assistant message generates, reasoning and "<|im_end|>"
#   included, sits in a {% generation %} block, so transformers'
#   ``return_assistant_tokens_mask`` and TRL's ``assistant_only_loss`` select
#   exactly what ``minimind.data.encode_chat`` trains on.
# * ``tool`` messages render with role "tool".
# * ``add_generation_prompt`` appends "<|im_start|>assistant\n", followed by
#   "<think>\n\n</think>\n\n" when ``enable_thinking=False`` is passed.
# * No default system prompt is injected.
# The template is prefix-stable (rendering the first k messages gives a prefix
# of rendering all of them); minimind.data relies on that to mask labels.
# Message text never passes through a filter or a test other than "is string"
# and truthiness: ``encode_conversation`` swaps it for placeholders.
CHAT_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages and messages[0].role == 'system' %}"
    "{{- messages[0].content + '\\n\\n' }}"
    "{%- endif %}"
    "{{- 'You can call the following tools. Each is described by a JSON schema:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\\n</tools>\\nTo call a tool, reply with <tool_call>\\n"
    '{"name": <tool-name>, "arguments": <arguments-as-json-object>}\\n'
    "</tool_call><|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if not (tools and loop.first and message.role == 'system') %}"
    "{{- '<|im_start|>' + message.role + '\\n' }}"
    "{%- if message.role == 'assistant' %}"
    "{%- generation %}"
    "{%- if message.reasoning_content is string %}"
    "{{- '<think>\\n' + message.reasoning_content + '\\n</think>\\n\\n' }}"
    "{%- endif %}"
    "{%- if message.content is string %}{{- message.content }}{%- endif %}"
    "{%- if message.tool_calls %}"
    "{%- for tool_call in message.tool_calls %}"
    "{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}"
    "{%- if (loop.first and message.content) or not loop.first %}{{- '\\n' }}{%- endif %}"
    '{{- \'<tool_call>\\n{"name": "\' + tool_call.name + \'", "arguments": \' }}'
    "{%- if tool_call.arguments is string %}{{- tool_call.arguments }}"
    "{%- else %}{{- tool_call.arguments | tojson }}{%- endif %}"
    "{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{%- endif %}"
    "{{- '<|im_end|>' }}"
    "{%- endgeneration %}"
    "{{- '\\n' }}"
    "{%- else %}"
    "{%- if message.content is string %}{{- message.content }}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)


# Message fields that hold text written by users, tools or the model: data to the template, never markup.
MESSAGE_TEXT_FIELDS = ("content", "reasoning_content")


@dataclass
class ChatEncoding:
    """A conversation rendered by the chat template and tokenised so that only the template's own markers are
    special tokens.

    ``pieces`` is the rendered text in order, each piece marked True when it is message text.  ``offsets`` are
    the character span of every token in ``text``.
    """

    pieces: list[tuple[str, bool]]
    input_ids: list[int]
    offsets: list[tuple[int, int]]

    @property
    def text(self) -> str:
        return "".join(piece for piece, _ in self.pieces)


def _placeholder_marks(messages: list[dict], tools) -> tuple[str, str]:
    # Two private-use characters that no message text (nor tool schema) contains; the first free ones, so the
    # same conversation always renders the same way.
    seen = set(json.dumps([messages, tools], ensure_ascii=False, default=str))
    free = (chr(code) for code in range(0xE000, 0xF900) if chr(code) not in seen)
    return next(free), next(free)


def render_conversation(
    tokenizer, messages: list[dict], tools: list | None = None, add_generation_prompt: bool = False, **template_kwargs
) -> list[tuple[str, bool]]:
    """The chat template's rendering of ``messages`` as pieces: (text, True) for message text, (text, False)
    for what the template itself wrote.

    Message text is swapped for placeholders before rendering, so the template cannot mistake it for markup and
    the pieces say exactly where each message's text sits.  Empty strings stay as they are: the template
    tests them for truthiness.
    """
    open_mark, close_mark = _placeholder_marks(messages, tools)
    texts: list[str] = []

    def hide(value):
        if not isinstance(value, str) or not value:
            return value
        texts.append(value)
        return f"{open_mark}{len(texts) - 1}{close_mark}"

    hidden = [
        {**message, **{key: hide(message[key]) for key in MESSAGE_TEXT_FIELDS if key in message}}
        for message in messages
    ]
    rendered = tokenizer.apply_chat_template(
        hidden, tools=tools or None, tokenize=False, add_generation_prompt=add_generation_prompt, **template_kwargs
    )
    parts = re.split(f"{open_mark}(\\d+){close_mark}", rendered)
    pieces = []
    for i, part in enumerate(parts):
        text, is_message_text = (texts[int(part)], True) if i % 2 else (part, False)
        if text:
            pieces.append((text, is_message_text))
    return pieces


def encode_conversation(
    tokenizer, messages: list[dict], tools: list | None = None, add_generation_prompt: bool = False, **template_kwargs
) -> ChatEncoding:
    """Render ``messages`` with the chat template and tokenise the result; special tokens ("<|im_start|>",
    "<|im_end|>", "<|endoftext|>") count only where the template wrote them.

    Inside message text they are split into ordinary tokens, so a user cannot close their turn and open a
    system one.  The text between two template markers is tokenised in one piece, as plain tokenisation would
    (special tokens always cut the text there), so a conversation without such strings in its messages gets
    exactly the ids of ``tokenizer(rendered_text)``.  "<think>", "</think>", "<tool_call>" and "</tool_call>"
    are not special (see the module docstring) and stay single tokens everywhere.
    """
    plan = plan_conversation(tokenizer, messages, tools, add_generation_prompt, **template_kwargs)
    return encode_planned(tokenizer, [plan])[0]


def plan_conversation(
    tokenizer, messages: list[dict], tools: list | None = None, add_generation_prompt: bool = False, **template_kwargs
):
    """The rendering half of `encode_conversation` (raises what the chat template raises): the pieces, and the text
    as (start, text, is_marker) segments: the template's markers and the runs between them."""
    pieces = render_conversation(tokenizer, messages, tools, add_generation_prompt, **template_kwargs)
    markers = sorted(tokenizer.all_special_tokens, key=len, reverse=True)
    marker_pattern = re.compile("(" + "|".join(map(re.escape, markers)) + ")")
    segments: list[tuple[int, str, bool]] = []
    run_start, run_text, position = 0, "", 0
    for text, is_message_text in pieces:
        # re.split with a group puts the markers at the odd indices.
        parts = [text] if is_message_text else marker_pattern.split(text)
        for index, part in enumerate(parts):
            if index % 2:
                if run_text:
                    segments.append((run_start, run_text, False))
                segments.append((position, part, True))
                run_start, run_text = position + len(part), ""
            else:
                run_text += part
            position += len(part)
    if run_text:
        segments.append((run_start, run_text, False))
    return pieces, segments


def encode_planned(tokenizer, plans: list) -> list[ChatEncoding]:
    """The tokenising half of `encode_conversation`, for many planned conversations in one tokenizer call."""
    run_texts = [text for _, segments in plans for _, text, is_marker in segments if not is_marker]
    encoded = iter(zip(*tokenize_as_text(tokenizer, run_texts)))
    encodings, marker_ids = [], {}
    for pieces, segments in plans:
        input_ids, offsets = [], []
        for start, text, is_marker in segments:
            if is_marker:
                if text not in marker_ids:
                    marker_ids[text] = tokenizer.convert_tokens_to_ids(text)
                input_ids.append(marker_ids[text])
                offsets.append((start, start + len(text)))
            else:
                ids, spans = next(encoded)
                input_ids.extend(ids)
                offsets.extend((start + lo, start + hi) for lo, hi in spans)
        encodings.append(ChatEncoding(pieces, input_ids, offsets))
    return encodings


def tokenize_as_text(tokenizer, texts: list[str]) -> tuple[list[list[int]], list[list[tuple[int, int]]]]:
    if not texts:
        return [], []
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if (
        backend is not None
        and hasattr(backend, "encode_special_tokens")
        and not (backend.truncation or backend.padding)
    ):
        # What tokenizer(texts, split_special_tokens=True, return_offsets_mapping=True) does, without converting
        # every encoding to a BatchEncoding (most of the time of encoding a chat).
        previous = backend.encode_special_tokens
        backend.encode_special_tokens = True
        try:
            encodings = backend.encode_batch(texts, add_special_tokens=False)
        finally:
            backend.encode_special_tokens = previous
        return [e.ids for e in encodings], [e.offsets for e in encodings]
    encoded = tokenizer(texts, add_special_tokens=False, split_special_tokens=True, return_offsets_mapping=True)
    return encoded["input_ids"], encoded["offset_mapping"]


def iter_texts(files: Iterable[str | Path]) -> Iterator[str]:
    """Yield training text from JSONL corpora (pretrain/SFT/DPO) or plain text files.

    JSONL lines contribute their "text" field, the "content" of every
    message in "conversations", "chosen" or "rejected", and (as JSON) any
    "tools" and "tool_calls".  Other files are read
    line by line.  Unparseable JSONL lines are skipped: strict checking is the
    data loader's job, the tokenizer only needs representative text.
    """
    for file in files:
        path = Path(file)
        with path.open(encoding="utf-8") as f:
            if path.suffix != ".jsonl":
                yield from f
                continue
            for line in f:
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if not isinstance(row, dict):
                    continue
                if isinstance(row.get("text"), str):
                    yield row["text"]
                # Tool schemas and calls are seen as JSON at chat time, so
                # the tokenizer should learn JSON pieces too.
                if row.get("tools"):
                    yield json.dumps(row["tools"], ensure_ascii=False)
                for key in ("conversations", "chosen", "rejected"):
                    for message in row.get(key) or []:
                        if not isinstance(message, dict):
                            continue
                        if isinstance(message.get("content"), str):
                            yield message["content"]
                        if message.get("tool_calls"):
                            yield json.dumps(message["tool_calls"], ensure_ascii=False)


def build_bpe_tokenizer() -> Tokenizer:
    """An untrained tokenizer with MiniMind's pipeline (no normaliser, qwen2 split, byte level)."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    return tokenizer


def _unmark_special(tokenizer: Tokenizer) -> Tokenizer:
    """Flip <think>/<tool_call> & co. to non-special added tokens, ids unchanged.

    BpeTrainer registers all its special tokens as special; editing the JSON
    is the only way to keep their fixed ids while changing the flag.
    """
    state = json.loads(tokenizer.to_str())
    for entry in state["added_tokens"]:
        if entry["content"] in NON_SKIPPED_TOKENS:
            entry["special"] = False
    return Tokenizer.from_str(json.dumps(state))


def check_special_ids(tokenizer) -> None:
    """Raise if any special token is missing or not at its fixed id."""
    # Accepts both a tokenizers.Tokenizer and a transformers tokenizer.
    lookup = getattr(tokenizer, "convert_tokens_to_ids", None) or tokenizer.token_to_id
    for expected_id, token in enumerate(SPECIAL_TOKENS):
        actual = lookup(token)
        if actual != expected_id:
            raise ValueError(f"special token {token!r} has id {actual}, expected {expected_id}")


def wrap_tokenizer(tokenizer: Tokenizer):
    """Wrap a trained ``tokenizers.Tokenizer`` as a transformers fast tokenizer with our settings."""
    from transformers import PreTrainedTokenizerFast

    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        unk_token=UNK_TOKEN,
        model_max_length=MODEL_MAX_LENGTH,
        padding_side="right",
        # Cleaning up spaces (" ." -> ".") would break exact round-trips.
        clean_up_tokenization_spaces=False,
    )
    wrapped.chat_template = CHAT_TEMPLATE
    return wrapped


def save_tokenizer(tokenizer, output_dir: str | Path) -> Path:
    """Save a transformers tokenizer so both transformers 4.5x and 5.x can load it.

    transformers 5 writes ``"tokenizer_class": "TokenizersBackend"`` (unknown
    to 4.x) and keeps the chat template only in ``chat_template.jinja``.  We
    rewrite the class to ``PreTrainedTokenizerFast``, also store the template
    under ``"chat_template"`` in tokenizer_config.json, and turn a list-valued
    ``extra_special_tokens`` (5.x) into ``additional_special_tokens`` (4.x
    expects a dict there).  Training scripts call this for model directories.
    """
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(str(output_dir))

    config_path = output_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text(encoding="utf-8"))
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    if tokenizer.chat_template:
        config["chat_template"] = tokenizer.chat_template
        (output_dir / "chat_template.jinja").write_text(tokenizer.chat_template, encoding="utf-8")
    extra = config.get("extra_special_tokens")
    if isinstance(extra, list):
        del config["extra_special_tokens"]
        if extra:
            config["additional_special_tokens"] = extra
    config_path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    return output_dir


def train_tokenizer(
    files: Iterable[str | Path],
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    output_dir: str | Path | None = None,
    min_frequency: int = 2,
):
    """Train the byte-level BPE tokenizer on ``files``; optionally save it; return the HF tokenizer.

    ``vocab_size`` is an upper bound: a small or repetitive corpus may run out
    of merges first (the achieved size is logged).
    """
    files = [Path(f) for f in files]
    if not files:
        raise ValueError("train_tokenizer needs at least one input file")
    if vocab_size < len(SPECIAL_TOKENS) + 256:
        raise ValueError(f"vocab_size must be at least {len(SPECIAL_TOKENS) + 256} (specials + 256 bytes)")

    tokenizer = build_bpe_tokenizer()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=SPECIAL_TOKENS,
        # Every byte gets a token, so no input is ever unknown.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(iter_texts(files), trainer=trainer)
    tokenizer = _unmark_special(tokenizer)
    check_special_ids(tokenizer)
    logger.info("trained tokenizer with %d tokens (requested %d)", tokenizer.get_vocab_size(), vocab_size)

    wrapped = wrap_tokenizer(tokenizer)
    if output_dir is not None:
        save_tokenizer(wrapped, output_dir)
    return wrapped


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def load_tokenizer(path: str | Path):
    """Load a saved tokenizer with AutoTokenizer and check the fixed special ids. Code named by a tokenizer_config's
    auto_map is never run (MiniMind's tokenizer is transformers' own fast tokenizer)."""
    from transformers import AutoTokenizer

    from minimind.errors import InputError

    # Without tokenizer.json, transformers falls back to converting a slow tokenizer and asks for
    # sentencepiece or tiktoken, which hides the real problem: files missing from the directory.
    missing = [name for name in TOKENIZER_FILES if not (Path(path) / name).is_file()]
    if Path(path).is_dir() and missing:
        raise InputError(
            f"{path}: tokenizer file(s) {', '.join(missing)} missing. Fix: copy them from the "
            f"directory the model was trained with (every saved MiniMind model and the bundled "
            f"tokenizer/ directory have them)."
        )
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path), trust_remote_code=False)
    except ValueError as error:  # a tokenizer class that only code shipped in the directory defines
        raise InputError(
            f"{path}: its tokenizer cannot be loaded without running code from the directory, "
            f"which MiniMind commands never do ({str(error).splitlines()[0]})"
        ) from None
    check_special_ids(tokenizer)
    return tokenizer
