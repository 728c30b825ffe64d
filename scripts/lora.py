"""LoRA fine-tuning with PEFT on q/k/v/o and gate/up/down projections (MoE experts included, router excluded).

    python scripts/lora.py --model_name_or_path out/sft --output_dir out/lora --max_steps 500 --merge

Saves the adapter to --output_dir; with --merge also a full merged model to <output_dir>/merged.
"""

from minimind.training import BUNDLED_DATA, LoraArguments, parse_args, run_cli, run_lora


def main(argv=None):
    model_args, data_args, lora_args, training_args = parse_args(argv, LoraArguments, output_dir="out/lora",
                                                                 data_path=BUNDLED_DATA["sft"])
    return run_lora(model_args, data_args, lora_args, training_args)


if __name__ == "__main__":
    run_cli(main)
