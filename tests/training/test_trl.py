"""TRL's own trainers on MiniMind, used directly as a user's script would (not through minimind.training),
against transformers' Qwen3 with the same weights: a dense MiniMind must look dense to TRL."""

import math

import pytest
import torch
from transformers import AutoTokenizer

from conftest import TINY_MODEL, model_dir, torch_threads
from minimind.export import to_qwen3_model

trl = pytest.importorskip("trl")


def chats(n=8):
    from datasets import Dataset

    return Dataset.from_list(
        [
            {
                "messages": [
                    {"role": "user", "content": f"What is {i} plus 1?"},
                    {"role": "assistant", "content": f"{i} plus 1 is {i + 1}."},
                ]
            }
            for i in range(n)
        ]
    )


def sft_losses(model, tokenizer, output_dir):
    args = trl.SFTConfig(
        output_dir=str(output_dir),
        max_steps=2,
        per_device_train_batch_size=4,
        learning_rate=1e-3,
        report_to=[],
        use_cpu=True,
        bf16=False,
        logging_steps=1,
        save_strategy="no",
        seed=0,
        disable_tqdm=True,
    )
    trainer = trl.SFTTrainer(model=model, args=args, train_dataset=chats(), processing_class=tokenizer)
    trainer.train()
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


def test_sft_dense_trains_like_qwen3(tmp_path):
    """SFT trainer trains a dense MiniMind exactly like Qwen3."""
    ours = model_dir(tmp_path / "model", std=0.02)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "model")
    theirs = to_qwen3_model(ours)
    assert not hasattr(ours.config, "output_router_logits")  # TRL's MoE aux-loss switch stays off, as for Qwen3
    ours_losses = sft_losses(ours.train(), tokenizer, tmp_path / "ours")
    theirs_losses = sft_losses(theirs.train(), tokenizer, tmp_path / "theirs")
    assert len(ours_losses) == 2
    assert ours_losses == pytest.approx(theirs_losses, rel=1e-4)


def test_sft_moe_adds_aux_loss(tmp_path):
    """SFT trainer adds the MoE aux loss for a MoE MiniMind."""
    ours = model_dir(tmp_path / "model", std=0.02, use_moe=True, num_experts=4, num_experts_per_tok=2)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "model")
    assert ours.config.output_router_logits is False and ours.config.router_aux_loss_coef == 5e-4
    losses = sft_losses(ours.train(), tokenizer, tmp_path / "ours")
    assert len(losses) == 2 and all(torch.isfinite(torch.tensor(losses)))


# --------------------------------------------------------------------------------------------------------------
# DPOTrainer and GRPOTrainer used directly
# --------------------------------------------------------------------------------------------------------------


def preference_pairs(n=8):
    from datasets import Dataset

    return Dataset.from_list(
        [
            {
                "prompt": [{"role": "user", "content": f"What is {i} plus 1?"}],
                "chosen": [{"role": "assistant", "content": f"{i} plus 1 is {i + 1}."}],
                "rejected": [{"role": "assistant", "content": f"{i} plus 1 is {i + 7}."}],
            }
            for i in range(n)
        ]
    )


def dpo_log(model, tokenizer, output_dir):
    import copy

    args = trl.DPOConfig(
        output_dir=str(output_dir),
        max_steps=2,
        per_device_train_batch_size=4,
        learning_rate=1e-3,
        report_to=[],
        use_cpu=True,
        bf16=False,
        logging_steps=1,
        save_strategy="no",
        seed=0,
        disable_tqdm=True,
    )
    # A frozen copy as the reference: TRL would otherwise reload one from the config's path, which these lack.
    trainer = trl.DPOTrainer(
        model=model,
        ref_model=copy.deepcopy(model).eval(),
        args=args,
        train_dataset=preference_pairs(),
        processing_class=tokenizer,
    )
    trainer.train()
    return [entry for entry in trainer.state.log_history if "loss" in entry]


def test_dpo_dense_trains_like_qwen3(tmp_path):
    """DPO trainer trains a dense MiniMind exactly like Qwen3."""
    ours = model_dir(tmp_path / "model", std=0.02)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "model")
    theirs = to_qwen3_model(ours)
    ours_log = dpo_log(ours.train(), tokenizer, tmp_path / "ours")
    theirs_log = dpo_log(theirs.train(), tokenizer, tmp_path / "theirs")
    assert len(ours_log) == 2
    # Step 1: policy == reference, so every margin is 0 and the sigmoid loss is exactly log 2.
    assert ours_log[0]["loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert ours_log[1]["loss"] != pytest.approx(math.log(2), abs=1e-4)  # step 2 has learned something
    for key in ("loss", "grad_norm", "rewards/chosen", "rewards/rejected", "logps/chosen", "logps/rejected"):
        assert [entry[key] for entry in ours_log] == pytest.approx(
            [entry[key] for entry in theirs_log], rel=1e-4, abs=1e-6
        ), key
    assert "aux_loss" not in ours_log[0]


def test_dpo_moe_adds_aux_loss(tmp_path):
    """DPO trainer adds the MoE aux loss for a MoE MiniMind."""
    ours = model_dir(tmp_path / "model", std=0.02, use_moe=True, num_experts=4, num_experts_per_tok=2)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "model")
    log = dpo_log(ours.train(), tokenizer, tmp_path / "ours")
    assert len(log) == 2 and all(math.isfinite(entry["loss"]) for entry in log)
    # Step 1 is log 2 plus the router's balance loss times the config's coefficient, nothing else.
    assert log[0]["aux_loss"] > 1.0
    assert log[0]["loss"] == pytest.approx(math.log(2) + 5e-4 * log[0]["aux_loss"], abs=1e-6)


def grpo_run(model, tokenizer, output_dir, reward_funcs, **overrides):
    prompts = [{"prompt": [{"role": "user", "content": f"What is {i} plus 1?"}]} for i in range(8)]
    from datasets import Dataset

    settings = dict(
        output_dir=str(output_dir),
        max_steps=2,
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=8,
        learning_rate=1e-2,
        report_to=[],
        use_cpu=True,
        bf16=False,
        logging_steps=1,
        save_strategy="no",
        seed=0,
        disable_tqdm=True,
    )
    trainer = trl.GRPOTrainer(
        model=model,
        reward_funcs=reward_funcs,
        args=trl.GRPOConfig(**{**settings, **overrides}),
        train_dataset=Dataset.from_list(prompts),
        processing_class=tokenizer,
    )
    trainer.train()
    return trainer, [entry for entry in trainer.state.log_history if "reward" in entry]


def text_length_recorder():
    """A deterministic reward (characters / 10) that also keeps every completion it scores."""
    seen = []

    def text_length(completions, **kwargs):
        texts = [completion[0]["content"] for completion in completions]
        seen.extend(texts)
        return [len(text) / 10 for text in texts]

    return text_length, seen


def test_grpo_dense_trains_like_qwen3(tmp_path):
    """Sampling draws from the same seeded generator, and the two models' probabilities agree to ~1e-6, so both
    runs sample the same completions, score the same rewards and take the same gradient steps. The logged loss
    itself is ~1e-7 for both: with one update per generation the importance ratio is 1 and the group-normalised
    advantages sum to zero, so it is compared to an absolute tolerance; the gradient norm carries the signal."""
    ours = model_dir(tmp_path / "model", std=0.02)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "model")
    theirs = to_qwen3_model(ours)
    ours_reward, ours_texts = text_length_recorder()
    theirs_reward, theirs_texts = text_length_recorder()
    _, ours_log = grpo_run(ours.train(), tokenizer, tmp_path / "ours", ours_reward)
    _, theirs_log = grpo_run(theirs.train(), tokenizer, tmp_path / "theirs", theirs_reward)
    assert len(ours_texts) == 8 and ours_texts == theirs_texts  # 2 steps x 4 completions, token for token
    assert len(set(ours_texts)) > 1
    assert [e["reward"] for e in ours_log] == [e["reward"] for e in theirs_log]
    assert [e["reward_std"] for e in ours_log] == [e["reward_std"] for e in theirs_log]
    for key in ("grad_norm", "entropy"):
        assert [e[key] for e in ours_log] == pytest.approx([e[key] for e in theirs_log], rel=1e-4), key
    assert all(e["grad_norm"] > 0 for e in ours_log)
    assert [e["loss"] for e in ours_log] == pytest.approx([e["loss"] for e in theirs_log], abs=1e-6)
    assert "aux_loss" not in ours_log[0]


def test_grpo_moe_adds_aux_loss(tmp_path):
    """GRPO trainer adds the MoE aux loss for a MoE MiniMind."""
    ours = model_dir(tmp_path / "model", std=0.02, use_moe=True, num_experts=4, num_experts_per_tok=2)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "model")
    reward, texts = text_length_recorder()
    _, log = grpo_run(ours.train(), tokenizer, tmp_path / "ours", reward)
    assert len(log) == 2 and len(texts) == 8
    for entry in log:
        assert math.isfinite(entry["loss"]) and entry["aux_loss"] > 1.0
        # The policy term is ~1e-7 (see the dense test), so the loss is the weighted balance loss.
        assert entry["loss"] == pytest.approx(5e-4 * entry["aux_loss"], abs=1e-6)


# --------------------------------------------------------------------------------------------------------------
# minimind.rl: the questions and the rewards, on hand-written completions
# --------------------------------------------------------------------------------------------------------------


def chat_file(path, chats):
    import json

    path.write_text("".join(json.dumps({"conversations": chat}) + "\n" for chat in chats), encoding="utf-8")
    return str(path)


def test_questions_have_checkable_answers(tmp_path):
    """Questions are the chat file questions with checkable answers."""
    from minimind.rl import question_dataset

    user, assistant = (
        (lambda text: {"role": "user", "content": text}),
        (lambda text: {"role": "assistant", "content": text}),
    )
    path = chat_file(
        tmp_path / "chats.jsonl",
        [
            [
                {"role": "system", "content": "Be brief."},
                user("What is 3 plus 4?"),
                assistant("3 plus 4 is 7."),
                user("What is the capital of Wenland?"),
                assistant("The capital of Wenland is Tarsk."),
            ],
            [user("Tell me a story."), assistant("Once upon a time, a cat sat. It was happy.")],  # not one answer
            [user("How many days are in a week?"), assistant("There are 7 days in a week.")],  # no "is"
            [user("What is 3 plus 4?"), assistant("3 plus 4 is 7.")],  # asked before: kept once
            [user("What day comes after Friday?"), assistant("The day after Friday is Saturday.")],
        ],
    )
    rows = question_dataset(path).to_list()
    assert rows == [
        {"prompt": [user("What is 3 plus 4?")], "answer": "7"},
        {"prompt": [user("What is the capital of Wenland?")], "answer": "tarsk"},
        {"prompt": [user("What day comes after Friday?")], "answer": "saturday"},
    ]
    assert [row["answer"] for row in question_dataset(path, question_pattern="capital|day").to_list()] == [
        "tarsk",
        "saturday",
    ]
    from minimind.data import DataFormatError

    with pytest.raises(DataFormatError, match="no question matching 'colour'"):
        question_dataset(path, question_pattern="colour")


def test_bundled_chats_give_1345_questions():
    """The bundled chats give 1345 checkable questions."""
    from minimind.rl import question_dataset
    from minimind.training import BUNDLED_DATA

    questions = {row["prompt"][0]["content"]: row["answer"] for row in question_dataset(BUNDLED_DATA["sft"])}
    assert len(questions) == 1345
    assert questions["What is 3 plus 4?"] == "7" and questions["What is the capital of Egypt?"] == "cairo"


COMPLETIONS = [
    "3 plus 4 is 7.",
    "3 plus 4 is 17.",
    "It is 7",
    "Seven.",
    "3 plus 4 is 7. 2 plus 2 is 4.",
    [{"role": "assistant", "content": "The capital of Wenland is  Tarsk."}],
]


def test_correct_answer_checks_last_phrase():
    """correct_answer compares the last "is" phrase with the reference."""
    from minimind.rl import correct_answer

    answers = ["7", "7", "7", "7", "7", "Tarsk"]
    # "It is 7" answers 7 (its format is the other reward's business); the two-sentence reply's last answer is 4.
    assert correct_answer(COMPLETIONS, answers) == [1.0, 0.0, 1.0, 0.0, 0.0, 1.0]


def test_format_wants_one_bundled_sentence():
    """format_followed wants one sentence of the bundled form."""
    from minimind.rl import format_followed

    assert format_followed(COMPLETIONS) == [1.0, 1.0, 0.0, 0.0, 0.0, 1.0]
    thinking = r"<think>.+</think>\s*.+"
    assert format_followed(["<think>3+4</think> 7.", "7."], pattern=thinking) == [1.0, 0.0]


def test_length_penalty_counts_excess_tokens():
    """Length penalty counts completion tokens past the limit."""
    from minimind.rl import length_penalty

    ids = [[5] * n for n in (10, 32, 48, 64, 100)]
    assert length_penalty(["x"] * 5, ids) == [0.0, 0.0, -0.5, -1.0, -1.0]
    assert length_penalty(["x"], [[5] * 12], max_tokens=8) == [-0.5]


def test_repetition_penalty_is_repeated_share():
    """Repetition penalty is the share of repeated word n-grams."""
    from minimind.rl import repetition_penalty

    texts = ["a b c d", "a b a b a b", "one two", "Go go GO go", "the cat the cat sat"]
    # "a b a b a b": 4 trigrams, 2 distinct; "go go go go": 2 trigrams, 1 distinct; the cat ...: 3 trigrams, 3 distinct
    assert repetition_penalty(texts) == [0.0, -0.5, 0.0, -0.5, 0.0]
    assert repetition_penalty(["the cat the cat sat"], ngram=2) == [-0.25]


def test_reward_flags_choose_functions(tmp_path, monkeypatch):
    """Reward flags choose the functions and TRL weights."""
    from minimind.rl import RewardArguments, load_reward_function, reward_functions

    functions, weights = reward_functions(RewardArguments())
    assert [trl.trainer.utils.get_callable_name(f) for f in functions] == ["correct_answer", "format_followed"]
    assert weights == [1.0, 0.5]
    (tmp_path / "my_rewards.py").write_text(
        "def always_one(completions, **kwargs):\n    return [1.0] * len(completions)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    functions, weights = reward_functions(
        RewardArguments(
            correct_weight=2.0,
            format_weight=0.0,
            length_weight=0.25,
            length_max_tokens=4,
            repetition_weight=0.5,
            reward=["my_rewards:always_one"],
            reward_weight=3.0,
            reward_model="some/dir",
            reward_model_weight=0.1,
        )
    )
    assert [f if isinstance(f, str) else trl.trainer.utils.get_callable_name(f) for f in functions] == [
        "correct_answer",
        "length_penalty",
        "repetition_penalty",
        "always_one",
        "some/dir",
    ]
    assert weights == [2.0, 0.25, 0.5, 3.0, 0.1]
    assert functions[1](["x"], [[0] * 6]) == [-0.5]  # the flag's max_tokens reached the function
    assert functions[3](["x", "y"]) == [1.0, 1.0]
    with pytest.raises(ValueError, match="expected module:function"):
        load_reward_function("my_rewards.always_one")
    with pytest.raises(ValueError, match="has no function nothing"):
        load_reward_function("my_rewards:nothing")
    with pytest.raises(ValueError, match="every reward has weight 0"):
        reward_functions(RewardArguments(correct_weight=0, format_weight=0))


# --------------------------------------------------------------------------------------------------------------
# The minimind-grpo command
# --------------------------------------------------------------------------------------------------------------

# Module-level state in a reward module is how a user's reward function can record what it saw.
REWARD_MODULE = """
SEEN = []


def recorded(prompts, completions, completion_ids, answer, **kwargs):
    SEEN.append((prompts, completions, completion_ids, answer))
    return [0.0] * len(completions)


def lower_half_share(completions, completion_ids, **kwargs):
    return [sum(token < 3200 for token in ids) / max(1, len(ids)) for ids in completion_ids]
"""


@pytest.fixture
def reward_module(tmp_path, monkeypatch):
    import importlib
    import sys

    (tmp_path / "grpo_test_rewards.py").write_text(REWARD_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "grpo_test_rewards", raising=False)
    return importlib.import_module("grpo_test_rewards")


def grpo_command(tmp_path, *flags):
    from conftest import load_script

    chats = tmp_path / "chats.jsonl"
    if not chats.exists():
        from minimind.training import BUNDLED_DATA

        with open(BUNDLED_DATA["sft"], encoding="utf-8") as bundled:
            chats.write_text("".join(next(bundled) for _ in range(200)), encoding="utf-8")
    return load_script("grpo").main(
        [
            "--output_dir",
            str(tmp_path / "grpo"),
            "--data_path",
            str(chats),
            "--per_device_train_batch_size",
            "8",
            "--num_generations",
            "4",
            "--max_completion_length",
            "8",
            "--save_strategy",
            "no",
            "--report_to",
            "none",
            "--disable_tqdm",
            "true",
            "--seed",
            "0",
            "--use_cpu",
            "true",
            *flags,
        ]
    )


def test_grpo_adds_reward_function_and_model(tmp_path, reward_module):
    """One step with the built-in rewards, a --reward function and a --reward_model directory (a tiny Qwen3
    sequence classifier): TRL scores with all four at their flag weights, the reward model's logged mean is its own
    score of the prompts and completions the function saw, and the output is a complete model directory."""
    import shutil

    from transformers import Qwen3Config, Qwen3ForSequenceClassification
    from trl.data_utils import apply_chat_template

    from conftest import TOKENIZER_DIR, TOKENIZER_FILES

    torch.manual_seed(0)
    judge = Qwen3ForSequenceClassification(
        Qwen3Config(
            vocab_size=6400,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=16,
            num_labels=1,
            pad_token_id=0,
        )
    ).eval()
    judge.save_pretrained(tmp_path / "judge")
    for name in TOKENIZER_FILES:
        shutil.copy(f"{TOKENIZER_DIR}/{name}", tmp_path / "judge")
    trainer, metrics = grpo_command(
        tmp_path,
        *TINY_MODEL,
        "--max_steps",
        "1",
        "--reward",
        "grpo_test_rewards:recorded",
        "--reward_weight",
        "0.5",
        "--reward_model",
        str(tmp_path / "judge"),
        "--reward_model_weight",
        "2",
    )
    assert trainer.state.global_step == 1
    assert trainer.reward_func_names == ["correct_answer", "format_followed", "recorded", "judge"]
    assert trainer.reward_weights.tolist() == [1.0, 0.5, 0.5, 2.0]
    ((prompts, completions, completion_ids, answers),) = reward_module.SEEN
    assert len(completions) == 8 and all(len(ids) <= 8 for ids in completion_ids) and len(answers) == 8
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "judge")
    with torch.no_grad():
        scores = [
            judge(
                **tokenizer(
                    apply_chat_template({"messages": p + c}, tokenizer)["text"],
                    return_tensors="pt",
                    add_special_tokens=False,
                )
            )
            .logits[0, 0]
            .item()
            for p, c in zip(prompts, completions)
        ]
    logged = next(entry for entry in trainer.state.log_history if "rewards/judge/mean" in entry)
    assert logged["rewards/judge/mean"] == pytest.approx(sum(scores) / len(scores), abs=1e-5)
    assert logged["rewards/recorded/mean"] == 0.0
    output = tmp_path / "grpo"
    assert (output / "config.json").is_file() and (output / "modeling_minimind.py").is_file()
    assert (output / "reward_curve.md").read_text().splitlines()[2] == f"| 1 | {logged['reward']:.3f} |"


def test_grpo_kl_starts_from_saved_model(tmp_path):
    """TRL reloads the KL reference from the policy's path: a saved model has one and logs a KL (0 at step 1, the
    policy still equal to the reference); a new model built from size flags is refused before anything is built."""
    model_dir(tmp_path / "model", std=0.02)
    trainer, _ = grpo_command(
        tmp_path, "--model_name_or_path", str(tmp_path / "model"), "--beta", "0.04", "--max_steps", "1"
    )
    assert type(trainer.ref_model).__name__ == "MiniMindForCausalLM"
    assert next(e["kl"] for e in trainer.state.log_history if "kl" in e) == pytest.approx(0.0, abs=1e-6)
    with pytest.raises(ValueError, match="--beta needs a reference model"):
        grpo_command(tmp_path, *TINY_MODEL, "--beta", "0.04", "--max_steps", "1")


def test_grpo_raises_mean_reward(tmp_path, reward_module, monkeypatch):
    """A new tiny MiniMind, 16 GRPO steps on a reward it can learn (the share of completion tokens from the lower
    half of the vocabulary; an untrained model samples it at about 0.5): the last four steps' mean reward beats
    the first four's by more than 0.25 (measured: 0.48 -> 1.00; 6 s, up to 28 s on a busy machine)."""
    with torch_threads(1):
        trainer, _ = grpo_command(
            tmp_path,
            *TINY_MODEL,
            "--max_steps",
            "16",
            "--correct_weight",
            "0",
            "--format_weight",
            "0",
            "--reward",
            "grpo_test_rewards:lower_half_share",
            "--per_device_train_batch_size",
            "16",
            "--num_generations",
            "8",
            "--max_completion_length",
            "6",
            "--learning_rate",
            "5e-2",
        )
    from minimind.rl import reward_curve

    rewards = [reward for _, reward in reward_curve(trainer.state.log_history)]
    assert len(rewards) == 16
    first, last = sum(rewards[:4]) / 4, sum(rewards[-4:]) / 4
    assert 0.35 < first < 0.65 and last > first + 0.25, rewards
