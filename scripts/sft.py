"""Supervised fine-tuning on chats (data/sft.jsonl format); only assistant replies are trained, batches are padded.

    python scripts/sft.py --model_name_or_path out/pretrain --output_dir out/sft --max_steps 1000
"""

from minimind.training import BUNDLED_DATA, parse_args, run_cli, run_sft


def main(argv=None):
    model_args, data_args, training_args = parse_args(argv, output_dir="out/sft", data_path=BUNDLED_DATA["sft"])
    return run_sft(model_args, data_args, training_args)


if __name__ == "__main__":
    run_cli(main)
