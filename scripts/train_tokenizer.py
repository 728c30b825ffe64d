#!/usr/bin/env python3
"""Train MiniMind's byte-level BPE tokenizer and save it for transformers.

    python scripts/train_tokenizer.py                       # bundled data -> tokenizer/
    python scripts/train_tokenizer.py --files my.jsonl --vocab_size 6400 --output_dir out/

Input files may be MiniMind JSONL (pretrain / SFT / DPO) or plain text.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from minimind.tokenizer import DEFAULT_VOCAB_SIZE, train_tokenizer  # noqa: E402

DEFAULT_FILES = [ROOT / "data" / name for name in ("pretrain.jsonl", "sft.jsonl", "dpo.jsonl")]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Train the MiniMind tokenizer.")
    parser.add_argument("--files", nargs="+", type=Path, default=DEFAULT_FILES,
                        help="training text: .jsonl corpora or plain text files (default: bundled data/)")
    # Underscored like every other script's flags; the dashed spellings stay as aliases.
    parser.add_argument("--vocab_size", "--vocab-size", type=int, default=DEFAULT_VOCAB_SIZE)
    parser.add_argument("--min_frequency", "--min-frequency", type=int, default=2)
    parser.add_argument("--output_dir", "--output-dir", type=Path, default=ROOT / "tokenizer")
    args = parser.parse_args(argv)

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
    tokenizer = train_tokenizer(args.files, vocab_size=args.vocab_size,
                                output_dir=args.output_dir, min_frequency=args.min_frequency)
    print(f"saved tokenizer with {len(tokenizer)} tokens to {args.output_dir}")


if __name__ == "__main__":
    main()
