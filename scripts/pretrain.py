"""Pretrain MiniMind on packed text blocks (data/pretrain.jsonl format: {"text": ...} per line).

    python scripts/pretrain.py --output_dir out/pretrain --hidden_size 512 --num_hidden_layers 8 --max_steps 2000
    accelerate launch --num_processes 2 scripts/pretrain.py ...        # or: torchrun --nproc_per_node 2 ...

Every TrainingArguments flag works (--bf16, --gradient_accumulation_steps, --resume_from_checkpoint last, ...).
"""

from minimind.training import BUNDLED_DATA, parse_args, run_cli, run_pretrain


def main(argv=None):
    model_args, data_args, training_args = parse_args(argv, output_dir="out/pretrain",
                                                      data_path=BUNDLED_DATA["pretrain"])
    return run_pretrain(model_args, data_args, training_args)


if __name__ == "__main__":
    run_cli(main)
