"""Benchmark MiniMind against transformers' Qwen3 / Qwen3-MoE: the `minimind-benchmark` command, run from a checkout.

python scripts/benchmark.py --quick --output /tmp/bench.md
"""

from minimind.cli import benchmark as main

if __name__ == "__main__":
    main()
