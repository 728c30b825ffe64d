"""Knowledge distillation into MiniMind: the `minimind-distill` command, run from a checkout.

python scripts/distill.py --teacher_name_or_path out/sft --hidden_size 256 --num_hidden_layers 4 \
    --output_dir out/distill
"""

from minimind.cli import distill as main

if __name__ == "__main__":
    main()
