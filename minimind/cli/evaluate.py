"""The evaluation command: lm-evaluation-harness tasks and tool-call scoring."""

from __future__ import annotations

import argparse

from minimind.cli.base import command, make_parser


@command(keeps_heap=True)
def evaluate(argv=None):
    """Evaluate a MiniMind directory with lm-evaluation-harness (any task; default the bundled offline
    minimind_facts) and score its tool calls on the bundled tool-use prompts. Prints the table and writes
    eval_results.json / eval_results.md into the model directory (minimind-push puts them in the model card).

    minimind-eval --model_name_or_path runs/sft
    minimind-eval --model_name_or_path runs/sft --tasks minimind_facts hellaswag --limit 100 --batch_size 16
    minimind-eval --write_facts_task data/eval_facts.jsonl      # rebuild the bundled task file from data/dpo.jsonl
    """
    from minimind.chat import DTYPES
    from minimind.evaluate import FACTS_TASK, EvalSettings, write_facts_task
    from minimind.evaluate import evaluate as run

    parser = make_parser(evaluate.__doc__)
    parser.add_argument("--model_name_or_path", help="a MiniMind directory with its tokenizer")
    parser.add_argument(
        "--tasks", nargs="*", default=[FACTS_TASK], help="lm-eval task names (none: only the tool-calling score)"
    )
    parser.add_argument(
        "--limit", type=float, default=None, help="documents per task (a number below 1 is a fraction, lm-eval's rule)"
    )
    parser.add_argument("--batch_size", type=int, default=8)
    parser.add_argument("--num_fewshot", type=int, default=None)
    parser.add_argument("--device", default="cpu", help="e.g. cuda")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    parser.add_argument(
        "--apply_chat_template",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="wrap each prompt in the chat template (the default: MiniMind models are chat models)",
    )
    parser.add_argument("--include_path", nargs="*", default=[], help="more directories of lm-eval task YAMLs")
    parser.add_argument(
        "--tool_calling",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="score greedy tool calls on the bundled tool-use prompts",
    )
    parser.add_argument("--tool_limit", type=int, default=None, help="tool-use prompts to score (default: all)")
    parser.add_argument("--max_new_tokens", type=int, default=64, help="reply length for the tool calls")
    parser.add_argument(
        "--no_write",
        dest="write",
        action="store_false",
        help="print the table only, write nothing into the model directory",
    )
    parser.add_argument(
        "--write_facts_task", metavar="PATH", default=None, help="write the bundled task's jsonl to PATH and stop"
    )
    args = parser.parse_args(argv)
    if args.write_facts_task:
        from pathlib import Path

        Path(args.write_facts_task).parent.mkdir(parents=True, exist_ok=True)
        rows = write_facts_task(args.write_facts_task)
        print(f"wrote {args.write_facts_task}: {rows} questions")
        return rows
    if not args.model_name_or_path:
        parser.error("--model_name_or_path is required (or --write_facts_task PATH)")
    limit = int(args.limit) if args.limit is not None and args.limit >= 1 else args.limit
    settings = EvalSettings(
        model_dir=args.model_name_or_path,
        tasks=tuple(args.tasks),
        limit=limit,
        batch_size=args.batch_size,
        device=args.device,
        dtype=args.dtype,
        apply_chat_template=args.apply_chat_template,
        num_fewshot=args.num_fewshot,
        include_paths=tuple(args.include_path),
        tool_calling=args.tool_calling,
        tool_limit=args.tool_limit,
        max_new_tokens=args.max_new_tokens,
        write=args.write,
    )
    return run(settings)
