"""The training commands' arguments: the dataclasses each command parses, the parser, the script defaults."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers import HfArgumentParser, TrainingArguments
from transformers.hf_argparser import string_to_bool

from minimind.hardware import cpu_computes_natively

# PEFT LoRA targets by module name. Explicit names, not "all-linear": that would also wrap `mlp.gate`, which in
# MoE layers is the router. In MoE layers these names also match every expert's projections.
LORA_TARGET_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PRESETS = ("minillama_0_04b",)


@dataclass
class ModelArguments:
    """Which model to train: an existing directory/Hub id, or a new MiniMind from a preset and size flags."""

    model_name_or_path: str | None = field(
        default=None,
        metadata={
            "help": "Start from this model (directory or Hub id, loaded with trust_remote_code). "
            "Without it a new MiniMind is built from --preset and the size flags."
        },
    )
    preset: str | None = field(
        default=None, metadata={"help": "Start a new model from a MiniMindConfig preset.", "choices": PRESETS}
    )
    hidden_size: int | None = field(default=None, metadata={"help": "New model only (default: MiniMindConfig's)."})
    num_hidden_layers: int | None = None
    num_attention_heads: int | None = None
    num_key_value_heads: int | None = None
    intermediate_size: int | None = None
    max_position_embeddings: int | None = None
    use_moe: bool = field(default=False, metadata={"help": "New model only: sparse MoE MLPs."})
    num_experts: int | None = None
    num_experts_per_tok: int | None = None
    moe_intermediate_size: int | None = None
    tokenizer_name_or_path: str | None = field(
        default=None,
        metadata={"help": "Default: the model directory's tokenizer if it has one, else the bundled tokenizer/."},
    )


@dataclass
class DataArguments:
    data_path: str | None = field(
        default=None,
        metadata={
            "help": "JSONL training file (formats: minimind/data/validate.py), or a directory minimind-prepare made."
        },
    )
    max_seq_length: int = field(
        default=512, metadata={"help": "Pretraining: packed block length. Chat data: truncation length."}
    )
    eval_fraction: float = field(
        default=0.01,
        metadata={"help": "Share of the data held out for eval loss and perplexity (0 disables evaluation)."},
    )
    skip_bad_lines: bool = field(
        default=False, metadata={"help": "Skip malformed lines with a warning instead of stopping at the first one."}
    )
    data_cache_dir: str | None = field(
        default=None,
        metadata={
            "help": "Where tokenised data is cached (default: $MINIMIND_CACHE/data, else ~/.cache/minimind/data)."
        },
    )
    num_proc: int | None = field(
        default=None, metadata={"help": "Processes that tokenise the data (default: every available core)."}
    )
    prepare_only: bool = field(
        default=False,
        metadata={"help": "Tokenise and cache the data, print where and how many tokens, and stop (no model)."},
    )


@dataclass
class LoraArguments:
    lora_r: int = 8
    lora_alpha: int = 16
    lora_dropout: float = 0.05
    lora_target_modules: list[str] = field(default_factory=lambda: list(LORA_TARGET_MODULES))
    merge: bool = field(
        default=False, metadata={"help": "Also save base+adapter merged into a full model in <output_dir>/merged."}
    )
    data_kind: str = field(default="sft", metadata={"choices": ["sft", "pretrain"]})


@dataclass
class DistillArguments:
    teacher_name_or_path: str | None = field(
        default=None,
        metadata={
            "help": "Teacher: a MiniMind directory, or a model of an architecture transformers ships (no remote "
            "code), with the student's vocabulary."
        },
    )
    temperature: float = field(default=2.0, metadata={"help": "Softens both distributions in the KL term."})
    alpha: float = field(
        default=0.5,
        metadata={"help": "loss = alpha * T^2 * KL(teacher || student) + (1 - alpha) * cross-entropy on the labels."},
    )
    data_kind: str = field(default="sft", metadata={"choices": ["sft", "pretrain"]})


@dataclass
class MiniMindTrainingArguments(TrainingArguments):
    """TrainingArguments plus `padding_free`, a switch TRL's DPOConfig has under the same name: so the flag means
    the same in every command, and the DPO command, parsed with DPOConfig, takes TRL's."""

    padding_free: bool = field(
        default=False,
        metadata={
            "help": "Pretraining and chat data: each batch is one row of its examples back to back, position ids "
            "restarting at every example, no padding tokens. Pretraining then keeps documents apart (split "
            "at --max_seq_length) instead of packing fixed blocks, and --per_device_train_batch_size counts "
            "documents or chats."
        },
    )


# Script defaults for TrainingArguments: small logs, resumable checkpoints, no external loggers.
TRAINING_DEFAULTS = dict(
    logging_steps=10,
    save_steps=500,
    save_total_limit=2,
    report_to="none",
    per_device_train_batch_size=8,
    per_device_eval_batch_size=8,
)


def hardware_bf16(use_cpu=False):
    """bf16 mixed precision where a CUDA GPU supports it, fp32 everywhere else."""
    return not use_cpu and torch.cuda.is_available() and torch.cuda.is_bf16_supported()


def slow_bf16_warning(training_args) -> str | None:
    """What to tell a user who asks for --bf16 on a CPU that emulates it: every product is converted in software,
    so training runs many times slower than in fp32."""
    on_cpu = training_args.use_cpu or not torch.cuda.is_available()
    if training_args.bf16 and on_cpu and cpu_computes_natively(torch.bfloat16) is False:
        return (
            "--bf16 on a CPU without native bfloat16 (no avx512_bf16 or amx_bf16): training runs many times slower "
            "than in fp32; drop --bf16 to train in fp32"
        )
    return None


class ArgumentParser(HfArgumentParser):
    """HfArgumentParser for the training commands.

    Precision follows the hardware unless the user chose: without --bf16, --no_bf16 or --fp16, a run trains in
    bf16 where a CUDA GPU supports it and in fp32 elsewhere (TRL's DPOConfig would default to bf16 and refuse to
    start on a CPU). Activation checkpointing is off unless asked for. `--activation_checkpointing` (the current
    name) is accepted under transformers releases that only know `--gradient_checkpointing` as well, so documented
    commands run under both."""

    def __init__(self, dataclass_types, **kwargs):
        super().__init__(dataclass_types, **kwargs)
        bf16 = self._option_string_actions["--bf16"]
        bf16.nargs, bf16.const = "?", True  # a bare --bf16 for DPOConfig too (its optional field wants a value)
        if "--no_bf16" not in self._option_string_actions:
            self.add_argument(
                "--no_bf16",
                "--no-bf16",
                dest="bf16",
                action="store_false",
                help="train in fp32 even where bf16 is available",
            )
        for name in ("activation_checkpointing", "activation_checkpointing_kwargs"):
            if f"--{name}" not in self._option_string_actions:
                old = self._option_string_actions[f"--{name.replace('activation', 'gradient')}"]
                self.add_argument(
                    f"--{name}",
                    dest=old.dest,
                    type=old.type,
                    nargs=old.nargs,
                    const=old.const,
                    help=f"same as --{old.dest} in this transformers release",
                )
        # TrainingArguments takes "all", "non_padding" or "no" here (or a bool); HfArgumentParser reads `str | bool`
        # as a bool and refuses "non_padding", the count that tells real tokens from padding.
        tokens_seen = self._option_string_actions["--include_num_input_tokens_seen"]
        tokens_seen.type = lambda value: value if value in ("all", "non_padding", "no") else string_to_bool(value)
        # Activation checkpointing is off unless asked for, in every command. TRL's configs switch it on (through the
        # name transformers 5.24 deprecates, which warns); TrainingArguments' own default is off: "unset" (None)
        # where the current name exists, False before.
        checkpointing_off = TrainingArguments.__dataclass_fields__["gradient_checkpointing"].default
        self.set_defaults(bf16=None, gradient_checkpointing=checkpointing_off)

    def parse_known_args(self, args=None, namespace=None):
        namespace, remaining = super().parse_known_args(args, namespace)
        if namespace.bf16 is None:  # not chosen by the user
            namespace.bf16 = not namespace.fp16 and hardware_bf16(namespace.use_cpu)
        return namespace, remaining


def parse_args(argv=None, *extra, training_args_class=MiniMindTrainingArguments, **defaults):
    """Parse ModelArguments, DataArguments, *extra dataclasses and the training arguments (last)."""
    parser = ArgumentParser((ModelArguments, DataArguments, *extra, training_args_class))
    parser.set_defaults(**{**TRAINING_DEFAULTS, **defaults})
    return parser.parse_args_into_dataclasses(args=argv)


def dpo_config_class():
    """TRL's DPOConfig, the DPO command's training arguments (imported lazily: TRL takes seconds to import)."""
    from trl import DPOConfig

    return DPOConfig
