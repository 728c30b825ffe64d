"""TRL's own trainers on MiniMind, used directly as a user's script would (not through minimind.training),
against transformers' Qwen3 with the same weights: a dense MiniMind must look dense to TRL."""

import pytest
import torch
from transformers import AutoTokenizer

from conftest import model_dir
from minimind.export import to_qwen3_model

trl = pytest.importorskip("trl")


def chats(n=8):
    from datasets import Dataset

    return Dataset.from_list([{"messages": [{"role": "user", "content": f"What is {i} plus 1?"},
                                            {"role": "assistant", "content": f"{i} plus 1 is {i + 1}."}]}
                              for i in range(n)])


def sft_losses(model, tokenizer, output_dir):
    args = trl.SFTConfig(output_dir=str(output_dir), max_steps=2, per_device_train_batch_size=4, learning_rate=1e-3,
                         report_to=[], use_cpu=True, bf16=False, logging_steps=1, save_strategy="no", seed=0,
                         disable_tqdm=True)
    trainer = trl.SFTTrainer(model=model, args=args, train_dataset=chats(), processing_class=tokenizer)
    trainer.train()
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


def test_sft_trainer_trains_a_dense_minimind_exactly_like_qwen3(tmp_path):
    ours = model_dir(tmp_path / "model", std=0.02)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "model")
    theirs = to_qwen3_model(ours)
    assert not hasattr(ours.config, "output_router_logits")  # TRL's MoE aux-loss switch stays off, as for Qwen3
    ours_losses = sft_losses(ours.train(), tokenizer, tmp_path / "ours")
    theirs_losses = sft_losses(theirs.train(), tokenizer, tmp_path / "theirs")
    assert len(ours_losses) == 2
    assert ours_losses == pytest.approx(theirs_losses, rel=1e-4)


def test_sft_trainer_adds_the_moe_aux_loss_for_a_moe_minimind(tmp_path):
    ours = model_dir(tmp_path / "model", std=0.02, use_moe=True, num_experts=4, num_experts_per_tok=2)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "model")
    assert ours.config.output_router_logits is False and ours.config.router_aux_loss_coef == 5e-4
    losses = sft_losses(ours.train(), tokenizer, tmp_path / "ours")
    assert len(losses) == 2 and all(torch.isfinite(torch.tensor(losses)))
