"""The Trainer subclasses: causal LM (with perplexity), distillation (with its KL term), and TRL's DPOTrainer with
a frozen reference; all save through `HFDirectoryMixin`."""

from __future__ import annotations

import copy
import math

import torch
import torch.nn.functional as F
from transformers import Trainer

from minimind.training.saving import HFDirectoryMixin


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
