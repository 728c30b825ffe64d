"""The one training core behind the pretrain, sft, lora, dpo, distill and demo commands (`minimind.cli`).

Every name is importable from here; each lives in the module that does its job:

- `arguments`: the argument dataclasses, `ArgumentParser` and `parse_args`, the script defaults.
- `model`: the run's tokenizer, datasets and model (`load_tokenizer`, `load_datasets`, `build_model`), and the
  bundled tokenizer and data (`BUNDLED_TOKENIZER`, `BUNDLED_DATA`).
- `saving`: complete Hugging Face directories for the output and every checkpoint-N (`HFDirectoryMixin`,
  `save_hf_directory`, `save_final_model`), and a full disk as one line (`full_disk_error`).
- `checkpoints`: what a resume needs (`checkpoint_problems`, `latest_complete_checkpoint`,
  `resolve_resume_checkpoint`).
- `trainers`: `CausalLMTrainer`, `DistillationTrainer` and TRL's DPO trainer (`dpo_trainer_class`).
- `curves`: loss_curve.md and loss_curve.png from the log history.
- `recipes`: `run_training`, the one recipe, and the commands' `run_pretrain`, `run_sft`, `run_lora`, `run_dpo`,
  `run_distill`.
- `reward`: reward models with TRL's RewardTrainer (`run_reward`, `reward_config_class`) and their checked loading
  (`load_reward_model`, and `load_scoring_model` for GRPO's `--reward_model`).
"""

from minimind.training.arguments import (
    LORA_TARGET_MODULES,
    PRESETS,
    TRAINING_DEFAULTS,
    ArgumentParser,
    DataArguments,
    DistillArguments,
    LoraArguments,
    MiniMindTrainingArguments,
    ModelArguments,
    dpo_config_class,
    hardware_bf16,
    parse_args,
)
from minimind.training.checkpoints import (
    CONFIG_FILES,
    OPTIMIZER_FILE,
    RESUME_LATEST,
    SCALER_FILE,
    SCHEDULER_FILE,
    SHARDED_WEIGHTS_INDEX,
    WEIGHT_FILES,
    checkpoint_dirs,
    checkpoint_problems,
    is_complete_checkpoint,
    latest_complete_checkpoint,
    resolve_resume_checkpoint,
)
from minimind.training.checkpoints import _safetensors_problem as _safetensors_problem  # read by the tests
from minimind.training.curves import loss_curve, write_loss_curve
from minimind.training.model import (
    BUNDLED_DATA,
    BUNDLED_TOKENIZER,
    MODEL_SIZE_FIELDS,
    REPO_ROOT,
    build_config,
    build_model,
    load_causal_lm,
    load_datasets,
    load_tokenizer,
)
from minimind.training.recipes import (
    run_distill,
    run_dpo,
    run_lora,
    run_pretrain,
    run_sft,
    run_training,
    setup_run,
    train_and_save,
)
from minimind.training.reward import (
    build_reward_model,
    check_reward_directory,
    load_reward_model,
    load_scoring_model,
    reward_config_class,
    reward_trainer_class,
    run_reward,
)
from minimind.training.saving import (
    RESUME_ONLY_FILES,
    STAGING_DIR,
    HFDirectoryMixin,
    disk_is_full,
    finish_hf_directory,
    full_disk_error,
    save_final_model,
    save_hf_directory,
)
from minimind.training.saving import _size as _size  # read by the tests
from minimind.training.trainers import (
    CausalLMTrainer,
    DistillationTrainer,
    distillation_kl,
    dpo_trainer_class,
    perplexity,
)

__all__ = [
    "BUNDLED_DATA",
    "BUNDLED_TOKENIZER",
    "CONFIG_FILES",
    "LORA_TARGET_MODULES",
    "MODEL_SIZE_FIELDS",
    "OPTIMIZER_FILE",
    "PRESETS",
    "REPO_ROOT",
    "RESUME_LATEST",
    "RESUME_ONLY_FILES",
    "SCALER_FILE",
    "SCHEDULER_FILE",
    "SHARDED_WEIGHTS_INDEX",
    "STAGING_DIR",
    "TRAINING_DEFAULTS",
    "WEIGHT_FILES",
    "ArgumentParser",
    "CausalLMTrainer",
    "DataArguments",
    "DistillArguments",
    "DistillationTrainer",
    "HFDirectoryMixin",
    "LoraArguments",
    "MiniMindTrainingArguments",
    "ModelArguments",
    "build_config",
    "build_model",
    "build_reward_model",
    "check_reward_directory",
    "checkpoint_dirs",
    "checkpoint_problems",
    "disk_is_full",
    "distillation_kl",
    "dpo_config_class",
    "dpo_trainer_class",
    "finish_hf_directory",
    "full_disk_error",
    "hardware_bf16",
    "is_complete_checkpoint",
    "latest_complete_checkpoint",
    "load_causal_lm",
    "load_datasets",
    "load_reward_model",
    "load_scoring_model",
    "load_tokenizer",
    "loss_curve",
    "parse_args",
    "perplexity",
    "resolve_resume_checkpoint",
    "reward_config_class",
    "reward_trainer_class",
    "run_distill",
    "run_dpo",
    "run_lora",
    "run_pretrain",
    "run_reward",
    "run_sft",
    "run_training",
    "save_final_model",
    "save_hf_directory",
    "setup_run",
    "train_and_save",
    "write_loss_curve",
]
