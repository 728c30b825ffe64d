"""Benchmark MiniMind against transformers' Qwen3 / Qwen3-MoE (same weights, same run) and write the table.

    python scripts/benchmark.py                     # full run (about 10 minutes on 2 CPU cores)
    python scripts/benchmark.py --quick --output /tmp/bench.md
    python scripts/benchmark.py --rows 'decode-*' --device cuda
"""

import argparse
import sys

import torch

from minimind.benchmark import BenchmarkSettings, run_benchmark


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--quick", action="store_true", help="tiny shapes, one repeat: checks every code path")
    parser.add_argument("--rows", nargs="*", default=[], help="row ids or glob patterns (default: all rows)")
    parser.add_argument("--repeats", type=int, help="timed repeats per model (default 4, decode 2, quick 1)")
    parser.add_argument("--warmup", type=int, help="untimed runs per model first (default 1, train 2)")
    parser.add_argument("--compile", default="auto", choices=["auto", "on", "off"],
                        help="torch.compile the static-cache decode row (auto: on for cuda only)")
    parser.add_argument("--attn", default="sdpa", help="attention kernel for both models, e.g. flash_attention_2")
    parser.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's choice)")
    parser.add_argument("--profile", nargs="*", default=[],
                        help="row ids or glob patterns: print torch.profiler's op table for ours and native")
    parser.add_argument("--output", default="docs/benchmarks.md", help="markdown file to write ('-' = none)")
    args = parser.parse_args(argv)

    if args.threads:
        torch.set_num_threads(args.threads)
    settings = BenchmarkSettings(device=args.device, quick=args.quick, rows=args.rows, repeats=args.repeats,
                                 warmup=args.warmup, compile=args.compile, attn_implementation=args.attn,
                                 profile=args.profile,
                                 command=" ".join(["python scripts/benchmark.py", *(argv or sys.argv[1:])]))

    def write(report):
        if args.output != "-":
            with open(args.output, "w") as out:
                out.write(report.markdown())

    # The file is rewritten after every row, so a run stopped early still leaves the rows it finished.
    report = run_benchmark(settings, log=lambda line: print(line, file=sys.stderr, flush=True), on_row=write)
    write(report)
    print(report.table())
    if args.output != "-":
        print(f"wrote {args.output}", file=sys.stderr)


if __name__ == "__main__":
    main()
