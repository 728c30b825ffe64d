"""The training commands: pretrain, sft, lora, dpo, reward, distill, grpo and the demo (every TrainingArguments flag,
see minimind.training)."""

from __future__ import annotations

from minimind.cli.base import command, make_parser


@command
def pretrain(argv=None):
    """Pretrain MiniMind on packed text blocks (data/pretrain.jsonl format: {"text": ...} per line).

    minimind-pretrain --output_dir out/pretrain --hidden_size 512 --num_hidden_layers 8 --max_steps 2000
    accelerate launch --num_processes 2 scripts/pretrain.py ...      # or: torchrun --nproc_per_node 2 ...
    """
    from minimind.training import BUNDLED_DATA, parse_args, run_pretrain

    model_args, data_args, training_args = parse_args(
        argv, output_dir="out/pretrain", data_path=BUNDLED_DATA["pretrain"]
    )
    return run_pretrain(model_args, data_args, training_args)


@command
def sft(argv=None):
    """Supervised fine-tuning on chats (data/sft.jsonl format); only assistant replies are trained."""
    from minimind.training import BUNDLED_DATA, parse_args, run_sft

    model_args, data_args, training_args = parse_args(argv, output_dir="out/sft", data_path=BUNDLED_DATA["sft"])
    return run_sft(model_args, data_args, training_args)


@command
def lora(argv=None):
    """LoRA fine-tuning with PEFT; with --merge also a full merged model in <output_dir>/merged."""
    from minimind.training import BUNDLED_DATA, LoraArguments, parse_args, run_lora

    model_args, data_args, lora_args, training_args = parse_args(
        argv, LoraArguments, output_dir="out/lora", data_path=BUNDLED_DATA["sft"]
    )
    return run_lora(model_args, data_args, lora_args, training_args)


@command
def dpo(argv=None):
    """Direct preference optimisation with TRL's DPOTrainer (data/dpo.jsonl format); every DPOConfig flag."""
    from minimind.training import BUNDLED_DATA, dpo_config_class, parse_args, run_dpo

    model_args, data_args, training_args = parse_args(
        argv, training_args_class=dpo_config_class(), output_dir="out/dpo", data_path=BUNDLED_DATA["dpo"]
    )
    return run_dpo(model_args, data_args, training_args)


@command
def reward(argv=None):
    """Train a reward model with TRL's RewardTrainer on preference pairs (data/dpo.jsonl format) from the SFT
    checkpoint: MiniMindForSequenceClassification, one score per chat; every RewardConfig flag.

    minimind-reward --model_name_or_path runs/sft --output_dir runs/reward --max_steps 200
    """
    from minimind.training import BUNDLED_DATA, parse_args, reward_config_class, run_reward

    model_args, data_args, training_args = parse_args(
        argv, training_args_class=reward_config_class(), output_dir="out/reward", data_path=BUNDLED_DATA["dpo"]
    )
    return run_reward(model_args, data_args, training_args)


@command
def distill(argv=None):
    """Knowledge distillation from any causal LM teacher that shares the student's vocabulary."""
    from minimind.training import BUNDLED_DATA, DistillArguments, parse_args, run_distill

    model_args, data_args, distill_args, training_args = parse_args(
        argv, DistillArguments, output_dir="out/distill", data_path=BUNDLED_DATA["sft"]
    )
    return run_distill(model_args, data_args, distill_args, training_args)


@command
def grpo(argv=None):
    """GRPO with TRL's GRPOTrainer and verifiable rewards on the bundled chats' fact questions (answer correct,
    format followed; optional length and repetition penalties, --reward module:function, --reward_model DIR).
    Every GRPOConfig flag.

    minimind-grpo --model_name_or_path runs/demo/sft --output_dir runs/grpo --max_steps 40
    """
    from minimind.rl import RewardArguments, grpo_config_class, run_grpo
    from minimind.training import BUNDLED_DATA, parse_args

    # TRL's defaults are for billion-parameter models; these suit MiniMind's short fact answers.
    model_args, data_args, reward_args, training_args = parse_args(
        argv,
        RewardArguments,
        training_args_class=grpo_config_class(),
        output_dir="out/grpo",
        data_path=BUNDLED_DATA["sft"],
        eval_fraction=0.0,
        learning_rate=1e-5,
        num_generations=8,
        max_completion_length=32,
        logging_steps=1,
    )
    return run_grpo(model_args, data_args, reward_args, training_args)


@command
def demo(argv=None):
    """The whole MiniMind pipeline in about five minutes on a CPU: pretrain a small model on the bundled corpus,
    fine-tune it on the bundled chats, save a Hugging Face directory, reload it with AutoModelForCausalLM
    (trust_remote_code=True) and check its greedy answers to the README's questions.

    minimind-demo                        # writes runs/demo/{pretrain,sft}
    """
    from minimind.demo import DemoSettings, run_demo

    defaults = DemoSettings()
    parser = make_parser(demo.__doc__)
    parser.add_argument("--output_dir", default=defaults.output_dir)
    parser.add_argument("--pretrain_steps", type=int, default=defaults.pretrain_steps)
    parser.add_argument("--sft_steps", type=int, default=defaults.sft_steps)
    parser.add_argument("--hidden_size", type=int, default=defaults.hidden_size)
    parser.add_argument("--num_hidden_layers", type=int, default=defaults.num_hidden_layers)
    parser.add_argument("--max_seq_length", type=int, default=defaults.max_seq_length, help="pretraining block length")
    parser.add_argument(
        "--sft_max_seq_length", type=int, default=defaults.sft_max_seq_length, help="the bundled chats are short"
    )
    parser.add_argument("--logging_steps", type=int, default=defaults.logging_steps)
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument(
        "--threads",
        type=int,
        default=defaults.threads,
        help="torch threads; results are reproducible at a fixed count",
    )
    return run_demo(DemoSettings(**vars(parser.parse_args(argv))))
