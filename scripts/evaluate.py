"""Evaluate a MiniMind directory (lm-evaluation-harness tasks and a tool-calling score): the `minimind-eval`
command, run from a checkout.

    python scripts/evaluate.py --model_name_or_path runs/sft --limit 50
"""

from minimind.cli import evaluate as main

if __name__ == "__main__":
    main()
