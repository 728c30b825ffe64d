"""minimind.evaluate: lm-eval on a MiniMind directory scores what the model itself computes, the bundled task file
is the bundled data's, the tool-calling score counts exactly, and the table reaches the directory and the card."""

import json
import math
import os
from pathlib import Path

import pytest
import torch

from conftest import ROOT, model_dir

pytest.importorskip("lm_eval", reason="lm-evaluation-harness is not installed: pip install lm-eval")

from minimind import evaluate as ev  # noqa: E402


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """A tiny MiniMind with the bundled tokenizer; sharp logits (std 0.3) so the choices' scores differ."""
    path = tmp_path_factory.mktemp("eval") / "model"
    model_dir(path, std=0.3)
    return path


def own_loglikelihood(model, tokenizer, context, continuation):
    """(sum of log p(continuation token | prefix), every continuation token the argmax) from one forward pass.
    lm-eval's documented split: whitespace ending the context is scored with the continuation (here the newline
    after the chat template's "assistant"), and the two are split at the token boundary of their concatenation."""
    stripped = context.rstrip()
    context, continuation = stripped, context[len(stripped) :] + continuation
    context_ids = tokenizer(context, add_special_tokens=False).input_ids
    whole = tokenizer(context + continuation, add_special_tokens=False).input_ids
    assert whole[: len(context_ids)] == context_ids  # the chat template ends the context on a token boundary
    with torch.no_grad():
        logits = model(torch.tensor([whole])).logits[0].double()
    log_probs = torch.log_softmax(logits[len(context_ids) - 1 : -1], dim=-1)
    targets = torch.tensor(whole[len(context_ids) :])
    picked = log_probs.gather(1, targets[:, None]).squeeze(1)
    return picked.sum().item(), bool((log_probs.argmax(-1) == targets).all())


def test_lm_eval_loglikelihoods_are_the_models_own(tiny_dir):
    """Per sample and per choice, lm-eval's hf backend reports exactly the log-probability that the model gives
    the answer after the chat-formatted question (1e-4), and its accuracy is the share of questions where the
    right answer has the larger one."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    results = ev.run_lm_eval(tiny_dir, limit=6, batch_size=4, log_samples=True)
    samples = results["samples"][ev.FACTS_TASK]
    assert len(samples) == 6
    model = AutoModelForCausalLM.from_pretrained(tiny_dir, trust_remote_code=True, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny_dir)
    rows = [json.loads(line) for line in ev.FACTS_DATA.read_text(encoding="utf-8").splitlines()[:6]]
    right = 0
    for sample, row in zip(sorted(samples, key=lambda s: s["doc_id"]), rows):
        expected_context = tokenizer.apply_chat_template(
            [{"role": "user", "content": row["question"]}], add_generation_prompt=True, tokenize=False
        )
        scores = []
        for (context, continuation), response, choice in zip(sample["arguments"], sample["resps"], row["choices"]):
            assert (context, continuation) == (expected_context, choice)
            loglikelihood, greedy = own_loglikelihood(model, tokenizer, context, continuation)
            assert response[0][0] == pytest.approx(loglikelihood, abs=1e-4)
            assert response[0][1] == greedy
            scores.append(loglikelihood)
        right += max(range(len(scores)), key=scores.__getitem__) == row["label"]
        assert sample["acc"] == float(max(range(len(scores)), key=scores.__getitem__) == row["label"])
    assert results["results"][ev.FACTS_TASK]["acc,none"] == pytest.approx(right / 6, abs=1e-12)
    rows = ev.lm_eval_rows(results)
    assert [(task, metric) for task, metric, _, _ in rows] == [(ev.FACTS_TASK, "acc"), (ev.FACTS_TASK, "acc_norm")]
    assert rows[0][2] == pytest.approx(right / 6)


def test_task_file_is_made_from_bundled_pairs(tmp_path):
    """data/eval_facts.jsonl is write_facts_task's output, byte for byte: 171 distinct questions, each with the
    chosen answer and a rejected one that differs in exactly one word, the right one first and second in turn."""
    assert ev.write_facts_task(tmp_path / "facts.jsonl") == 171
    assert (tmp_path / "facts.jsonl").read_bytes() == ev.FACTS_DATA.read_bytes()
    rows = [json.loads(line) for line in ev.FACTS_DATA.read_text(encoding="utf-8").splitlines()]
    assert [row["label"] for row in rows[:4]] == [0, 1, 0, 1]
    assert rows[0] == {
        "question": "Is 17 odd or even?",
        "choices": ["17 is an odd number.", "19 is an odd number."],
        "label": 0,
    }
    assert len({row["question"] for row in rows}) == 171
    for row in rows:
        right, wrong = row["choices"][row["label"]].split(), row["choices"][1 - row["label"]].split()
        assert len(right) == len(wrong) and sum(a != b for a, b in zip(right, wrong)) == 1


def test_a_bad_task_file_names_its_line(tmp_path):
    path = tmp_path / "facts.jsonl"
    path.write_text('{"question": "q", "choices": ["a", "b"], "label": 1}\n{"question": "q", "choices": ["a"]}\n')
    with pytest.raises(ValueError, match=r"facts.jsonl, line 2: needs a string 'question'.*Fix: regenerate"):
        ev.read_facts_task(path)
    with pytest.raises(FileNotFoundError, match="Fix: run `minimind-eval --write_facts_task"):
        ev.read_facts_task(tmp_path / "missing.jsonl")


def test_tool_prompts_are_the_bundled_tool_chats():
    """124 distinct prompts from the 200 tool chats of data/sft.jsonl, each cut before its first tool call."""
    prompts = ev.tool_prompts()
    assert len(prompts) == 124
    assert prompts[0].messages == [{"role": "user", "content": "What is the weather like in Cairo today?"}]
    assert (prompts[0].name, prompts[0].arguments) == ("get_weather", {"city": "Cairo"})
    assert (prompts[1].name, prompts[1].arguments) == ("add", {"a": 218, "b": 437})
    assert {p.name for p in prompts} == {"get_weather", "add"}
    assert len(ev.tool_prompts(limit=3)) == 3


@pytest.mark.parametrize(
    "reply, parsed",
    [
        ('<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>', ("add", {"a": 1, "b": 2})),
        ('Sure.\n<tool_call>\n{"name": "add", "arguments": "{\\"a\\": 1}"}\n</tool_call>', ("add", {"a": 1})),
        ('<tool_call>\n{"name": "add", "arguments": {"a": 1,}}\n</tool_call>', None),  # not JSON
        ('{"name": "add", "arguments": {"a": 1}}', None),  # no tags
        ('<tool_call>\n["add"]\n</tool_call>', None),
    ],
)
def test_parse_tool_call(reply, parsed):
    assert ev.parse_tool_call(reply) == parsed


def test_tool_calling_score_counts_right_calls():
    """Two of three replies make the expected call (the third has the right name but a wrong argument): 2/3."""
    prompts = ev.tool_prompts(limit=3)
    replies = {
        0: '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Cairo"}}\n</tool_call>',
        1: '<tool_call>\n{"name": "add", "arguments": {"a": 218.0, "b": 437}}\n</tool_call>',  # 218.0 == 218
        2: f'<tool_call>\n{{"name": "{prompts[2].name}", "arguments": {{"wrong": 1}}}}\n</tool_call>',
    }
    score = ev.tool_calling_score(prompts, lambda prompt: replies[prompts.index(prompt)])
    assert (score.correct, score.total) == (2, 3)
    assert round(score.score, 3) == 0.667
    assert [right for _, _, right in score.replies] == [True, True, False]
    assert math.isnan(ev.tool_calling_score([], lambda p: "").score)


def test_greedy_reply_renders_tools_decodes_call(tiny_dir, monkeypatch):
    """The model sees the prompt rendered with its tools (the chat template's ids) and its generated tokens are
    decoded with <tool_call> kept, so a model that emits the right call scores 1."""
    from minimind.chat import chat_prompt_ids, load_model_and_tokenizer

    model, tokenizer = load_model_and_tokenizer(str(tiny_dir), "cpu")
    prompts = ev.tool_prompts(limit=2)
    seen = []

    def generate(input_ids, **kwargs):
        seen.append((input_ids[0].tolist(), kwargs["do_sample"]))
        prompt = prompts[len(seen) - 1]
        call = json.dumps({"name": prompt.name, "arguments": prompt.arguments})
        reply = tokenizer(f"<tool_call>\n{call}\n</tool_call><|im_end|>", add_special_tokens=False).input_ids
        return torch.cat([input_ids, torch.tensor([reply])], dim=1)

    monkeypatch.setattr(model, "generate", generate)
    score = ev.tool_calling_score(prompts, ev.greedy_reply(model, tokenizer))
    assert (score.correct, score.total) == (2, 2)
    assert seen == [(chat_prompt_ids(tokenizer, p.messages, p.tools), False) for p in prompts]
    assert "get_weather" in tokenizer.decode(seen[0][0]) and "<tools>" in tokenizer.decode(seen[0][0])


def test_command_writes_table_and_card_shows_it(tiny_dir, capsys):
    """minimind-eval prints the table, writes eval_results.json / .md into the model directory, and the model
    card minimind-push builds carries the same table and the Hub's model-index entries."""
    from minimind.cli import evaluate
    from minimind.hub import build_model_card, files_to_upload

    rows = evaluate(
        ["--model_name_or_path", str(tiny_dir), "--limit", "4", "--tool_limit", "2", "--max_new_tokens", "4"]
    )
    assert [(task, metric) for task, metric, _, _ in rows] == [
        (ev.FACTS_TASK, "acc"),
        (ev.FACTS_TASK, "acc_norm"),
        (ev.TOOL_CALLING, "call_acc"),
    ]
    assert rows[2][2] == 0.0  # four random tokens are no tool call
    saved = json.loads((tiny_dir / ev.RESULTS_JSON).read_text())
    assert [(r["task"], r["metric"], r["value"]) for r in saved["results"]] == [row[:3] for row in rows]
    assert saved["tool_calling"] == {"correct": 0, "total": 2} and saved["n_samples"] == {ev.FACTS_TASK: 4}
    table = (tiny_dir / ev.RESULTS_MARKDOWN).read_text()
    assert f"| {ev.FACTS_TASK} | acc | {rows[0][2]:.4f} |" in table and table.strip() in capsys.readouterr().out
    card = str(build_model_card(tiny_dir, "you/minimind-tiny"))
    assert "## Evaluation" in card and table.strip() in card
    assert "model-index" in card and "call_acc" in card
    assert {ev.RESULTS_JSON, ev.RESULTS_MARKDOWN} <= set(files_to_upload(tiny_dir))
    for name in (ev.RESULTS_JSON, ev.RESULTS_MARKDOWN):
        os.remove(tiny_dir / name)
    assert "## Evaluation" not in str(build_model_card(tiny_dir, "you/minimind-tiny"))


def test_the_task_yaml_ships_with_the_package():
    assert Path(ev.TASKS_DIR, "minimind_facts.yaml").is_file() and Path(ROOT, "data", "eval_facts.jsonl").is_file()
