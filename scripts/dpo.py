"""Direct preference optimisation with TRL's DPOTrainer (data/dpo.jsonl format: chosen / rejected chats).

    python scripts/dpo.py --model_name_or_path out/sft --output_dir out/dpo --beta 0.1 --max_steps 300

Takes every DPOConfig flag (--beta, --loss_type, ...) besides the TrainingArguments ones.
"""

from minimind.training import BUNDLED_DATA, dpo_config_class, parse_args, run_cli, run_dpo


def main(argv=None):
    model_args, data_args, training_args = parse_args(argv, training_args_class=dpo_config_class(),
                                                      output_dir="out/dpo", data_path=BUNDLED_DATA["dpo"])
    return run_dpo(model_args, data_args, training_args)


if __name__ == "__main__":
    run_cli(main)
