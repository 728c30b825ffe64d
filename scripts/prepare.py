"""Tokenise a data file into the cache ahead of training: the `minimind-prepare` command, run from a checkout.

python scripts/prepare.py --kind pretrain --data_path data/pretrain.jsonl --max_seq_length 512
"""

from minimind.cli import prepare as main

if __name__ == "__main__":
    main()
