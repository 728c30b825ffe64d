"""What every export target shares: the tokenizer files, loading the checkpoint, the refusal message."""

import shutil
from pathlib import Path

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
)


def copy_tokenizer_files(src_dir, dst_dir):
    """Copy the tokenizer files found in `src_dir` to `dst_dir`; return their names (empty if none)."""
    src_dir, dst_dir = Path(src_dir), Path(dst_dir)
    copied = []
    for name in TOKENIZER_FILES:
        if (src_dir / name).is_file():
            dst_dir.mkdir(parents=True, exist_ok=True)
            if (src_dir / name).resolve() != (dst_dir / name).resolve():
                shutil.copyfile(src_dir / name, dst_dir / name)
            copied.append(name)
    return copied


def load_minimind(model_name_or_path, dtype="auto"):
    """A MiniMind checkpoint, checked and loaded with the installed classes (no remote code), in its saved dtype."""
    from minimind.loading import load_model

    return load_model(model_name_or_path, dtype=dtype)


def _refuse(target, field, value, why):
    raise ValueError(
        f"Cannot export to {target}: {field}={value!r} {why}. The export would not give the same "
        f"outputs, so it is refused."
    )
