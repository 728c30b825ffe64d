"""Serve a MiniMind checkpoint over an OpenAI-compatible HTTP API: the `minimind-serve` command, run from a checkout.

python scripts/serve.py --model_name_or_path runs/sft --port 8000
"""

from minimind.cli import serve as main

if __name__ == "__main__":
    main()
