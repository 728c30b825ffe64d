"""Reinforcement learning with verifiable rewards: GRPO with TRL's `GRPOTrainer` (the `minimind-grpo` command).

The questions are the bundled chats' own: every user turn in data/sft.jsonl whose reply has the bundled answer
form "<subject> is <answer>." ("3 plus 4 is 7.", "The capital of Wenland is Tarsk.", "The day after Friday is
Saturday.") becomes a prompt, and <answer> is what a completion must give. So the answers can be checked by string
comparison, with no judge model.

Every reward here has TRL's reward-function signature, `f(prompts, completions, completion_ids, **columns) ->
list[float]`, so any of them can be handed to `GRPOTrainer(reward_funcs=...)` directly. The command combines the
chosen ones with TRL's `reward_weights`; a user's own function (`--reward module:function`) and a
sequence-classification reward model (`--reward_model PATH`: one `minimind-reward` wrote, or one of an architecture
transformers ships; loaded without running code from the directory) join the same list.
"""

from __future__ import annotations

import functools
import importlib
import logging
import re
from dataclasses import dataclass, field
from pathlib import Path

from minimind.data import split_train_eval

logger = logging.getLogger(__name__)

# The bundled answer form: one sentence "<subject> is <answer>." (scripts/make_data.py writes facts this way).
ANSWER_FORM = r"[^\n.!?]* is [^\n.!?]+\."
_GIVEN_ANSWER = re.compile(r" is ([^\n.!?]+)[.!?]?\s*$")


# --------------------------------------------------------------------------------------------------------------
# Prompts
# --------------------------------------------------------------------------------------------------------------


def reference_answer(reply: str) -> str | None:
    """The <answer> of a reply in the bundled form "<subject> is <answer>.", or None for any other reply."""
    if not re.fullmatch(ANSWER_FORM, reply.strip()):
        return None
    return given_answer(reply)


def given_answer(text: str) -> str | None:
    """What a completion answers: the words after its last " is ", up to the final punctuation, lower-cased with
    single spaces; None when it never says "is"."""
    match = _GIVEN_ANSWER.search(text.strip())
    return " ".join(match.group(1).lower().split()) if match else None


def question_dataset(path, skip_bad_lines=False, question_pattern=None):
    """A `datasets.Dataset` of the chat file's checkable questions, each once, in file order: `prompt` (a
    conversational prompt, the question alone) and `answer` (what a correct completion gives, lower-cased).
    `question_pattern` (a regular expression) keeps only the questions it finds a match in. Raises DataFormatError
    for a malformed file, like every training command."""
    from datasets import Dataset

    from minimind.data import DataFormatError, SkipLog, iter_rows, no_rows_error

    skips = SkipLog(path, skip_bad_lines)
    questions, chats = {}, 0
    for _, row in iter_rows(path, "sft", skips):  # one line at a time: only the questions are kept
        chats += 1
        messages = row["conversations"]
        for asked, reply in zip(messages, messages[1:]):
            if asked["role"] != "user" or reply["role"] != "assistant" or reply.get("tool_calls"):
                continue
            answer = reference_answer(reply.get("content") or "")
            if answer is not None and (question_pattern is None or re.search(question_pattern, asked["content"])):
                questions.setdefault(asked["content"], answer)
    skips.warn()
    if not chats:
        raise no_rows_error(path, "sft", skips.count)
    if not questions:
        raise DataFormatError(
            f"{path}: no question{' matching ' + repr(question_pattern) if question_pattern else ''}"
            f" has a reply of the form '<subject> is <answer>.'. Fix: use a chat file like "
            f"data/sft.jsonl, whose fact answers have that form."
        )
    return Dataset.from_list(
        [
            {"prompt": [{"role": "user", "content": question}], "answer": answer}
            for question, answer in questions.items()
        ]
    )


# --------------------------------------------------------------------------------------------------------------
# Rewards (TRL's signature; dataset columns such as `answer` arrive as keyword lists)
# --------------------------------------------------------------------------------------------------------------


def completion_text(completion) -> str:
    """The text of one completion: TRL passes a string, or for conversational prompts a list of messages."""
    if isinstance(completion, str):
        return completion
    return "".join(message.get("content") or "" for message in completion)


def correct_answer(completions, answer, **kwargs):
    """1.0 where the completion's given answer (see `given_answer`) is the reference answer, else 0.0."""
    return [
        float(given_answer(completion_text(c)) == expected.lower())
        for c, expected in zip(completions, answer, strict=True)
    ]


def format_followed(completions, pattern=ANSWER_FORM, **kwargs):
    """1.0 where the whole completion (surrounding whitespace aside) matches `pattern`, else 0.0. The default is
    the bundled answer form, one sentence "<subject> is <answer>."."""
    return [float(re.fullmatch(pattern, completion_text(c).strip(), flags=re.DOTALL) is not None) for c in completions]


def length_penalty(completions, completion_ids, max_tokens=32, **kwargs):
    """0 up to `max_tokens` completion tokens, then minus the excess as a share of `max_tokens`, floored at -1:
    a completion of 1.5 x max_tokens scores -0.5."""
    return [-min(1.0, max(0, len(ids) - max_tokens) / max_tokens) for ids in completion_ids]


def repetition_penalty(completions, ngram=3, **kwargs):
    """Minus the share of repeated word n-grams: 0 when every n-gram is new, -(1 - distinct / total) otherwise
    (a completion shorter than n words scores 0)."""
    scores = []
    for c in completions:
        words = completion_text(c).lower().split()
        grams = [tuple(words[i : i + ngram]) for i in range(len(words) - ngram + 1)]
        scores.append(-(1 - len(set(grams)) / len(grams)) if grams else 0.0)
    return scores


def load_reward_function(spec: str):
    """`module:function` -> the function (the module imported the ordinary way, so it must be importable from the
    working directory or sys.path)."""
    module_name, sep, function_name = spec.partition(":")
    if not sep or not module_name or not function_name:
        raise ValueError(f"--reward {spec!r}: expected module:function. Fix: e.g. --reward my_rewards:exact_match")
    function = getattr(importlib.import_module(module_name), function_name, None)
    if not callable(function):
        raise ValueError(f"--reward {spec!r}: {module_name} has no function {function_name}")
    return function


@dataclass
class RewardArguments:
    """Which questions GRPO asks, and which rewards it maximises, each with its weight (0 leaves a term out)."""

    question_pattern: str | None = field(
        default=None,
        metadata={"help": "Regular expression: ask only the questions it matches, e.g. 'capital|colour'."},
    )

    correct_weight: float = field(default=1.0, metadata={"help": "Answer correct (1 or 0)."})
    format_weight: float = field(default=0.5, metadata={"help": "Format followed (1 or 0)."})
    format_pattern: str = field(
        default=ANSWER_FORM,
        metadata={"help": "Regular expression a whole completion must match for the format reward."},
    )
    length_weight: float = field(default=0.0, metadata={"help": "Length penalty (0 to -1)."})
    length_max_tokens: int = field(default=32, metadata={"help": "Completion tokens before the length penalty."})
    repetition_weight: float = field(default=0.0, metadata={"help": "Repeated word n-gram penalty (0 to -1)."})
    repetition_ngram: int = 3
    reward: list[str] = field(
        default_factory=list,
        metadata={"help": "module:function (one or more): rewards with TRL's reward-function signature."},
    )
    reward_weight: float = field(default=1.0, metadata={"help": "Weight of each --reward function."})
    reward_model: str | None = field(
        default=None,
        metadata={
            "help": "Directory of a sequence-classification model (num_labels=1) that scores prompt + completion."
        },
    )
    reward_model_weight: float = 1.0


def reward_functions(reward_args):
    """([reward functions or reward-model paths], [weights]) for GRPOTrainer and GRPOConfig.reward_weights."""
    terms = [
        (correct_answer, reward_args.correct_weight),
        (functools.partial(format_followed, pattern=reward_args.format_pattern), reward_args.format_weight),
        (functools.partial(length_penalty, max_tokens=reward_args.length_max_tokens), reward_args.length_weight),
        (functools.partial(repetition_penalty, ngram=reward_args.repetition_ngram), reward_args.repetition_weight),
        *((load_reward_function(spec), reward_args.reward_weight) for spec in reward_args.reward),
    ]
    if reward_args.reward_model:
        terms.append((reward_args.reward_model, reward_args.reward_model_weight))
    terms = [(function, weight) for function, weight in terms if weight != 0]
    if not terms:
        raise ValueError("every reward has weight 0. Fix: give at least one reward a non-zero weight.")
    return [function for function, _ in terms], [float(weight) for _, weight in terms]


# --------------------------------------------------------------------------------------------------------------
# Running
# --------------------------------------------------------------------------------------------------------------


def reward_curve(log_history):
    """[(step, mean reward)] from the trainer's log history."""
    return [(entry["step"], entry["reward"]) for entry in log_history if "reward" in entry and "step" in entry]


def write_reward_curve(log_history, output_dir):
    curve = reward_curve(log_history)
    path = Path(output_dir) / "reward_curve.md"
    rows = "".join(f"| {step} | {reward:.3f} |\n" for step, reward in curve)
    path.write_text("| step | mean reward |\n|---:|---:|\n" + rows, encoding="utf-8")
    return path


def grpo_trainer_class():
    """TRL's GRPOTrainer saving complete MiniMind directories (imported lazily: TRL takes seconds to import)."""
    from trl import GRPOTrainer

    from minimind.training import HFDirectoryMixin

    class MiniMindGRPOTrainer(HFDirectoryMixin, GRPOTrainer):
        pass

    return MiniMindGRPOTrainer


def grpo_config_class():
    from trl import GRPOConfig

    return GRPOConfig


def run_grpo(model_args, data_args, reward_args, training_args):
    """GRPO on the chat file's checkable questions (see `question_dataset`) with the rewards `reward_args` chooses.
    Returns (trainer, metrics); the output directory also gets reward_curve.md (step | mean reward)."""
    from minimind.training import build_model, load_scoring_model, load_tokenizer, setup_run, train_and_save

    if training_args.reward_weights is not None:
        raise ValueError(
            "--reward_weights is set by the per-reward flags. Fix: use --correct_weight, --format_weight, "
            "--length_weight, --repetition_weight, --reward_weight, --reward_model_weight."
        )
    if training_args.beta != 0 and not model_args.model_name_or_path:
        # TRL builds the KL reference by reloading the policy from its path, which a new model does not have.
        raise ValueError(
            "--beta needs a reference model, which TRL loads from --model_name_or_path. Fix: start "
            "from a saved model directory, or keep --beta 0 (TRL's default)."
        )
    setup_run(training_args)
    tokenizer = load_tokenizer(model_args)
    questions = question_dataset(data_args.data_path, data_args.skip_bad_lines, reward_args.question_pattern)
    train_dataset, eval_dataset = split_train_eval(questions, data_args.eval_fraction, training_args.seed)
    logger.info(
        "grpo: %d train / %d eval questions", len(train_dataset), len(eval_dataset) if eval_dataset is not None else 0
    )
    functions, training_args.reward_weights = reward_functions(reward_args)
    # A --reward_model directory is opened here, not by TRL (which would need remote code for a MiniMind one): checked
    # first, with the installed class, its tokenizer beside it; no code shipped in the directory runs.
    reward_tokenizers = [None] * len(functions)
    for i, function in enumerate(functions):
        if isinstance(function, str):
            functions[i], reward_tokenizers[i] = load_scoring_model(function)
    model = build_model(model_args, tokenizer)
    if eval_dataset is None:
        training_args.eval_strategy = "no"
    trainer = grpo_trainer_class()(
        model=model,
        reward_funcs=functions,
        reward_processing_classes=reward_tokenizers,
        args=training_args,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        processing_class=tokenizer,
    )
    trainer, metrics = train_and_save(trainer, training_args)
    if trainer.args.should_save:
        write_reward_curve(trainer.state.log_history, training_args.output_dir)
    return trainer, metrics
