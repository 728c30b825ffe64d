"""What a run trains on and with: its tokenizer, its datasets (checked before any model is built) and the model,
loaded from a directory or built new from a preset and size flags."""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from configuration_minimind import MiniMindConfig

# Importing the minimind package registers MiniMind with the Auto classes (used by from_config below).
from minimind.data import build_dataset, build_dpo_dataset, split_train_eval
from minimind.loading import load_model, model_directory, read_minimind_config
from minimind.tokenizer import load_tokenizer as _load_checked_tokenizer

logger = logging.getLogger(__package__)  # the package's one logger, `minimind.training`

REPO_ROOT = Path(__file__).resolve().parents[2]
BUNDLED_TOKENIZER = REPO_ROOT / "tokenizer"
# The generated corpus shipped with the repo, per data kind (scripts use these unless --data_path is given).
BUNDLED_DATA = {kind: str(REPO_ROOT / "data" / f"{kind}.jsonl") for kind in ("pretrain", "sft", "dpo")}
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

    Pretrain and sft rows are tokenised once and cached (memory-mapped `minimind.data.TokenDataset`s); a prepared
    directory is read directly. DPO pairs are validated here (file:line errors) and stay conversations, in Arrow
    files: TRL tokenises them (prompt = the shared messages, completions = the two final assistant replies)."""
    if not data_args.data_path:
        raise ValueError("no training data. Fix: pass --data_path FILE.jsonl")
    options = dict(data_cache_dir=data_args.data_cache_dir)
    if kind == "dpo":
        dataset = build_dpo_dataset(data_args.data_path, data_args.skip_bad_lines, **options)
    else:
        dataset = build_dataset(
            kind,
            data_args.data_path,
            tokenizer,
            data_args.max_seq_length,
            skip_bad_lines=data_args.skip_bad_lines,
            padding_free=padding_free,
            num_proc=data_args.num_proc,
            **options,
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
