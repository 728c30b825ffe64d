"""The one training recipe, `run_training`, and the `run_*` function of each command, each a thin choice of
task-specific pieces for it.

Every command is: parse arguments (`parse_args`), then call one `run_*` function. The loop is always a transformers
`Trainer` (DPO: TRL's `DPOTrainer`, which is one), so `accelerate launch` / `torchrun`, FSDP, DeepSpeed, bf16,
gradient accumulation and checkpointing behave as documented for transformers.

Order inside `run_training`: tokenizer, datasets, model, trainer. Datasets come first so that a malformed data
line (`minimind.data.DataFormatError`, with file name and line number) stops the run before any model is built.
"""

from __future__ import annotations

import logging
import sys
import warnings
from pathlib import Path

import torch
import transformers

from minimind.data import collator
from minimind.distributed import shard_for_cpu_fsdp
from minimind.loading import load_native_causal_lm
from minimind.training.arguments import slow_bf16_warning
from minimind.training.checkpoints import resolve_resume_checkpoint
from minimind.training.curves import write_loss_curve
from minimind.training.model import build_model, load_datasets, load_tokenizer
from minimind.training.saving import save_final_model, save_hf_directory
from minimind.training.trainers import CausalLMTrainer, DistillationTrainer, dpo_trainer_class

logger = logging.getLogger(__package__)  # the package's one logger, `minimind.training`


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
    slow_bf16 = slow_bf16_warning(training_args)
    if slow_bf16:
        logger.warning(slow_bf16)


def prepared_metrics(train_dataset, eval_dataset, training_args):
    """--prepare_only: what was prepared and where (printed by the main process), instead of training."""
    directory = getattr(train_dataset, "directory", None)
    if directory is None and getattr(train_dataset, "cache_files", None):  # DPO pairs: Arrow files
        directory = Path(train_dataset.cache_files[0]["filename"]).parent
    metrics = {
        "data": str(directory),
        "train_rows": len(train_dataset),
        "eval_rows": len(eval_dataset) if eval_dataset is not None else 0,
    }
    meta = getattr(train_dataset, "meta", None)
    if meta is not None:
        metrics.update(tokens=meta["tokens"], stored_tokens=meta["stored_tokens"])
    if training_args.process_index == 0:
        print(" ".join(f"{name}={value}" for name, value in metrics.items()), flush=True)
    return metrics


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
    # Under torchrun/accelerate the main process of each machine tokenises (or finds the cache); the others wait,
    # then open the same cache entry. Each rank's DataLoader then reads its own share of the rows.
    with training_args.main_process_first(desc="tokenising the data"):
        train_dataset, eval_dataset = load_datasets(
            kind, data_args, tokenizer, training_args.seed, padding_free=getattr(training_args, "padding_free", False)
        )
    if getattr(data_args, "prepare_only", False):
        return None, prepared_metrics(train_dataset, eval_dataset, training_args)
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
