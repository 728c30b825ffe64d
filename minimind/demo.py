"""The demo: MiniMind from raw text to a chatting model in about five minutes on a CPU, its answers checked.

It pretrains a small MiniMind on the bundled corpus and fine-tunes it on the bundled chats with the training
commands themselves (the exact `minimind-pretrain` / `minimind-sft` command lines are printed), reloads the saved
directory as every MiniMind command loads a model (`minimind.loading`) and asks the README's questions, checking
each greedy answer against what the bundled data teaches.

Nothing depends on the clock: steps, seeds, data order and the thread count are fixed, so on one machine every run
gives the same loss tables and answers however busy the machine is; only the time taken changes. (The thread
count is fixed too because a different number of threads sums in a different order, and training amplifies
those last-digit differences.)
"""

from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass, field

import torch

from minimind.training import BUNDLED_DATA, loss_curve, parse_args, run_pretrain, run_sft


@dataclass(frozen=True)
class Question:
    text: str
    expected: str  # a regular expression the reply must match
    means: str  # what a match shows, for the printout


# The bundled chats answer these in fixed words (scripts/make_data.py): "I am MiniMind, ...", "A tailor makes and
# mends clothes.", "3 plus 4 is 7.", and stories that open in one of four ways.
QUESTIONS = (
    Question("Who are you?", r"\bMiniMind\b", "names itself MiniMind"),
    Question("What does a tailor do?", r"\bmakes and mends clothes\b", "a tailor makes and mends clothes"),
    Question("What is 3 plus 4?", r"\bis 7\b", "3 plus 4 is 7"),
    Question(
        "Tell me a short story.",
        r"^(Once upon a time|There once was|Far away|[A-Z]\w* was an? \w+)",
        "opens like the bundled stories",
    ),
)


def is_correct(question: Question, reply: str) -> bool:
    return re.search(question.expected, reply.strip()) is not None


@dataclass
class DemoSettings:
    output_dir: str = "runs/demo"
    pretrain_steps: int = 180
    sft_steps: int = 300
    hidden_size: int = 256
    num_hidden_layers: int = 4
    max_seq_length: int = 256  # pretraining block length
    sft_max_seq_length: int = 128  # the bundled chats are short
    logging_steps: int = 20
    seed: int = 0
    threads: int = 1  # one thread is never slowed by other jobs fighting it for a core
    max_new_tokens: int = 48


@dataclass
class DemoResult:
    pretrain_losses: list[tuple[int, float]]
    sft_losses: list[tuple[int, float]]
    pretrain_metrics: dict
    sft_metrics: dict
    answers: list[tuple[Question, str, bool]] = field(default_factory=list)
    seconds: dict = field(default_factory=dict)

    @property
    def correct(self) -> int:
        return sum(ok for _, _, ok in self.answers)


def training_command(settings, output_dir, data, steps, batch_size, learning_rate, max_seq_length, extra=()):
    """argv for minimind-pretrain / minimind-sft: fixed steps, seed and schedule; on the CPU (in fp32) even where a
    GPU exists, so that every machine runs the README's demo; no checkpoints, the demo never resumes."""
    return [
        "--output_dir",
        str(output_dir),
        "--data_path",
        os.path.relpath(data),
        "--max_steps",
        str(steps),
        "--per_device_train_batch_size",
        str(batch_size),
        "--per_device_eval_batch_size",
        "32",
        "--learning_rate",
        str(learning_rate),
        "--lr_scheduler_type",
        "cosine",
        "--warmup_steps",
        "0.05",
        "--weight_decay",
        "0.01",
        "--max_seq_length",
        str(max_seq_length),
        "--eval_fraction",
        "0.02",
        "--logging_steps",
        str(settings.logging_steps),
        "--save_strategy",
        "no",
        "--report_to",
        "none",
        "--use_cpu",
        "--seed",
        str(settings.seed),
        "--dataloader_num_workers",
        "0",
        *extra,
    ]


def _train(name, run, argv):
    print(f"\n$ minimind-{name} {' '.join(argv)}", flush=True)
    return run(*parse_args(argv))


def ask(model_dir, questions, max_new_tokens):
    """[(question, greedy reply, correct)] from the model directory reloaded as every MiniMind command loads one
    (`minimind.loading`: checked, with the installed classes)."""
    from minimind.loading import load_model, load_tokenizer

    model, tokenizer = load_model(model_dir, dtype=torch.float32, hub=False), load_tokenizer(model_dir, hub=False)
    print(f"\nreloaded {type(model).__name__} from {model_dir}")
    answers = []
    for question in questions:
        inputs = tokenizer.apply_chat_template(
            [{"role": "user", "content": question.text}],
            add_generation_prompt=True,
            return_tensors="pt",
            return_dict=True,
        )
        output = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
        reply = tokenizer.decode(output[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True).strip()
        answers.append((question, reply, is_correct(question, reply)))
    return answers


def loss_table(pretrain, sft):
    """Markdown table of both training curves, one row per logged step."""
    pretrain, sft = dict(pretrain), dict(sft)

    def cell(curve, step):
        return f"{curve[step]:.3f}" if step in curve else ""

    rows = [
        f"| {step} | {cell(pretrain, step)} | {cell(sft, step)} |" for step in sorted(pretrain.keys() | sft.keys())
    ]
    return "\n".join(["| step | pretraining loss | SFT loss |", "|---:|---:|---:|", *rows])


def run_demo(settings: DemoSettings) -> DemoResult:
    threads = torch.get_num_threads()
    torch.set_num_threads(settings.threads)
    try:
        return _run(settings)
    finally:
        torch.set_num_threads(threads)


def _run(settings):
    started = time.time()
    pretrain_dir, sft_dir = os.path.join(settings.output_dir, "pretrain"), os.path.join(settings.output_dir, "sft")
    size = [
        "--hidden_size",
        str(settings.hidden_size),
        "--num_hidden_layers",
        str(settings.num_hidden_layers),
        "--num_attention_heads",
        "8",
        "--num_key_value_heads",
        "2",
    ]
    pretrainer, pretrain_metrics = _train(
        "pretrain",
        run_pretrain,
        training_command(
            settings,
            pretrain_dir,
            BUNDLED_DATA["pretrain"],
            settings.pretrain_steps,
            8,
            3e-3,
            settings.max_seq_length,
            size,
        ),
    )
    pretrained = time.time()
    sft_trainer, sft_metrics = _train(
        "sft",
        run_sft,
        training_command(
            settings,
            sft_dir,
            BUNDLED_DATA["sft"],
            settings.sft_steps,
            16,
            2e-3,
            settings.sft_max_seq_length,
            ["--model_name_or_path", pretrain_dir, "--padding_free"],
        ),
    )
    tuned = time.time()
    result = DemoResult(
        loss_curve(pretrainer.state.log_history),
        loss_curve(sft_trainer.state.log_history),
        pretrain_metrics,
        sft_metrics,
    )
    result.answers = ask(sft_dir, QUESTIONS, settings.max_new_tokens)
    result.seconds = {"pretraining": pretrained - started, "SFT": tuned - pretrained, "total": time.time() - started}

    print(f"\n{loss_table(result.pretrain_losses, result.sft_losses)}\n")
    for phase, metrics in (("pretraining", pretrain_metrics), ("SFT", sft_metrics)):
        print(
            f"{phase}: {metrics['train_runtime']:.0f} s training, eval loss {metrics['eval_loss']:.3f} "
            f"(perplexity {metrics['eval_perplexity']:.1f})"
        )
    print()
    for question, reply, ok in result.answers:
        print(
            f"  user: {question.text}\n  MiniMind: {reply}\n  {'correct' if ok else 'WRONG'}: "
            f"{'' if ok else 'expected an answer that '}{question.means}"
        )
    print(
        f"\nanswers: {result.correct} of {len(result.answers)} correct; total {result.seconds['total']:.0f} s; "
        f"model directory: {sft_dir}; loss curves: {pretrain_dir}/loss_curve.md, {sft_dir}/loss_curve.md"
    )
    return result
