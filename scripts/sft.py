"""Supervised fine-tuning on chats, only assistant replies trained: the `minimind-sft` command, from a checkout.

python scripts/sft.py --model_name_or_path out/pretrain --output_dir out/sft --max_steps 1000
"""

from minimind.cli import sft as main

if __name__ == "__main__":
    main()
