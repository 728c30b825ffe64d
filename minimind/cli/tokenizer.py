"""The tokenizer command: train MiniMind's byte-level BPE tokenizer."""

from __future__ import annotations

from minimind.cli.base import command, make_parser


@command
def train_tokenizer(argv=None):
    """Train MiniMind's byte-level BPE tokenizer and save it for transformers.

    minimind-train-tokenizer                       # bundled data -> tokenizer/
    minimind-train-tokenizer --files my.jsonl --vocab_size 6400 --output_dir out/

    Input files may be MiniMind JSONL (pretrain / SFT / DPO) or plain text.
    """
    import logging
    from pathlib import Path

    from minimind.tokenizer import DEFAULT_VOCAB_SIZE
    from minimind.tokenizer import train_tokenizer as train
    from minimind.training import BUNDLED_DATA, BUNDLED_TOKENIZER

    parser = make_parser(train_tokenizer.__doc__)
    parser.add_argument(
        "--files",
        nargs="+",
        type=Path,
        default=[Path(path) for path in BUNDLED_DATA.values()],
        help="training text: .jsonl corpora or plain text files (default: bundled data/)",
    )
    # Underscored like every other command's flags; the dashed spellings stay as aliases.
    parser.add_argument("--vocab_size", "--vocab-size", type=int, default=DEFAULT_VOCAB_SIZE)
    parser.add_argument("--min_frequency", "--min-frequency", type=int, default=2)
    parser.add_argument("--output_dir", "--output-dir", type=Path, default=BUNDLED_TOKENIZER)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
    tokenizer = train(
        args.files, vocab_size=args.vocab_size, output_dir=args.output_dir, min_frequency=args.min_frequency
    )
    print(f"saved tokenizer with {len(tokenizer)} tokens to {args.output_dir}")
    return tokenizer
