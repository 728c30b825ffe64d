"""The whole MiniMind pipeline in a few minutes on a laptop CPU: pretrain a small model on the bundled corpus,
fine-tune it on the bundled chats, save a Hugging Face directory, reload it with AutoModelForCausalLM
(trust_remote_code=True) and chat with it.

    python scripts/demo.py                      # writes runs/demo/{pretrain,sft}; ~5 min on 2 CPU cores

The training runs through the same core functions as scripts/pretrain.py and scripts/sft.py.
"""

import argparse
import os
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainingArguments

from minimind.training import (BUNDLED_DATA, DataArguments, ModelArguments, TimeBudgetCallback, loss_curve,
                               run_pretrain, run_sft)

QUESTIONS = ["Who are you?", "What does a tailor do?", "What is 3 plus 4?", "Tell me a short story."]


def idle_cores():
    """Cores not busy with other work. On a shared machine, OpenMP threads that have to fight other jobs for a
    core make every step several times slower than one thread that has a core to itself."""
    cores = os.cpu_count() or 1
    busy = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    return max(1, min(cores, round(cores - busy)))


def training_args(output_dir, steps, batch_size, learning_rate, cli):
    return TrainingArguments(
        output_dir=str(output_dir), max_steps=steps, per_device_train_batch_size=batch_size,
        per_device_eval_batch_size=32, learning_rate=learning_rate, lr_scheduler_type="cosine", warmup_steps=0.05,
        weight_decay=0.01, logging_steps=cli.logging_steps, save_strategy="no", report_to="none", use_cpu=True,
        seed=cli.seed, dataloader_num_workers=0)


def print_curve(title, trainer):
    print(f"\n{title}\n| step | loss |\n|---:|---:|")
    for step, loss in loss_curve(trainer.state.log_history):
        print(f"| {step} | {loss:.3f} |")


def chat(model_dir, questions, max_new_tokens):
    model = AutoModelForCausalLM.from_pretrained(model_dir, trust_remote_code=True, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir, trust_remote_code=True)
    print(f"\nreloaded {type(model).__name__} from {model_dir} (AutoModelForCausalLM, trust_remote_code=True)")
    for question in questions:
        inputs = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                               return_tensors="pt", return_dict=True)
        output = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
        reply = tokenizer.decode(output[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
        print(f"  user: {question}\n  MiniMind: {reply.strip()}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output_dir", default="runs/demo")
    parser.add_argument("--pretrain_steps", type=int, default=180)
    parser.add_argument("--sft_steps", type=int, default=300)
    parser.add_argument("--pretrain_minutes", type=float, default=2.5,
                        help="stop pretraining early after this long (a busy machine still finishes in time)")
    parser.add_argument("--sft_minutes", type=float, default=2.5)
    parser.add_argument("--hidden_size", type=int, default=256)
    parser.add_argument("--num_hidden_layers", type=int, default=4)
    parser.add_argument("--max_seq_length", type=int, default=256, help="pretraining block length")
    parser.add_argument("--sft_max_seq_length", type=int, default=128, help="the bundled chats are short")
    parser.add_argument("--logging_steps", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=0, help="torch threads; 0: the idle cores")
    cli = parser.parse_args(argv)
    run_dir = Path(cli.output_dir)
    started = time.time()
    torch.set_num_threads(cli.threads or idle_cores())
    print(f"training with {torch.get_num_threads()} thread(s)")

    model_args = ModelArguments(hidden_size=cli.hidden_size, num_hidden_layers=cli.num_hidden_layers,
                                num_attention_heads=8, num_key_value_heads=2)
    pretrainer, pretrain_metrics = run_pretrain(
        model_args, DataArguments(data_path=BUNDLED_DATA["pretrain"], max_seq_length=cli.max_seq_length,
                                  eval_fraction=0.02),
        training_args(run_dir / "pretrain", cli.pretrain_steps, 8, 3e-3, cli),
        callbacks=[TimeBudgetCallback(cli.pretrain_minutes * 60)])
    pretrain_done = time.time()

    sft_dir = run_dir / "sft"
    sft_trainer, sft_metrics = run_sft(
        ModelArguments(model_name_or_path=str(run_dir / "pretrain")),
        DataArguments(data_path=BUNDLED_DATA["sft"], max_seq_length=cli.sft_max_seq_length, eval_fraction=0.02),
        training_args(sft_dir, cli.sft_steps, 16, 2e-3, cli),
        callbacks=[TimeBudgetCallback(cli.sft_minutes * 60)])
    sft_done = time.time()

    print_curve("pretraining loss", pretrainer)
    print_curve("SFT loss", sft_trainer)
    chat(sft_dir, QUESTIONS, max_new_tokens=48)
    print(f"\npretrain: {pretrain_done - started:.0f} s, eval loss {pretrain_metrics['eval_loss']:.3f} "
          f"(perplexity {pretrain_metrics['eval_perplexity']:.1f})")
    print(f"SFT:      {sft_done - pretrain_done:.0f} s, eval loss {sft_metrics['eval_loss']:.3f} "
          f"(perplexity {sft_metrics['eval_perplexity']:.1f})")
    print(f"total:    {time.time() - started:.0f} s")
    print(f"loss curves: {run_dir / 'pretrain' / 'loss_curve.md'}, {sft_dir / 'loss_curve.md'} (+ .png with "
          f"matplotlib); model directory: {sft_dir}")


if __name__ == "__main__":
    main()
