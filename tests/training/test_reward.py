"""Reward models: TRL's `RewardTrainer` used directly on a MiniMind SFT checkpoint (as a user's script would), the
`minimind-reward` command that wraps it, and its output as GRPO's `--reward_model`."""

import json
import os
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer

import minimind  # noqa: F401  (as a user's script with the package installed: the Auto classes know MiniMind)
from conftest import ROOT, load_script, model_dir, plant_code_dir

trl = pytest.importorskip("trl")
pytestmark = pytest.mark.usefixtures("one_thread")

BUNDLED_PAIRS = os.path.join(ROOT, "data", "dpo.jsonl")
# Activation checkpointing off (TRL's configs switch it on), by its current name where this transformers has it.
NO_CHECKPOINTING = {
    "activation_checkpointing"
    if "activation_checkpointing" in trl.RewardConfig.__dataclass_fields__
    else "gradient_checkpointing": False
}


def bundled_pairs(stop, start=0):
    """Lines start..stop of the bundled preference data, as the conversational dataset TRL takes."""
    from datasets import Dataset

    with open(BUNDLED_PAIRS, encoding="utf-8") as file:
        return Dataset.from_list([json.loads(line) for line in file.read().splitlines()[start:stop]])


def scores(model, tokenizer, conversations):
    """The model's score of each whole conversation, rendered with the chat template, in one right-padded batch."""
    texts = [tokenizer.apply_chat_template(messages, tokenize=False) for messages in conversations]
    batch = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    with torch.no_grad():
        return model.eval()(**batch).logits[:, 0]


def test_trainer_raises_margin_and_accuracy(tmp_path):
    """TRL's RewardTrainer, used directly, on a MiniMind SFT checkpoint opened with the Auto class (the package
    imported, as README says; remote code alone: the fresh-interpreter test below): 8 steps on the first 64 bundled
    pairs from a fixed seed raise the share of pairs scored chosen > rejected from 0.34 to 0.91 and
    the mean margin from -0.02 to 0.72. The margin is that of the scores the model gives the
    conversations itself, and the saved directory reloads with the Auto class and gives the same scores."""
    model_dir(tmp_path / "sft", std=0.02)
    model = AutoModelForSequenceClassification.from_pretrained(
        tmp_path / "sft", num_labels=1, trust_remote_code=True, dtype=torch.float32
    )
    assert type(model).__name__ == "MiniMindForSequenceClassification"
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "sft")
    pairs = bundled_pairs(64)
    args = trl.RewardConfig(
        output_dir=str(tmp_path / "reward"),
        max_steps=8,
        per_device_train_batch_size=16,
        per_device_eval_batch_size=16,
        learning_rate=1e-3,
        report_to=[],
        use_cpu=True,
        bf16=False,
        **NO_CHECKPOINTING,
        logging_steps=1,
        save_strategy="no",
        seed=0,
        disable_tqdm=True,
    )
    trainer = trl.RewardTrainer(
        model=model, args=args, train_dataset=pairs, eval_dataset=pairs, processing_class=tokenizer
    )
    before = trainer.evaluate()
    trainer.train()
    after = trainer.evaluate()
    assert before["eval_accuracy"] < 0.6 and abs(before["eval_margin"]) < 0.1, before
    assert after["eval_accuracy"] > before["eval_accuracy"] + 0.3, (before, after)
    assert after["eval_margin"] > before["eval_margin"] + 0.5, (before, after)
    chosen, rejected = scores(model, tokenizer, pairs["chosen"]), scores(model, tokenizer, pairs["rejected"])
    assert (chosen - rejected).mean().item() == pytest.approx(after["eval_margin"], abs=1e-4)
    assert (chosen > rejected).float().mean().item() == pytest.approx(after["eval_accuracy"])

    trainer.save_model(str(tmp_path / "reward"))
    reloaded = AutoModelForSequenceClassification.from_pretrained(tmp_path / "reward", trust_remote_code=True)
    assert reloaded.config.num_labels == 1 and reloaded.config.pad_token_id == tokenizer.pad_token_id
    torch.testing.assert_close(scores(reloaded, tokenizer, pairs["chosen"]), chosen, atol=1e-5, rtol=1e-5)


def reward_command(tmp_path, *flags):
    return load_script("reward").main(
        [
            "--output_dir",
            str(tmp_path / "reward"),
            "--per_device_train_batch_size",
            "4",
            "--per_device_eval_batch_size",
            "4",
            "--logging_steps",
            "1",
            "--save_strategy",
            "no",
            "--report_to",
            "none",
            "--disable_tqdm",
            "true",
            "--use_cpu",
            "true",
            *flags,
        ]
    )


def test_command_writes_dir_grpo_scores_with(tmp_path):
    """minimind-reward from an SFT checkpoint, two steps on bundled pairs with a bad line skipped: a complete model
    directory (code, auto_map, tokenizer, one-output head, pad id) whose reloads (Auto class with remote code; our
    checked loader, as GRPO's --reward_model uses) score as the trained model does; GRPO then trains with it."""
    model_dir(tmp_path / "sft", std=0.02)
    lines = open(BUNDLED_PAIRS, encoding="utf-8").read().splitlines()[:20]
    data = tmp_path / "pairs.jsonl"
    data.write_text("\n".join([*lines[:2], '{"chosen": [], "rejected": []}', *lines[2:]]) + "\n", encoding="utf-8")
    trainer, metrics = reward_command(
        tmp_path,
        "--model_name_or_path",
        str(tmp_path / "sft"),
        "--data_path",
        str(data),
        "--skip_bad_lines",
        "--max_steps",
        "2",
        "--eval_fraction",
        "0.2",
    )
    assert trainer.state.global_step == 2 and type(trainer).__mro__[1].__name__ == "HFDirectoryMixin"
    assert len(trainer.train_dataset) == 16 and len(trainer.eval_dataset) == 4  # 20 good pairs, 1 in 5 held out
    assert 0 <= metrics["eval_accuracy"] <= 1 and "eval_margin" in metrics
    out = tmp_path / "reward"
    files = {path.name for path in out.iterdir()}
    assert {
        "config.json",
        "model.safetensors",
        "modeling_minimind.py",
        "configuration_minimind.py",
        "tokenizer.json",
        "chat_template.jinja",
        "training_args.json",
        "loss_curve.md",
    } <= files and "training_args.bin" not in files
    config = json.loads((out / "config.json").read_text())
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert config["architectures"] == ["MiniMindForSequenceClassification"]
    assert (
        config["auto_map"]["AutoModelForSequenceClassification"]
        == "modeling_minimind.MiniMindForSequenceClassification"
    )
    assert len(config["id2label"]) == 1 and config["pad_token_id"] == tokenizer.pad_token_id

    pairs = bundled_pairs(20)
    trained = scores(trainer.model, tokenizer, pairs["chosen"])
    reloaded = AutoModelForSequenceClassification.from_pretrained(out, trust_remote_code=True)
    torch.testing.assert_close(scores(reloaded, tokenizer, pairs["chosen"]), trained, atol=1e-5, rtol=1e-5)
    from minimind.training import load_scoring_model

    judge, judge_tokenizer = load_scoring_model(out)
    assert type(judge).__module__ == "modeling_minimind"  # the installed class, not code from the directory
    torch.testing.assert_close(scores(judge, judge_tokenizer, pairs["chosen"]), trained, atol=1e-5, rtol=1e-5)

    grpo_trainer, _ = load_script("grpo").main(
        [
            "--model_name_or_path",
            str(tmp_path / "sft"),
            "--output_dir",
            str(tmp_path / "grpo"),
            "--reward_model",
            str(out),
            "--max_steps",
            "1",
            "--per_device_train_batch_size",
            "4",
            "--num_generations",
            "4",
            "--max_completion_length",
            "4",
            "--save_strategy",
            "no",
            "--report_to",
            "none",
            "--disable_tqdm",
            "true",
            "--use_cpu",
            "true",
        ]
    )
    assert grpo_trainer.reward_func_names == ["correct_answer", "format_followed", "reward"]
    assert type(grpo_trainer.reward_funcs[-1]).__module__ == "modeling_minimind"
    assert any("rewards/reward/mean" in entry for entry in grpo_trainer.state.log_history)


def test_bad_pair_stops_naming_file_and_line(tmp_path, capsys):
    """A bad pair stops the command naming file and line."""
    model_dir(tmp_path / "sft", std=0.02)
    lines = open(BUNDLED_PAIRS, encoding="utf-8").read().splitlines()[:4]
    data = tmp_path / "pairs.jsonl"
    data.write_text("\n".join([*lines[:2], '{"chosen": [{"role": "user"', *lines[2:]]) + "\n", encoding="utf-8")
    with pytest.raises(SystemExit) as exit_info:
        reward_command(tmp_path, "--model_name_or_path", str(tmp_path / "sft"), "--data_path", str(data))
    assert exit_info.value.code == 2
    assert f"error: {data}, line 3: " in capsys.readouterr().err
    assert not (tmp_path / "reward").exists()  # stopped before any model was built


def test_loading_refuses_lm_and_foreign_code(tmp_path):
    """GRPO's --reward_model: a MiniMind language model (no score head) would score with a random head and is
    refused; a directory of an unknown model type that ships code is refused without running it."""
    from minimind.errors import InputError
    from minimind.training import load_scoring_model

    model_dir(tmp_path / "sft", std=0.02)
    with pytest.raises(InputError, match="has no reward head"):
        load_scoring_model(tmp_path / "sft")
    marker = plant_code_dir(tmp_path / "planted")
    with pytest.raises(InputError, match="never run"):
        load_scoring_model(tmp_path / "planted")
    assert not marker.exists()


def test_directory_reloads_as_remote_code(tmp_path):
    """Where MiniMind is not installed: a reward directory opens with AutoModelForSequenceClassification and
    trust_remote_code=True in an interpreter that never imported our code, with the scores of the in-memory model."""
    from minimind.training import load_reward_model

    model_dir(tmp_path / "sft", std=0.02)
    torch.manual_seed(0)
    model = load_reward_model(tmp_path / "sft")
    model.save_pretrained(tmp_path / "reward")
    ids = [[5, 17, 42, 8, 64, 3]]
    with torch.no_grad():
        expected = model(torch.tensor(ids)).logits[0, 0].item()
    program = (
        "import sys, torch; from transformers import AutoModelForSequenceClassification as A; "
        f"m = A.from_pretrained({str(tmp_path / 'reward')!r}, trust_remote_code=True).eval(); "
        "assert 'minimind' not in sys.modules; "
        f"print(m(torch.tensor({ids})).logits[0, 0].item())"
    )
    env = {**os.environ, "HF_MODULES_CACHE": str(tmp_path / "modules"), "OMP_NUM_THREADS": "1", "PYTHONPATH": ""}
    result = subprocess.run(
        [sys.executable, "-c", program], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-1500:]
    assert float(result.stdout.split()[-1]) == pytest.approx(expected, abs=1e-5)
