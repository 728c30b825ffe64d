"""The data command: tokenise a training file once, ahead of training (`minimind-prepare`)."""

from __future__ import annotations

from minimind.cli.base import command, make_parser


@command
def prepare(argv=None):
    """Check and tokenise a data file into the cache ahead of training, on every core; print the cache directory
    and how many tokens it holds. Training with the same file and settings then starts in seconds; the directory
    itself can be passed as --data_path.

    minimind-prepare --kind pretrain --data_path data/pretrain.jsonl --max_seq_length 512
    minimind-pretrain --data_path DIRECTORY_IT_PRINTED --output_dir runs/pretrain ...
    """
    import logging
    import sys

    from minimind.data import build_dataset, build_dpo_dataset, summary
    from minimind.training import BUNDLED_DATA, DataArguments, ModelArguments, load_tokenizer

    parser = make_parser(prepare.__doc__)
    parser.add_argument("--kind", choices=["pretrain", "sft", "dpo"], default="pretrain")
    parser.add_argument("--data_path", help="JSONL file (default: the bundled data/<kind>.jsonl)")
    parser.add_argument(
        "--max_seq_length", type=int, default=DataArguments.max_seq_length, help="as the training command will use it"
    )
    parser.add_argument("--padding_free", action="store_true", help="pretraining: documents apart, not packed")
    parser.add_argument("--skip_bad_lines", action="store_true")
    parser.add_argument("--model_name_or_path", help="take this model's tokenizer")
    parser.add_argument("--tokenizer_name_or_path", help="default: the model's, else the bundled tokenizer/")
    parser.add_argument("--data_cache_dir", help="default: $MINIMIND_CACHE/data, else ~/.cache/minimind/data")
    parser.add_argument("--num_proc", type=int, help="tokenising processes (default: every available core)")
    args = parser.parse_args(argv)
    logging.basicConfig(format="%(message)s", level=logging.WARNING, handlers=[logging.StreamHandler(sys.stdout)])
    logging.getLogger("minimind.data.pipeline").setLevel(logging.INFO)  # the progress bar; the summary is printed
    data_path = args.data_path or BUNDLED_DATA[args.kind]
    if args.kind == "dpo":
        dataset = build_dpo_dataset(data_path, args.skip_bad_lines, data_cache_dir=args.data_cache_dir)
        print(f"dpo data: {len(dataset):,} pairs in {dataset.cache_files[0]['filename']}")
        return dataset
    tokenizer = load_tokenizer(
        ModelArguments(model_name_or_path=args.model_name_or_path, tokenizer_name_or_path=args.tokenizer_name_or_path)
    )
    dataset = build_dataset(
        args.kind,
        data_path,
        tokenizer,
        args.max_seq_length,
        skip_bad_lines=args.skip_bad_lines,
        padding_free=args.padding_free,
        num_proc=args.num_proc,
        data_cache_dir=args.data_cache_dir,
    )
    meta = dataset.meta
    print(summary(meta, dataset.directory, cached=dataset.from_cache))
    print(f"prepared: {dataset.directory} ({meta['tokens']:,} tokens, {meta['rows']:,} rows)")
    return dataset
