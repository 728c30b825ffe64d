"""The one training core behind the pretrain, sft, lora, dpo, distill and demo commands (`minimind.cli`).

Every command is: parse arguments (`parse_args`), then call one `run_*` function here, each a thin choice of
task-specific pieces for the one recipe, `run_training`. The loop is always a transformers `Trainer` (DPO: TRL's
`DPOTrainer`, which is one), so `accelerate launch` / `torchrun`, FSDP, DeepSpeed, bf16, gradient accumulation
and checkpointing behave as documented for transformers.

Order inside `run_training`: tokenizer, datasets, model, trainer. Datasets come first so that a malformed data
line (`minimind.data.DataFormatError`, with file name and line number) stops the run before any model is built.

Every directory we write (final output and each checkpoint-N) is a complete Hugging Face model directory:
config.json with auto_map, both model .py files, model.safetensors, generation_config.json, tokenizer files
saved with `minimind.tokenizer.save_tokenizer` (class PreTrainedTokenizerFast), and training_args.json
(Trainer's pickled training_args.bin is replaced, so model directories hold no pickle at all).
"""

from __future__ import annotations

import copy
import errno
import json
import logging
import math
import os
import shutil
import sys
import warnings
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
import transformers
from transformers import AutoModelForCausalLM, HfArgumentParser, Trainer, TrainingArguments
from transformers.hf_argparser import string_to_bool
from transformers.trainer import TRAINER_STATE_NAME
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, rotate_checkpoints

from configuration_minimind import MiniMindConfig

# Importing the minimind package registers MiniMind with the Auto classes (used by from_config below).
from minimind.data import build_dataset, collator, read_jsonl, split_train_eval
from minimind.distributed import restore_model_code, shard_for_cpu_fsdp
from minimind.errors import InputError
from minimind.loading import load_model, load_native_causal_lm, model_directory, read_minimind_config
from minimind.tokenizer import load_tokenizer as _load_checked_tokenizer
from minimind.tokenizer import save_tokenizer
from modeling_minimind import safetensors_problem

logger = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parent.parent
BUNDLED_TOKENIZER = REPO_ROOT / "tokenizer"
# The generated corpus shipped with the repo, per data kind (scripts use these unless --data_path is given).
BUNDLED_DATA = {kind: str(REPO_ROOT / "data" / f"{kind}.jsonl") for kind in ("pretrain", "sft", "dpo")}
# PEFT LoRA targets by module name. Explicit names, not "all-linear": that would also wrap `mlp.gate`, which in
# MoE layers is the router. In MoE layers these names also match every expert's projections.
LORA_TARGET_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
MODEL_SIZE_FIELDS = (
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "intermediate_size",
    "max_position_embeddings",
    "num_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
)
PRESETS = ("minillama_0_04b",)
RESUME_LATEST = ("last", "latest", "true", "auto")


# --------------------------------------------------------------------------------------------------------------
# Arguments
# --------------------------------------------------------------------------------------------------------------


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
    data_path: str | None = field(default=None, metadata={"help": "JSONL training file (see minimind/data.py)."})
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


def setup_run(training_args):
    """Logging and warnings for this process, and the seed set before the model is built so that its init is
    reproducible."""
    transformers.set_seed(training_args.seed)
    logging.basicConfig(
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        level=logging.INFO,
        handlers=[logging.StreamHandler(sys.stdout)],
        force=True,
    )
    level = training_args.get_process_log_level()
    logger.setLevel(level)
    logging.getLogger("minimind").setLevel(level)
    transformers.utils.logging.set_verbosity(min(level, logging.WARNING))
    # PEFT 0.21 (LoRA) and TRL 1.16 (DPO, every step) read the `is_gradient_checkpointing` that transformers 5.24
    # deprecates; the warning asks the user of a command for nothing they could change.
    warnings.filterwarnings("ignore", "`is_gradient_checkpointing` is deprecated", FutureWarning)


# --------------------------------------------------------------------------------------------------------------
# Tokenizer, data, model
# --------------------------------------------------------------------------------------------------------------


def load_tokenizer(model_args):
    """The run's tokenizer: --tokenizer_name_or_path, else the starting model's own, else the bundled one. The
    starting model's directory is checked here (it exists and is MiniMind's), before any data is read."""
    model_dir = None
    if model_args.model_name_or_path is not None:
        model_dir = model_directory(model_args.model_name_or_path)
        read_minimind_config(model_dir)
    path = model_args.tokenizer_name_or_path
    if path is None:
        path = model_dir if model_dir is not None and (model_dir / "tokenizer.json").is_file() else BUNDLED_TOKENIZER
    return _load_checked_tokenizer(path)


def load_datasets(kind, data_args, tokenizer, seed=42, padding_free=False):
    """(train, eval or None) for kind pretrain/sft/dpo. Raises DataFormatError for bad or empty data.

    DPO pairs are validated here (file:line errors) and stay conversations: TRL tokenises them (prompt = the
    shared messages, completions = the two final assistant replies)."""
    if not data_args.data_path:
        raise ValueError("no training data. Fix: pass --data_path FILE.jsonl")
    if kind == "dpo":
        from datasets import Dataset

        rows, _ = read_jsonl(data_args.data_path, "dpo", data_args.skip_bad_lines)
        # Tools as a JSON string: TRL parses it back; as a column of nested structs Arrow would merge its keys.
        dataset = Dataset.from_list(
            [
                {"chosen": row["chosen"], "rejected": row["rejected"], "tools": json.dumps(row.get("tools") or None)}
                for row in rows
            ]
        )
    else:
        dataset = build_dataset(
            kind,
            data_args.data_path,
            tokenizer,
            data_args.max_seq_length,
            skip_bad_lines=data_args.skip_bad_lines,
            padding_free=padding_free,
        )
    return split_train_eval(dataset, data_args.eval_fraction, seed)


def build_config(model_args, tokenizer):
    """A new MiniMindConfig from the preset and size flags, with vocabulary and special ids from the tokenizer."""
    sizes = {name: getattr(model_args, name) for name in MODEL_SIZE_FIELDS if getattr(model_args, name) is not None}
    tokens = dict(
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    make = getattr(MiniMindConfig, model_args.preset) if model_args.preset else MiniMindConfig
    return make(**sizes, **tokens, use_moe=model_args.use_moe)


def load_causal_lm(name_or_path):
    # fp32 master weights whatever the checkpoint dtype (transformers 5 defaults to the checkpoint's);
    # --bf16 then trains with autocast. The model is training's to change: out of eval mode.
    return load_model(name_or_path, dtype=torch.float32).train()


def build_model(model_args, tokenizer):
    if model_args.model_name_or_path:
        model = load_causal_lm(model_args.model_name_or_path)
    else:
        model = AutoModelForCausalLM.from_config(build_config(model_args, tokenizer))
    if model.get_input_embeddings().num_embeddings < len(tokenizer):
        raise ValueError(
            f"the model has {model.get_input_embeddings().num_embeddings} embeddings but the "
            f"tokenizer has {len(tokenizer)} tokens. Fix: use the tokenizer the model was trained with."
        )
    # generate() reads these from generation_config.json; keep them equal to the tokenizer's.
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        setattr(model.generation_config, name, getattr(tokenizer, name))
    n_params = sum(p.numel() for p in model.parameters())
    logger.info("model: %s, %s parameters", type(model).__name__, f"{n_params:,}")
    return model


# --------------------------------------------------------------------------------------------------------------
# Saving and resuming
# --------------------------------------------------------------------------------------------------------------


def finish_hf_directory(output_dir, tokenizer, training_args=None):
    """Make a directory that save_pretrained wrote a complete, pickle-free HF model directory."""
    save_tokenizer(tokenizer, output_dir)
    pickled_args = Path(output_dir) / "training_args.bin"  # torch.save'd by Trainer, read by nothing
    if pickled_args.exists():
        pickled_args.unlink()
    if training_args is not None:
        (Path(output_dir) / "training_args.json").write_text(training_args.to_json_string(), encoding="utf-8")


def save_hf_directory(model, tokenizer, output_dir, training_args=None):
    model.save_pretrained(output_dir)
    finish_hf_directory(output_dir, tokenizer, training_args)


# Checkpoints are assembled here, inside --output_dir (same filesystem, so the final rename is atomic) and outside
# the `checkpoint-*` names that Trainer's rotation and our resume look at.
STAGING_DIR = ".checkpoint-staging"


class HFDirectoryMixin:
    """Trainer mixin: the final save and every checkpoint-N go through `_save`, so all are complete HF dirs; and
    checkpoint-N appears only complete.

    transformers (5.17 to 5.24) writes a checkpoint straight into `checkpoint-N`, so a kill during a save leaves a
    partial directory, and saving step N over an older `checkpoint-N` mixes old and new files. Here Trainer writes
    it into `<output_dir>/.checkpoint-staging/checkpoint-N`; once every process has finished, it is renamed to
    `checkpoint-N` (an older one of that name is moved aside first) and only then are old checkpoints rotated
    out. A kill at any moment leaves the previous checkpoints complete and `checkpoint-N` either absent or
    complete. With --push_to_hub Trainer uploads the checkpoint directory in the background, so it is written
    in place as transformers does."""

    _staging_root = None

    def _save(self, output_dir=None, state_dict=None):
        super()._save(output_dir, state_dict)
        if self.args.should_save:
            restore_model_code(self.model, output_dir or self.args.output_dir)  # FSDP2 saves torch's code instead
            finish_hf_directory(output_dir or self.args.output_dir, self.processing_class, self.args)

    def _get_output_dir(self, trial):
        return self._staging_root or super()._get_output_dir(trial)

    def _save_checkpoint(self, model, trial):
        if self.args.push_to_hub:
            return super()._save_checkpoint(model, trial)
        run_dir = Path(super()._get_output_dir(trial))
        name = f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
        staging_root = run_dir / STAGING_DIR
        staged, final, replaced = staging_root / name, run_dir / name, staging_root / f"replaced-{name}"
        if self.args.should_save:  # what a killed save of this step left behind
            shutil.rmtree(staged, ignore_errors=True)
            shutil.rmtree(replaced, ignore_errors=True)
        self.accelerator.wait_for_everyone()
        self._staging_root = str(staging_root)
        try:
            super()._save_checkpoint(model, trial)
        except Exception as error:
            raise self._full_disk_error(error, run_dir, staging_root, name) or error  # noqa: B904 (the same error)
        finally:
            self._staging_root = None
        self.accelerator.wait_for_everyone()  # every rank has written its RNG (and sharded) state
        if not self.args.should_save:
            return
        best = self.state.best_model_checkpoint
        try:
            if best is not None and Path(best).parent == staging_root:
                # Trainer recorded the staging path as the best checkpoint; record where it will live instead.
                self.state.best_model_checkpoint = str(run_dir / Path(best).name)
                self.state.save_to_json(str(staged / TRAINER_STATE_NAME))
            _fsync_tree(staged)  # so that a power cut cannot reorder the rename before the data
        except Exception as error:
            raise self._full_disk_error(error, run_dir, staging_root, name) or error  # noqa: B904 (the same error)
        if final.exists():
            os.replace(final, replaced)
        os.replace(staged, final)
        _fsync_tree(run_dir, files=False)
        shutil.rmtree(staging_root, ignore_errors=True)
        # Trainer rotated inside the staging directory (a no-op); rotate the real checkpoints now that N exists.
        rotate_checkpoints(
            output_dir=str(run_dir),
            save_total_limit=self.args.save_total_limit,
            best_model_checkpoint=self.state.best_model_checkpoint,
            use_mtime=True,
        )

    def _full_disk_error(self, error, run_dir, staging_root, name):
        """The InputError for a checkpoint save that failed on a full filesystem (None for any other failure, which
        keeps its traceback). The staged files are removed: they are no checkpoint, and the room they take is what
        the user must find."""
        need, basis = self._checkpoint_size_estimate(run_dir)
        if not disk_is_full(error, run_dir, need):
            return None
        if self.args.should_save:
            shutil.rmtree(staging_root, ignore_errors=True)
        previous = checkpoint_dirs(run_dir)
        kept = (
            f"The newest earlier checkpoint, {previous[max(previous)].name}, is intact."
            if previous
            else "No checkpoint was saved before it."
        )
        return full_disk_error(error, run_dir, f"{name} (the unfinished save was removed)", need, basis, kept)

    def _checkpoint_size_estimate(self, run_dir):
        """(bytes, what that figure is) for one checkpoint: the newest one's size, else the model's parameters plus
        the optimizer's state tensors."""
        steps = checkpoint_dirs(run_dir)
        if steps:
            newest = steps[max(steps)]
            return sum(f.stat().st_size for f in newest.rglob("*") if f.is_file()), f"the size of {newest.name}"
        tensors = list(self.model.parameters())
        if self.optimizer is not None:
            tensors += [
                value for state in self.optimizer.state.values() for value in state.values() if torch.is_tensor(value)
            ]
        return sum(t.numel() * t.element_size() for t in tensors), "the model's parameters plus optimizer state"


def disk_is_full(error, directory, need):
    """Whether a save into `directory` failed for want of space. An OSError says so by errno, safetensors (a Rust
    writer) only in its message, and torch.save's zip writer not at all (its RuntimeError names a stream position),
    so less free room than the save needs counts too."""
    if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    if "No space left on device" in str(error) or "Disk quota exceeded" in str(error):
        return True
    try:
        return shutil.disk_usage(directory).free < need
    except OSError:
        return False


def _size(count):
    for unit in ("bytes", "kB", "MB", "GB"):
        if count < 1000:
            return f"{count:.0f} {unit}" if unit == "bytes" else f"{count:.1f} {unit}"
        count /= 1000
    return f"{count:.1f} TB"


def full_disk_error(error, directory, what, need, basis, kept):
    """One line for the user: which filesystem is full, how much the save needs and has, what survived, the fix."""
    cause = " ".join(str(error).split())
    cause = f"{type(error).__name__}: {cause[:200]}{'...' if len(cause) > 200 else ''}"
    return InputError(
        f"no space left on the filesystem of {directory}: saving {what} failed ({cause}). It needs "
        f"about {_size(need)} ({basis}); {_size(shutil.disk_usage(directory).free)} is free. {kept} "
        "Fix: free space there, or pass an --output_dir on a larger filesystem (copying the "
        "checkpoints along), then rerun with --resume_from_checkpoint last."
    )


# What a checkpoint holds for resuming only (names, or the start of names of files and of sharded directories).
RESUME_ONLY_FILES = ("optimizer", "scheduler", "scaler", "rng_state", TRAINER_STATE_NAME)


def _file_stamps(directory):
    return (
        {
            path.name: (stat.st_ino, stat.st_size, stat.st_mtime_ns)
            for path in Path(directory).iterdir()
            if path.is_file() and (stat := path.stat())
        }
        if Path(directory).is_dir()
        else {}
    )


def save_final_model(trainer, output_dir):
    """trainer.save_model(output_dir), with a full disk an InputError. The files this save had written are removed
    then: a half-written model.safetensors, or new weights beside an older run's config, would load as neither."""
    before = _file_stamps(output_dir)
    try:
        trainer.save_model(output_dir)
    except Exception as error:
        steps = checkpoint_dirs(output_dir)
        if steps:  # the final directory is a checkpoint without what only a resume reads
            newest = steps[max(steps)]
            need = sum(
                f.stat().st_size
                for f in newest.rglob("*")
                if f.is_file() and not f.relative_to(newest).parts[0].startswith(RESUME_ONLY_FILES)
            )
            basis = f"{newest.name} without its optimizer, scheduler and RNG state"
        else:
            need = sum(p.numel() * p.element_size() for p in trainer.model.parameters())
            basis = "the model's parameters alone"
        if not disk_is_full(error, output_dir, need):
            raise
        if trainer.args.should_save:
            for name, stamp in _file_stamps(output_dir).items():
                if before.get(name) != stamp:
                    (Path(output_dir) / name).unlink(missing_ok=True)
        kept = "Its checkpoints are intact." if steps else "No checkpoint was saved."
        raise full_disk_error(
            error, output_dir, "the final model (its partial files were removed)", need, basis, kept
        ) from error


def _fsync_tree(path, files=True):
    """Flush `path` (a directory) and, with files=True, everything below it to disk."""
    paths = [path, *(p for p in Path(path).rglob("*"))] if files else [path]
    for item in paths:
        if not (item.is_dir() or item.is_file()):
            continue
        try:
            fd = os.open(item, os.O_RDONLY)
        except OSError:  # directories cannot be opened on every platform (Windows)
            continue
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


OPTIMIZER_FILE, SCHEDULER_FILE, SCALER_FILE = "optimizer.pt", "scheduler.pt", "scaler.pt"
WEIGHT_FILES = ("model.safetensors", "adapter_model.safetensors")  # full model, or a PEFT (LoRA) adapter
SHARDED_WEIGHTS_INDEX = "model.safetensors.index.json"


def _safetensors_problem(path):
    """None if `path` is a complete safetensors file: its header read, the file exactly as long as the header's
    data offsets say, so a truncated or padded file is caught without reading tensors."""
    if not path.is_file():
        return f"{path.name} is missing"
    problem = safetensors_problem(path)
    return f"{path.name} is damaged ({problem})" if problem else None


def _torch_file_problem(path, load=False):
    """None if `path` is a complete torch.save file. torch.save writes a zip archive whose central directory is at
    the very end, so a truncated file is no readable archive; checked without unpickling or loading tensors. With
    load=True (the small scheduler, scaler and RNG files) it is also loaded as Trainer loads it (weights_only, with
    Trainer's numpy allowlist for the RNG state), so damage inside a whole archive is caught here too, not as a
    pickle traceback after the model is built."""
    if not path.is_file():
        return f"{path.name} is missing"
    try:
        with zipfile.ZipFile(path) as archive:
            archive.infolist()
    except (zipfile.BadZipFile, OSError) as error:
        return f"{path.name} is damaged (not a complete torch.save file: {error})"
    if load:
        from transformers.trainer_pt_utils import safe_globals

        try:
            with safe_globals():
                torch.load(path, map_location="cpu", weights_only=True)
        except Exception as error:  # noqa: BLE001 - whatever the unpickler raises, the file cannot be resumed from
            # The weights_only unpickler wraps its reason in paragraphs about trusting the file; keep the reason.
            text = str(error).split("WeightsUnpickler error:")[-1]
            reason = next((line.strip() for line in text.splitlines() if line.strip()), "")
            return f"{path.name} is damaged (torch.load fails: {type(error).__name__}: {reason})"
    return None


# JSON files that Trainer (config.json) or PEFT (adapter_config.json) read on resume when they are present.
CONFIG_FILES = ("config.json", "adapter_config.json")


def _json_object_problem(path):
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:  # UnicodeDecodeError is a ValueError
        return f"{path.name} is damaged ({error})"
    return None if isinstance(value, dict) else f"{path.name} is damaged (not a JSON object)"


def _weights_problems(path):
    for name in WEIGHT_FILES:
        if (path / name).exists():
            return [problem for problem in [_safetensors_problem(path / name)] if problem]
    index = path / SHARDED_WEIGHTS_INDEX
    if index.exists():
        try:
            shards = sorted(set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
            return [f"{SHARDED_WEIGHTS_INDEX} is damaged ({error!r})"]
        return [problem for shard in shards if (problem := _safetensors_problem(path / shard))]
    if any(child.name.startswith("pytorch_model_fsdp") for child in path.iterdir()):
        return []  # FSDP's sharded state, loaded (and checked) by accelerate
    return [f"{WEIGHT_FILES[0]} is missing (no model weights)"]


def _trainer_state_problem(path):
    state_file = path / TRAINER_STATE_NAME
    if not state_file.is_file():
        return f"{TRAINER_STATE_NAME} is missing"
    try:
        state = json.loads(state_file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        return f"{TRAINER_STATE_NAME} is damaged ({error})"
    if not isinstance(state, dict) or not isinstance(state.get("global_step"), int):
        return f"{TRAINER_STATE_NAME} is damaged (no integer global_step)"
    return None


def checkpoint_problems(path, training_args=None, scaler=False):
    """What a resume with `training_args` would need from checkpoint `path` and is missing or damaged: [] when
    the checkpoint is complete.

    Trainer loads the weights and trainer_state.json always; unless --save_only_model also optimizer.pt and
    scheduler.pt (it silently starts a fresh optimizer if either is missing), the RNG state of every process
    (rng_state.pth, or rng_state_<rank>.pth per process of a multi-process run; missing ones only log at info
    level), and scaler.pt when the run uses a gradient scaler (fp16). Under DeepSpeed the weights, optimizer and
    scheduler are DeepSpeed's own files, which DeepSpeed checks. config.json (adapter_config.json for LoRA) is read
    when present, so it must then be a JSON object. Without `training_args`: a full single- or multi-process
    checkpoint."""
    path = Path(path)
    if not path.is_dir():
        return ["it is not a directory"]
    problems = [problem for problem in [_trainer_state_problem(path)] if problem]
    problems += [
        problem for name in CONFIG_FILES if (path / name).exists() and (problem := _json_object_problem(path / name))
    ]
    deepspeed = bool(getattr(training_args, "deepspeed", None))
    if not deepspeed:
        problems += _weights_problems(path)
    if getattr(training_args, "save_only_model", False):
        return problems
    if not deepspeed:
        # Trainer also takes an optimizer saved as optimizer.bin or in a sharded optimizer_* directory (FSDP).
        other_optimizer = (path / "optimizer.bin").is_file() or any(
            child.is_dir() and "optimizer" in child.name for child in path.iterdir()
        )
        if (path / OPTIMIZER_FILE).exists() or not other_optimizer:
            problems.append(_torch_file_problem(path / OPTIMIZER_FILE))
        problems.append(_torch_file_problem(path / SCHEDULER_FILE, load=True))
    if training_args is None:
        rng_files = sorted(path.glob("rng_state*.pth")) or [path / "rng_state.pth"]
    elif training_args.world_size > 1:
        rng_files = [path / f"rng_state_{rank}.pth" for rank in range(training_args.world_size)]
    else:
        rng_files = [path / "rng_state.pth"]
    problems += [_torch_file_problem(rng_file, load=True) for rng_file in rng_files]
    if scaler and not deepspeed:
        problems.append(_torch_file_problem(path / SCALER_FILE, load=True))
    return [problem for problem in problems if problem]


def is_complete_checkpoint(path, training_args=None, scaler=False):
    """Whether checkpoint `path` holds everything a resume with `training_args` loads, each file readable."""
    return not checkpoint_problems(path, training_args, scaler)


def checkpoint_dirs(output_dir):
    """{step: path} of the checkpoint-N directories in output_dir."""
    steps = {}
    if Path(output_dir).is_dir():
        for path in Path(output_dir).glob(f"{PREFIX_CHECKPOINT_DIR}-*"):
            step = path.name.rsplit("-", 1)[1]
            if path.is_dir() and step.isdigit():
                steps[int(step)] = path
    return steps


def latest_complete_checkpoint(output_dir, training_args=None, scaler=False):
    """Newest complete checkpoint-N in output_dir, or None. Newer incomplete ones are skipped with a warning that
    names each missing or damaged file."""
    steps = checkpoint_dirs(output_dir)
    for step in sorted(steps, reverse=True):
        problems = checkpoint_problems(steps[step], training_args, scaler)
        if not problems:
            return str(steps[step])
        logger.warning(
            "not resuming from %s: %s; falling back to an older checkpoint", steps[step], "; ".join(problems)
        )
    return None


def resolve_resume_checkpoint(training_args, scaler=False):
    """--resume_from_checkpoint PATH, or 'last' (also true/auto/latest): the newest complete checkpoint in
    --output_dir (see `checkpoint_problems`); starts fresh with a warning when there is no checkpoint yet, so the
    same command can be rerun. Raises InputError for an incomplete PATH, and for 'last' when checkpoints exist
    but none is complete: neither may silently lose the state they hold."""
    value = training_args.resume_from_checkpoint
    if not value:
        return None
    if value.lower() in RESUME_LATEST:
        checkpoint = latest_complete_checkpoint(training_args.output_dir, training_args, scaler)
        if checkpoint is None:
            damaged = [str(path) for _, path in sorted(checkpoint_dirs(training_args.output_dir).items())]
            if damaged:
                raise InputError(
                    f"--resume_from_checkpoint {value}: no checkpoint in {training_args.output_dir} is complete "
                    f"({', '.join(damaged)}; the warnings above name the missing or damaged files). Fix: restore "
                    "those files, or move the checkpoint directories away to start from scratch."
                )
            logger.warning("no checkpoint in %s yet; starting from scratch", training_args.output_dir)
        return checkpoint
    problems = checkpoint_problems(value, training_args, scaler)
    if problems:
        raise InputError(
            f"--resume_from_checkpoint {value}: not a complete checkpoint: {'; '.join(problems)}. "
            "Fix: restore the file(s), or pass --resume_from_checkpoint last to take the newest "
            "complete checkpoint."
        )
    return value


# --------------------------------------------------------------------------------------------------------------
# Trainers
# --------------------------------------------------------------------------------------------------------------


def perplexity(loss):
    try:
        return math.exp(loss)
    except OverflowError:
        return float("inf")


class CausalLMTrainer(HFDirectoryMixin, Trainer):
    """Trainer that saves complete HF directories and reports `eval_perplexity = exp(eval_loss)`."""

    def evaluation_loop(
        self, dataloader, description, prediction_loss_only=None, ignore_keys=None, metric_key_prefix="eval"
    ):
        output = super().evaluation_loop(dataloader, description, prediction_loss_only, ignore_keys, metric_key_prefix)
        loss = output.metrics.get(f"{metric_key_prefix}_loss")
        if loss is not None:  # added here, inside evaluate(), so the logged metrics carry it too
            output.metrics[f"{metric_key_prefix}_perplexity"] = perplexity(loss)
        return output


def distillation_kl(student_logits, teacher_logits, labels, temperature):
    """Mean over labelled positions of T^2 * KL(softmax(teacher/T) || softmax(student/T)).

    Position t predicts labels[t+1] (the model shifts labels the same way), so logits are cut at the end and
    labels at the start. T^2 keeps the gradient scale independent of T (Hinton et al., 2015)."""
    student = F.log_softmax(student_logits[:, :-1].float() / temperature, dim=-1)
    teacher = F.log_softmax(teacher_logits[:, :-1].float() / temperature, dim=-1)
    mask = labels[:, 1:] != -100
    per_token = F.kl_div(student, teacher, log_target=True, reduction="none").sum(-1)  # [B, T-1]
    return per_token[mask].sum() / mask.sum().clamp(min=1) * temperature**2


class DistillationTrainer(CausalLMTrainer):
    """Trains the student on alpha * distillation KL + (1 - alpha) * CE. Evaluation reports the student's plain CE
    (and perplexity), so eval numbers compare with pretrain/SFT runs."""

    # Both terms are per-micro-batch token means; Trainer divides them by the accumulation steps.
    loss_is_scaled_for_ga = False

    def __init__(self, *args, teacher_model, temperature=2.0, alpha=0.5, **kwargs):
        super().__init__(*args, **kwargs)
        self.teacher_model = teacher_model.to(self.args.device).eval().requires_grad_(False)
        self.temperature, self.alpha = temperature, alpha

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        outputs = model(**inputs)
        loss = outputs.loss
        if model.training:
            with torch.no_grad():
                # position_ids too: padding-free batches mark where each example starts with them.
                teacher_inputs = {
                    key: inputs[key] for key in ("input_ids", "attention_mask", "position_ids") if key in inputs
                }
                teacher_logits = self.teacher_model(**teacher_inputs).logits
            if teacher_logits.shape[-1] != outputs.logits.shape[-1]:
                raise ValueError(
                    f"teacher vocabulary ({teacher_logits.shape[-1]}) differs from the student's "
                    f"({outputs.logits.shape[-1]}). Fix: use a teacher with the student's tokenizer."
                )
            kl = distillation_kl(outputs.logits, teacher_logits, inputs["labels"], self.temperature)
            loss = self.alpha * kl + (1 - self.alpha) * loss
        return (loss, outputs) if return_outputs else loss


# --------------------------------------------------------------------------------------------------------------
# Running
# --------------------------------------------------------------------------------------------------------------


def loss_curve(log_history):
    """[(step, training loss)] from Trainer's log history."""
    return [(entry["step"], entry["loss"]) for entry in log_history if "loss" in entry and "step" in entry]


def write_loss_curve(log_history, output_dir):
    """Write loss_curve.md (a step | loss table) and, if matplotlib is installed, loss_curve.png. Returns paths."""
    curve = loss_curve(log_history)
    if not curve:
        return []
    md = Path(output_dir) / "loss_curve.md"
    rows = "".join(f"| {step} | {loss:.4f} |\n" for step, loss in curve)
    md.write_text("| step | training loss |\n|---:|---:|\n" + rows, encoding="utf-8")
    paths = [md]
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return paths
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(*zip(*curve))
    ax.set(xlabel="step", ylabel="training loss", title="MiniMind training loss")
    fig.savefig(Path(output_dir) / "loss_curve.png", dpi=100, bbox_inches="tight")
    plt.close(fig)
    return paths + [Path(output_dir) / "loss_curve.png"]


def train_and_save(trainer, training_args):
    """Train (resuming if asked), save the final HF directory, evaluate, and save metrics and the loss curve."""
    uses_scaler = getattr(trainer.accelerator, "scaler", None) is not None
    checkpoint = resolve_resume_checkpoint(training_args, scaler=uses_scaler)
    result = trainer.train(resume_from_checkpoint=checkpoint)
    save_final_model(trainer, training_args.output_dir)
    metrics = dict(result.metrics)
    if trainer.eval_dataset is not None:
        metrics.update(trainer.evaluate())
    trainer.log_metrics("all", metrics)
    trainer.save_metrics("all", metrics)
    trainer.save_state()
    if trainer.args.should_save:
        write_loss_curve(trainer.state.log_history, training_args.output_dir)
    return trainer, metrics


def run_training(
    kind, model_args, data_args, training_args, trainer_class=CausalLMTrainer, adapt_model=None, **trainer_kwargs
):
    """The one training recipe behind every command: logging and seed, tokenizer, datasets of `kind` (pretrain,
    sft or dpo; before the model, so that bad data stops the run before anything is built), model (`adapt_model`
    may wrap it, e.g. in LoRA adapters), collator, `trainer_class`, then train, save and evaluate. Returns
    (trainer, metrics); metrics include eval_loss and eval_perplexity when --eval_fraction > 0."""
    setup_run(training_args)
    tokenizer = load_tokenizer(model_args)
    train_dataset, eval_dataset = load_datasets(
        kind, data_args, tokenizer, training_args.seed, padding_free=training_args.padding_free
    )
    logger.info(
        "%s data: %d train / %d eval examples",
        kind,
        len(train_dataset),
        len(eval_dataset) if eval_dataset is not None else 0,
    )
    model = build_model(model_args, tokenizer)
    if adapt_model is not None:
        model = adapt_model(model)
    elif kind != "dpo":  # FSDP requested on CPU processes (accelerate ignores it); LoRA and DPO run DDP there
        model = shard_for_cpu_fsdp(model, training_args)
    if eval_dataset is None:
        training_args.eval_strategy = "no"
    # DPOTrainer tokenises the pairs and batches them itself.
    data_collator = None if kind == "dpo" else collator(kind, tokenizer, training_args.padding_free)
    trainer = trainer_class(
        model=model,
        args=training_args,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        data_collator=data_collator,
        processing_class=tokenizer,
        **trainer_kwargs,
    )
    return train_and_save(trainer, training_args)


def run_pretrain(model_args, data_args, training_args):
    """Causal-LM pretraining on packed blocks (or, padding-free, on whole documents)."""
    return run_training("pretrain", model_args, data_args, training_args)


def run_sft(model_args, data_args, training_args):
    """Chat fine-tuning, loss on assistant replies only."""
    return run_training("sft", model_args, data_args, training_args)


def run_lora(model_args, data_args, lora_args, training_args):
    """LoRA fine-tuning with PEFT. Saves the adapter to --output_dir and with --merge also the merged full model
    to <output_dir>/merged."""
    from peft import LoraConfig, get_peft_model

    lora = LoraConfig(
        r=lora_args.lora_r,
        lora_alpha=lora_args.lora_alpha,
        lora_dropout=lora_args.lora_dropout,
        target_modules=lora_args.lora_target_modules,
        task_type="CAUSAL_LM",
    )

    def add_adapters(model):
        model = get_peft_model(model, lora)
        model.print_trainable_parameters()
        return model

    trainer, metrics = run_training(
        lora_args.data_kind, model_args, data_args, training_args, adapt_model=add_adapters
    )
    if lora_args.merge and training_args.should_save:
        merged = trainer.accelerator.unwrap_model(trainer.model).merge_and_unload()
        save_hf_directory(merged, trainer.processing_class, Path(training_args.output_dir) / "merged", training_args)
    return trainer, metrics


def dpo_trainer_class():
    """TRL's DPOTrainer with our saving (imported lazily: TRL takes seconds to import)."""
    from trl import DPOTrainer

    class MiniMindDPOTrainer(HFDirectoryMixin, DPOTrainer):
        """The reference is a frozen copy of the starting model: TRL would reload it from the config's path,
        which a model built from size flags does not have."""

        def __init__(self, model, args, **kwargs):
            reference = copy.deepcopy(model).eval().requires_grad_(False)
            super().__init__(model=model, ref_model=reference, args=args, **kwargs)

    return MiniMindDPOTrainer


def dpo_config_class():
    from trl import DPOConfig

    return DPOConfig


def run_dpo(model_args, data_args, training_args):
    """DPO (sigmoid loss, --beta) with TRL's DPOTrainer against a frozen copy of the starting model."""
    training_args.max_length = data_args.max_seq_length  # one length flag for all scripts
    return run_training("dpo", model_args, data_args, training_args, trainer_class=dpo_trainer_class())


def run_distill(model_args, data_args, distill_args, training_args):
    """Knowledge distillation from --teacher_name_or_path into the student (--model_name_or_path or size flags)."""
    if not distill_args.teacher_name_or_path:
        raise ValueError("no teacher. Fix: pass --teacher_name_or_path DIR_OR_ID")
    teacher = load_native_causal_lm(distill_args.teacher_name_or_path, dtype=torch.float32)
    return run_training(
        distill_args.data_kind,
        model_args,
        data_args,
        training_args,
        trainer_class=DistillationTrainer,
        teacher_model=teacher,
        temperature=distill_args.temperature,
        alpha=distill_args.alpha,
    )
