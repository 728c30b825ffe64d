"""The main job (minimind/demo.py, `make demo`) end to end at toy size: pretrain, SFT, save, reload, check answers."""

import json
import os

import pytest

from conftest import load_script
from minimind.demo import QUESTIONS, is_correct

TOY = [
    "--pretrain_steps",
    "12",
    "--sft_steps",
    "8",
    "--hidden_size",
    "32",
    "--num_hidden_layers",
    "1",
    "--max_seq_length",
    "64",
    "--sft_max_seq_length",
    "64",
    "--logging_steps",
    "4",
]


@pytest.fixture(scope="module")
def toy_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo")
    return out, load_script("demo").main(["--output_dir", str(out), *TOY])


def test_trains_saves_reloads_and_checks_answers(toy_run):
    """The toy demo trains, saves, reloads and checks every answer."""
    out, result = toy_run
    # Both phases learn. Measured: pretraining 8.72 -> 8.21 in 12 steps, SFT 8.40 -> 8.01 in 8 steps.
    (_, first), *_, (last_step, last) = result.pretrain_losses
    assert last_step == 12 and last < first - 0.3, result.pretrain_losses
    assert result.sft_losses[-1][1] < result.sft_losses[0][1] - 0.2, result.sft_losses
    assert [question for question, _, _ in result.answers] == list(QUESTIONS)
    assert all(ok == is_correct(question, reply) for question, reply, ok in result.answers)
    sft_dir = out / "sft"
    assert json.loads((sft_dir / "config.json").read_text())["auto_map"]["AutoModelForCausalLM"]
    assert {"model.safetensors", "modeling_minimind.py", "tokenizer.json", "loss_curve.md"} <= set(os.listdir(sft_dir))


def test_demo_is_deterministic(toy_run, tmp_path, capsys):
    """Fixed steps, seeds and threads, no clock: a second run gives the same losses and replies bit for bit."""
    _, first = toy_run
    again = load_script("demo").main(["--output_dir", str(tmp_path), *TOY])
    assert again.pretrain_losses == first.pretrain_losses and again.sft_losses == first.sft_losses
    assert [reply for _, reply, _ in again.answers] == [reply for _, reply, _ in first.answers]
    out = capsys.readouterr().out
    assert f"answers: {again.correct} of {len(QUESTIONS)} correct" in out
    assert out.count("  MiniMind: ") == len(QUESTIONS) and "| 12 |" in out  # the replies and the loss table


@pytest.mark.parametrize(
    "question, reply, correct",
    [
        (0, "I am MiniMind, a small language model. I can answer simple questions and tell short stories.", True),
        (0, "I am a small language model.", False),
        (1, "A tailor makes and mends clothes.", True),
        (1, "A tailor bakes bread and cakes.", False),
        (2, "3 plus 4 is 7.", True),
        (2, "2 plus 0 is 10.", False),
        (2, "3 plus 4 is 17.", False),
        (3, "There once was a sleepy boy called Ginger. He lived in a busy harbour.", True),
        (3, "Once upon a time, there was a grumpy girl named Lena.", True),
        (3, "Dobe was a friendly princess.", True),
        (3, "The sky is blue.", False),
    ],
)
def test_answer_checks_follow_the_bundled_answers(question, reply, correct):
    assert is_correct(QUESTIONS[question], reply) is correct
