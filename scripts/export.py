"""Export MiniMind to a native Qwen3 checkpoint or to GGUF: the `minimind-export` command, run from a checkout.

python scripts/export.py --to qwen3 --model_name_or_path runs/sft --output_dir runs/sft-qwen3
"""

from minimind.cli import export as main

if __name__ == "__main__":
    main()
