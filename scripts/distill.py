"""Knowledge distillation: the student learns a teacher's temperature-softened distribution plus the labels.

    python scripts/distill.py --teacher_name_or_path out/sft --hidden_size 256 --num_hidden_layers 4 \
        --output_dir out/distill --temperature 2.0 --alpha 0.5 --max_steps 1000

The teacher is any causal LM loadable by AutoModelForCausalLM that shares the student's vocabulary.
"""

from minimind.training import BUNDLED_DATA, DistillArguments, parse_args, run_cli, run_distill


def main(argv=None):
    model_args, data_args, distill_args, training_args = parse_args(
        argv, DistillArguments, output_dir="out/distill", data_path=BUNDLED_DATA["sft"])
    return run_distill(model_args, data_args, distill_args, training_args)


if __name__ == "__main__":
    run_cli(main)
