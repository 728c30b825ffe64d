"""A reward model with TRL's RewardTrainer: the `minimind-reward` command, run from a checkout.

python scripts/reward.py --model_name_or_path out/sft --output_dir out/reward --max_steps 200
"""

from minimind.cli import reward as main

if __name__ == "__main__":
    main()
