"""GRPO with TRL's GRPOTrainer and verifiable rewards: the `minimind-grpo` command, run from a checkout.

python scripts/grpo.py --model_name_or_path runs/demo/sft --output_dir runs/grpo --max_steps 40
"""

from minimind.cli import grpo as main

if __name__ == "__main__":
    main()
