"""Pretrain MiniMind on packed text blocks: the `minimind-pretrain` command, run from a checkout.

python scripts/pretrain.py --output_dir out/pretrain --hidden_size 512 --num_hidden_layers 8 --max_steps 2000
"""

from minimind.cli import pretrain as main

if __name__ == "__main__":
    main()
