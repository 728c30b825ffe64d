"""Benchmark MiniMind against transformers' Qwen3 / Qwen3-MoE (same weights, same run) and write the table.

Run from the repository root (bench/ is not installed):

python -m bench                          # full run -> docs/results.md
python -m bench --quick --output /tmp/bench.md
python -m bench --rows 'decode-*' --device cuda
python -m bench --table peers            # llama.cpp on our GGUF export, padded vs padding-free SFT, the server
python -m bench --table data             # preparing 10, 100 and 500 MB corpora: MB/s, peak RSS, cached first step
"""

import argparse
import os
import shlex
import sys

import torch

from bench import run_benchmark
from bench.measure import inductor_cache_of_caps
from bench.report import merge_results
from bench.workloads import TABLES, BenchmarkSettings
from minimind.heap import keep_heap

DEFAULT_OUTPUT = "docs/results.md"


def parser():
    parser = argparse.ArgumentParser(
        prog="python -m bench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--quick", action="store_true", help="tiny shapes, one repeat: checks every code path")
    parser.add_argument("--rows", nargs="*", default=[], help="row ids or glob patterns (default: all rows)")
    parser.add_argument("--repeats", type=int, help="timed repeats per model (default 4, decode 2, quick 1)")
    parser.add_argument("--warmup", type=int, help="untimed runs per model first (default 1, train 2)")
    parser.add_argument(
        "--compile",
        default="auto",
        choices=["auto", "on", "off"],
        help="torch.compile the static-cache decode row (auto: on for cuda only)",
    )
    parser.add_argument("--attn", default="sdpa", help="attention kernel for both models, e.g. flash_attention_2")
    parser.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's choice)")
    parser.add_argument(
        "--profile",
        nargs="*",
        default=[],
        help="row ids or glob patterns: print torch.profiler's op table for ours and native",
    )
    parser.add_argument(
        "--table",
        default="main",
        choices=TABLES,
        help="main: vs transformers' Qwen3; peers: llama.cpp on the GGUF export and padded vs "
        "padding-free SFT (CPU), its section replacing the output file's '## Peers'; all: both; data: preparing "
        "pretraining and SFT corpora of 10-500 MB (its own '## Data preparation' section)",
    )
    parser.add_argument("--output", default=DEFAULT_OUTPUT, help="markdown file to write ('-' = none)")
    return parser


def main(argv=None):
    """The command line; returns the report."""
    args = parser().parse_args(argv)
    keep_heap()  # every row runs in a process set up as the inference commands set theirs
    if directory := inductor_cache_of_caps():
        print(f"inductor's cache for these CPU caps: {directory}", file=sys.stderr, flush=True)
    if args.threads:
        torch.set_num_threads(args.threads)
    settings = BenchmarkSettings(
        device=args.device,
        quick=args.quick,
        rows=args.rows,
        repeats=args.repeats,
        warmup=args.warmup,
        compile=args.compile,
        attn_implementation=args.attn,
        profile=args.profile,
        table=args.table,
        command=" ".join(["python -m bench", *map(shlex.quote, sys.argv[1:] if argv is None else argv)]),
    )
    previous = ""
    if args.output != "-" and os.path.exists(args.output):
        with open(args.output) as existing:
            previous = existing.read()
    dropped = []

    def write(report):
        if args.output == "-":
            return
        # Each run rewrites the machine and its own table's section, and keeps the rest of the file.
        text, dropped[:] = merge_results(previous, report.markdown())
        with open(args.output, "w") as out:
            out.write(text)

    def log(line):
        print(line, file=sys.stderr, flush=True)

    # The file is rewritten after every row, so a run stopped early still leaves the rows it finished.
    report = run_benchmark(settings, log=log, on_row=write)
    write(report)
    print(report.table())
    if args.output != "-":
        if dropped:
            log(
                f"{args.output}: dropped its {' and '.join(dropped)} section, measured on another machine (rerun here)"
            )
        log(f"wrote {args.output}")
    return report


if __name__ == "__main__":
    main()
