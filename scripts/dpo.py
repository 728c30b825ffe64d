"""Direct preference optimisation with TRL's DPOTrainer: the `minimind-dpo` command, run from a checkout.

python scripts/dpo.py --model_name_or_path out/sft --output_dir out/dpo --beta 0.1 --max_steps 300
"""

from minimind.cli import dpo as main

if __name__ == "__main__":
    main()
