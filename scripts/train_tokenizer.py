"""Train MiniMind's byte-level BPE tokenizer: the `minimind-train-tokenizer` command, run from a checkout.

python scripts/train_tokenizer.py --output_dir tokenizer
"""

from minimind.cli import train_tokenizer as main

if __name__ == "__main__":
    main()
