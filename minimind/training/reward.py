"""Reward models: TRL's `RewardTrainer` on preference pairs (the `minimind-reward` command), and the safe loading of
a reward-model directory, for training and for GRPO's `--reward_model`.

A reward model is `MiniMindForSequenceClassification` with `num_labels=1`: the backbone of a MiniMind checkpoint
and a linear `score` head read at each sequence's last real token (transformers' generic head, as Qwen3's). It
starts from a causal-LM checkpoint (the SFT model: its backbone loads, `lm_head` is left out, `score` is new) or
from a reward directory this command wrote (backbone and `score`). Either directory is checked before any weights
are read, and loaded with the installed class: code shipped in a model directory is never run. The pairs are the
DPO data (`data/dpo.jsonl`: `chosen` and `rejected` conversations), checked line by line; TRL tokenises each
conversation with the chat template and trains `-log sigmoid(score(chosen) - score(rejected))`.
"""

from __future__ import annotations

import contextlib
import logging

import torch

from minimind.errors import InputError
from minimind.loading import MODEL_TYPE, check_model_directory, model_directory, read_config_json, read_minimind_config

logger = logging.getLogger(__package__)  # the package's one logger, `minimind.training`

HEAD = "score.weight"  # the reward head's one tensor: [num_labels, hidden_size]


def reward_config_class():
    """TRL's RewardConfig, the reward command's training arguments (imported lazily: TRL takes seconds to import)."""
    from trl import RewardConfig

    return RewardConfig


def reward_head_mismatches(directory, config) -> list[str]:
    """What stops the weights in `directory` from filling the `MiniMindForSequenceClassification` that `config`
    builds (missing, unexpected, mis-shaped tensors); empty when they match. Reads no tensor data."""
    from minimind.loading import shape_mismatches
    from modeling_minimind import MiniMindForSequenceClassification

    with torch.device("meta"):
        model = MiniMindForSequenceClassification(config)
    return shape_mismatches(model, directory)


def check_reward_directory(name_or_path, *, head_required=False, hub=True):
    """(directory, config, has_head) for a MiniMind directory a reward model can load from: a reward directory
    (its `score` head one output wide, its tensors those the config builds) or, unless `head_required`, a causal-LM
    checkpoint (checked as every command checks one; the head is then new). An `InputError` otherwise."""
    from minimind.loading import _weight_shapes

    directory = model_directory(name_or_path, hub=hub)
    config = read_minimind_config(directory)
    if HEAD not in _weight_shapes(directory):
        if head_required:
            raise InputError(
                f"{directory} has no reward head ({HEAD}): it is a language model, not a reward model, and its "
                "scores would come from a random head. Fix: train a reward model from it with minimind-reward "
                "and pass that directory"
            )
        check_model_directory(directory, hub=False)
        return directory, config, False
    if config.num_labels != 1:
        raise InputError(
            f"{directory}: its head has {config.num_labels} outputs; a reward model has one (num_labels=1). Fix: "
            "pass a directory written by minimind-reward"
        )
    if problems := reward_head_mismatches(directory, config):
        raise InputError(
            f"{directory}: config.json does not match the weights ({'; '.join(problems)}). Fix: restore the "
            "config.json saved with these weights; a model loaded this way would be partly random"
        )
    return directory, config, True


@contextlib.contextmanager
def _expected_head_change():
    """Silences transformers' report that `lm_head` is left out and `score` is new when a causal-LM checkpoint opens
    as a reward model: both are the point (TRL's own context for this, when it has one)."""
    try:
        from trl.trainer.reward_trainer import suppress_seqcls_warning
    except ImportError:  # another TRL layout: the warning is only noise
        suppress_seqcls_warning = contextlib.nullcontext
    with suppress_seqcls_warning():
        yield


def load_reward_model(name_or_path, *, dtype=torch.float32, head_required=False, hub=True):
    """A `MiniMindForSequenceClassification` with one output (eval mode, on the CPU) from a checked MiniMind
    directory (see `check_reward_directory`): a causal-LM checkpoint's backbone under a new `score` head (drawn from
    torch's generator: seed first for a reproducible head), or a reward directory as saved."""
    from modeling_minimind import MiniMindForSequenceClassification

    directory, config, has_head = check_reward_directory(name_or_path, head_required=head_required, hub=hub)
    config.num_labels = 1
    with _expected_head_change():
        model = MiniMindForSequenceClassification.from_pretrained(directory, config=config, dtype=dtype)
    logger.info("reward model from %s (%s head)", directory, "its own" if has_head else "a new")
    return model.eval()


def load_scoring_model(name_or_path, *, dtype=torch.float32):
    """(model, tokenizer) of a reward model for GRPO's `--reward_model`, code in the directory never run: a MiniMind
    reward directory with the installed class and our checked tokenizer loader, or a sequence-classification model
    of an architecture transformers itself ships (`trust_remote_code=False` for model and tokenizer). A MiniMind
    language model without a reward head, or a directory of any other model type, is an `InputError`."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    from minimind.loading import NotMiniMindError
    from minimind.loading import load_tokenizer as load_checked_tokenizer

    directory = model_directory(name_or_path)
    settings = read_config_json(directory)
    model_type = settings.get("model_type")
    if model_type == MODEL_TYPE:
        model = load_reward_model(directory, dtype=dtype, head_required=True, hub=False)
        return model, load_checked_tokenizer(directory, hub=False)
    if model_type not in CONFIG_MAPPING:
        code = (
            " and names code of its own (auto_map), which MiniMind commands never run"
            if "auto_map" in settings
            else ""
        )
        raise NotMiniMindError(
            f"{directory} is not a reward model MiniMind can load: its config.json says model_type {model_type!r}, "
            f"neither {MODEL_TYPE!r} nor one transformers ships{code}. Fix: pass a directory written by "
            "minimind-reward, or a sequence-classification model of a transformers architecture"
        )
    model = AutoModelForSequenceClassification.from_pretrained(
        directory, num_labels=1, dtype=dtype, trust_remote_code=False
    )
    return model.eval(), AutoTokenizer.from_pretrained(directory, trust_remote_code=False)


def reward_trainer_class():
    """TRL's RewardTrainer saving complete MiniMind directories (imported lazily: TRL takes seconds to import)."""
    from trl import RewardTrainer

    from minimind.training.saving import HFDirectoryMixin

    class MiniMindRewardTrainer(HFDirectoryMixin, RewardTrainer):
        pass

    return MiniMindRewardTrainer


def build_reward_model(model_args, tokenizer):
    """The run's reward model: from --model_name_or_path (see `load_reward_model`), else a new MiniMind of the
    preset and size flags (a reward model normally starts from the SFT checkpoint)."""
    from minimind.training.model import MODEL_SIZE_FIELDS, build_config
    from modeling_minimind import MiniMindForSequenceClassification

    if model_args.model_name_or_path:
        model = load_reward_model(model_args.model_name_or_path)
    elif model_args.preset or any(getattr(model_args, name) is not None for name in MODEL_SIZE_FIELDS):
        config = build_config(model_args, tokenizer)
        config.num_labels = 1
        model = MiniMindForSequenceClassification(config)
    else:
        raise ValueError(
            "no starting model. Fix: pass --model_name_or_path with the SFT checkpoint the reward model starts "
            "from (e.g. runs/sft), or --preset / size flags for a new model"
        )
    if model.get_input_embeddings().num_embeddings < len(tokenizer):
        raise ValueError(
            f"the model has {model.get_input_embeddings().num_embeddings} embeddings but the "
            f"tokenizer has {len(tokenizer)} tokens. Fix: use the tokenizer the model was trained with."
        )
    # The head reads each row at its last token that is not padding: padding is the tokenizer's pad token.
    model.config.pad_token_id = tokenizer.pad_token_id
    n_params = sum(p.numel() for p in model.parameters())
    logger.info("model: %s, %s parameters", type(model).__name__, f"{n_params:,}")
    return model.float().train()  # fp32 master weights; --bf16 trains with autocast


def run_reward(model_args, data_args, training_args):
    """Train a reward model with TRL's RewardTrainer on the DPO pairs (`chosen`/`rejected` conversations), from
    --model_name_or_path (the SFT checkpoint). Pairs longer than --max_seq_length tokens (either side) are left out,
    as TRL does; a run that would keep none is refused. Returns (trainer, metrics); the metrics include
    eval_accuracy (share of held-out pairs scored chosen > rejected) and eval_margin when --eval_fraction > 0."""
    from minimind.training.model import load_datasets, load_tokenizer
    from minimind.training.recipes import prepared_metrics, setup_run, train_and_save

    training_args.max_length = data_args.max_seq_length  # one length flag for all scripts
    setup_run(training_args)
    tokenizer = load_tokenizer(model_args)
    with training_args.main_process_first(desc="checking the pairs"):
        train_dataset, eval_dataset = load_datasets("dpo", data_args, tokenizer, training_args.seed)
    if data_args.prepare_only:
        return None, prepared_metrics(train_dataset, eval_dataset, training_args)
    logger.info(
        "reward data: %d train / %d eval pairs",
        len(train_dataset),
        len(eval_dataset) if eval_dataset is not None else 0,
    )
    model = build_reward_model(model_args, tokenizer)
    if eval_dataset is None:
        training_args.eval_strategy = "no"
    trainer = reward_trainer_class()(
        model=model,
        args=training_args,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        processing_class=tokenizer,
    )
    kept = len(trainer.train_dataset)
    if kept == 0:
        raise InputError(
            f"{data_args.data_path}: every training pair is longer than --max_seq_length "
            f"{data_args.max_seq_length} tokens on one side. Fix: raise --max_seq_length"
        )
    if kept < len(train_dataset):
        logger.warning(
            "%d of %d training pairs are longer than --max_seq_length %d tokens and are left out",
            len(train_dataset) - kept,
            len(train_dataset),
            data_args.max_seq_length,
        )
    return train_and_save(trainer, training_args)
