"""LoRA fine-tuning with PEFT: the `minimind-lora` command, run from a checkout.

python scripts/lora.py --model_name_or_path out/sft --output_dir out/lora --max_steps 500 --merge
"""

from minimind.cli import lora as main

if __name__ == "__main__":
    main()
