"""Evaluate a MiniMind directory: lm-evaluation-harness tasks plus a tool-calling score, in one results table.

lm-eval does the scoring (`lm_eval.simple_evaluate`, its `hf` backend given the model as `minimind.loading`
checked and loaded it, no code from the directory), so any of its tasks runs for users who have the data. The
bundled task `minimind_facts` needs no Hub: its YAML ships in `minimind/eval_tasks/` (registered with a `TaskManager`
`include_path`) and its data, `data/eval_facts.jsonl`, is made deterministically from the bundled preference
pairs. The tool-calling score is ours, because lm-eval has no task that renders `tools` into a chat template:
the share of the bundled tool-use prompts whose greedy reply parses to the right call (name and arguments).

The table is printed and written next to the weights (`eval_results.json`, `eval_results.md`), where the model
card that `minimind-push` builds picks it up.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

TASKS_DIR = Path(__file__).resolve().parent / "eval_tasks"
REPO_ROOT = Path(__file__).resolve().parent.parent
FACTS_TASK = "minimind_facts"
FACTS_DATA = REPO_ROOT / "data" / "eval_facts.jsonl"
BUNDLED_DPO = REPO_ROOT / "data" / "dpo.jsonl"
BUNDLED_SFT = REPO_ROOT / "data" / "sft.jsonl"
TOOL_CALLING = "tool_calling"
RESULTS_JSON = "eval_results.json"
RESULTS_MARKDOWN = "eval_results.md"
# lm-eval's per-task bookkeeping keys that are not scores.
_NOT_SCORES = ("alias", "name", "sample_len", "samples")


# --------------------------------------------------------------------------------------------------------------
# The bundled fact task
# --------------------------------------------------------------------------------------------------------------


def facts_task_rows(dpo_path=BUNDLED_DPO):
    """The fact questions of the bundled preference pairs whose rejected answer is a wrong fact, not a refusal:
    it has the chosen answer's words with exactly one changed ("3 plus 4 is 7." / "3 plus 4 is 8."). Each
    question once, in file order; the right answer's position alternates so that always picking the first (or
    the second) choice scores 0.5."""
    rows, seen = [], set()
    for line in Path(dpo_path).read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        pair = json.loads(line)
        question = pair["chosen"][-2]["content"]
        right, wrong = pair["chosen"][-1]["content"], pair["rejected"][-1]["content"]
        right_words, wrong_words = right.split(), wrong.split()
        one_word_apart = (
            len(right_words) == len(wrong_words) and sum(a != b for a, b in zip(right_words, wrong_words)) == 1
        )
        if not one_word_apart or question in seen:
            continue
        seen.add(question)
        label = len(rows) % 2
        choices = [right, wrong] if label == 0 else [wrong, right]
        rows.append({"question": question, "choices": choices, "label": label})
    return rows


def write_facts_task(output_path=FACTS_DATA, dpo_path=BUNDLED_DPO):
    """Write the bundled task's jsonl (byte-identical on every run for the same input); returns its row count."""
    rows = facts_task_rows(dpo_path)
    Path(output_path).write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows), encoding="utf-8")
    return len(rows)


def read_facts_task(path=FACTS_DATA):
    """The task's rows as a `datasets.Dataset`, each checked, so that a bad file fails here with its line number
    rather than deep inside lm-eval."""
    from datasets import Dataset

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(
            f"{path}: no such task file. Fix: run `minimind-eval --write_facts_task {path}` "
            f"or pass metadata data_path=<jsonl with question, choices, label>."
        )
    rows = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        row = json.loads(line)
        if not (
            isinstance(row.get("question"), str)
            and isinstance(row.get("choices"), list)
            and isinstance(row.get("label"), int)
            and 0 <= row["label"] < len(row["choices"])
        ):
            raise ValueError(
                f"{path}, line {number}: needs a string 'question', a list 'choices' and an integer "
                f"'label' indexing into it, got {sorted(row)}. Fix: regenerate the file with "
                f"`minimind-eval --write_facts_task`."
            )
        rows.append(row)
    return Dataset.from_list(rows)


# --------------------------------------------------------------------------------------------------------------
# lm-evaluation-harness
# --------------------------------------------------------------------------------------------------------------


def task_manager(tasks, extra_include_paths=()):
    """lm-eval's TaskManager with the bundled task directory (and any other YAML directories) registered. lm-eval's
    own task catalogue is indexed only when a task outside those directories is asked for: indexing its
    thousands of YAML files is slow."""
    from lm_eval.tasks import TaskManager

    include_path = [str(TASKS_DIR), *map(str, extra_include_paths)]
    manager = TaskManager(include_path=include_path, include_defaults=False)
    if all(manager.match_tasks([task]) for task in tasks):
        return manager
    return TaskManager(include_path=include_path)


def run_lm_eval(
    model_dir,
    tasks=(FACTS_TASK,),
    *,
    limit=None,
    batch_size=8,
    device="cpu",
    dtype="float32",
    apply_chat_template=True,
    num_fewshot=None,
    log_samples=False,
    include_paths=(),
    metadata=None,
    loaded=None,
):
    """lm-eval's `simple_evaluate` on a MiniMind directory through its `hf` backend (`HFLM`), given the model
    as MiniMind's loader checks and loads it (`loaded`: an already loaded (model, tokenizer)); returns lm-eval's
    results dict (with per-sample records under "samples" when `log_samples`)."""
    try:
        import lm_eval
    except ImportError as error:
        raise ImportError(
            "minimind-eval needs lm-evaluation-harness. Fix: pip install 'minimind[eval]' (or pip install lm-eval)."
        ) from error
    manager = task_manager(tasks, include_paths)
    unknown = [task for task in tasks if not manager.match_tasks([task])]
    if unknown:
        raise ValueError(
            f"lm-eval knows no task {unknown}. Fix: use a name from `lm-eval ls tasks`, "
            f"{FACTS_TASK!r} (bundled), or --include_path a directory holding its YAML."
        )
    from lm_eval.models.huggingface import HFLM

    from minimind.chat import load_model_and_tokenizer

    model, tokenizer = loaded or load_model_and_tokenizer(model_dir, device, dtype)
    lm = HFLM(pretrained=model, tokenizer=tokenizer, backend="causal", batch_size=batch_size)
    return lm_eval.simple_evaluate(
        model=lm,
        tasks=list(tasks),
        limit=limit,
        batch_size=batch_size,
        num_fewshot=num_fewshot,
        task_manager=manager,
        apply_chat_template=apply_chat_template,
        log_samples=log_samples,
        metadata=metadata,
        random_seed=0,
        numpy_random_seed=0,
        torch_random_seed=0,
        fewshot_random_seed=0,
    )


def lm_eval_rows(results):
    """[(task, metric, value, stderr or None)] from lm-eval's results dict, in its task order."""
    rows = []
    for task, scores in results["results"].items():
        for key, value in scores.items():
            metric, _, filter_name = key.partition(",")
            if metric in _NOT_SCORES or metric.endswith("_stderr") or not isinstance(value, (int, float)):
                continue
            stderr = scores.get(f"{metric}_stderr,{filter_name}")
            rows.append((task, metric, float(value), stderr if isinstance(stderr, (int, float)) else None))
    return rows


# --------------------------------------------------------------------------------------------------------------
# Tool calling
# --------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ToolPrompt:
    messages: list  # the chat up to the assistant turn that should call a tool
    tools: list  # the JSON schemas offered
    name: str  # the expected call
    arguments: dict


def tool_prompts(sft_path=BUNDLED_SFT, limit=None):
    """The tool-use chats of an SFT file, cut before their first tool call, each distinct prompt once."""
    prompts, seen = [], set()
    for line in Path(sft_path).read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        chat = json.loads(line)
        messages = chat["conversations"]
        turn = next((i for i, m in enumerate(messages) if m["role"] == "assistant" and m.get("tool_calls")), None)
        if turn is None or not chat.get("tools"):
            continue
        call = messages[turn]["tool_calls"][0]
        call = call.get("function", call)
        arguments = call["arguments"]
        arguments = json.loads(arguments) if isinstance(arguments, str) else arguments
        key = json.dumps([messages[:turn], chat["tools"]], sort_keys=True)
        if key in seen:
            continue
        seen.add(key)
        prompts.append(ToolPrompt(messages[:turn], chat["tools"], call["name"], arguments))
        if limit is not None and len(prompts) == limit:
            break
    return prompts


_TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def parse_tool_call(reply):
    """(name, arguments) of the first `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` in a reply (the
    chat template's format), or None when there is none or it is not that JSON."""
    match = _TOOL_CALL.search(reply)
    if not match:
        return None
    try:
        call = json.loads(match.group(1))
    except json.JSONDecodeError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return None
    arguments = call.get("arguments", {})
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None
    return call["name"], arguments


@dataclass
class ToolCallingScore:
    correct: int
    total: int
    replies: list = field(default_factory=list)  # [(prompt, reply, right)]

    @property
    def score(self):
        return self.correct / self.total if self.total else math.nan


def tool_calling_score(prompts, reply: Callable[[ToolPrompt], str]):
    """The share of prompts whose reply parses to the expected call: same name, equal arguments (as JSON values,
    so 3 and 3.0 are equal)."""
    replies = []
    for prompt in prompts:
        text = reply(prompt)
        replies.append((prompt, text, parse_tool_call(text) == (prompt.name, prompt.arguments)))
    return ToolCallingScore(sum(right for _, _, right in replies), len(replies), replies)


def greedy_reply(model, tokenizer, max_new_tokens=64):
    """A `reply` function for `tool_calling_score`: the model's greedy reply to the prompt rendered with the
    tools, decoded with `<tool_call>` kept (the tokenizer does not skip it)."""
    import torch

    from minimind.chat import chat_prompt_ids

    def reply(prompt):
        ids = torch.tensor([chat_prompt_ids(tokenizer, prompt.messages, prompt.tools)], device=model.device)
        with torch.no_grad():
            output = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                pad_token_id=tokenizer.pad_token_id,
            )
        return tokenizer.decode(output[0, ids.shape[1] :], skip_special_tokens=True)

    return reply


# --------------------------------------------------------------------------------------------------------------
# The results table
# --------------------------------------------------------------------------------------------------------------


def markdown_table(rows):
    lines = ["| task | metric | value | stderr |", "|---|---|---:|---:|"]
    lines += [
        f"| {task} | {metric} | {value:.4f} | {'' if stderr is None else f'{stderr:.4f}'} |"
        for task, metric, value, stderr in rows
    ]
    return "\n".join(lines)


def write_results(model_dir, rows, details):
    """eval_results.json (rows and run details) and eval_results.md (the table) in the model directory."""
    model_dir = Path(model_dir)
    records = [
        {"task": task, "metric": metric, "value": value, "stderr": stderr} for task, metric, value, stderr in rows
    ]
    (model_dir / RESULTS_JSON).write_text(
        json.dumps({"results": records, **details}, indent=2) + "\n", encoding="utf-8"
    )
    (model_dir / RESULTS_MARKDOWN).write_text(markdown_table(rows) + "\n", encoding="utf-8")
    return model_dir / RESULTS_JSON, model_dir / RESULTS_MARKDOWN


@dataclass
class EvalSettings:
    model_dir: str
    tasks: tuple = (FACTS_TASK,)
    limit: float | None = None
    batch_size: int = 8
    device: str = "cpu"
    dtype: str = "float32"
    apply_chat_template: bool = True
    num_fewshot: int | None = None
    include_paths: tuple = ()
    tool_calling: bool = True
    tool_limit: int | None = None
    max_new_tokens: int = 64
    write: bool = True


def evaluate(settings: EvalSettings, log=print):
    """Run the lm-eval tasks and the tool-calling score; print and (unless told not to) write the table.
    Returns the rows [(task, metric, value, stderr)]."""
    from minimind.chat import load_model_and_tokenizer

    rows, details = (
        [],
        {
            "model": str(settings.model_dir),
            "limit": settings.limit,
            "apply_chat_template": settings.apply_chat_template,
        },
    )
    model, tokenizer = load_model_and_tokenizer(settings.model_dir, settings.device, settings.dtype)
    if settings.tasks:
        results = run_lm_eval(
            settings.model_dir,
            settings.tasks,
            limit=settings.limit,
            loaded=(model, tokenizer),
            batch_size=settings.batch_size,
            device=settings.device,
            dtype=settings.dtype,
            apply_chat_template=settings.apply_chat_template,
            num_fewshot=settings.num_fewshot,
            include_paths=settings.include_paths,
        )
        rows += lm_eval_rows(results)
        details["lm_eval_version"] = results.get("lm_eval_version")
        details["n_samples"] = {task: counts.get("effective") for task, counts in results.get("n-samples", {}).items()}
    if settings.tool_calling:
        score = tool_calling_score(
            tool_prompts(limit=settings.tool_limit), greedy_reply(model, tokenizer, settings.max_new_tokens)
        )
        rows.append((TOOL_CALLING, "call_acc", score.score, None))
        details["tool_calling"] = {"correct": score.correct, "total": score.total}
    log(markdown_table(rows))
    if settings.write:
        for path in write_results(settings.model_dir, rows, details):
            log(f"wrote {path}")
    return rows
