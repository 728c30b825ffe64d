"""Every MiniMind command line, one function per command: the `minimind-*` console scripts and `scripts/*.py`.

Argument parsing for all commands lives here, apart from the modules that do the work, so each of those stays a
library (no argparse, nothing read from sys.argv) and every command is reachable the same two ways:
`minimind-pretrain ...` after `pip install -e .`, or `python scripts/pretrain.py ...` in a checkout. Each function
takes `argv` (default: the process's arguments) and, given one, returns what it made, so tests call them
in-process. Work modules are imported inside the functions: `minimind-chat --help` needs neither TRL nor fastapi.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys


def command(run):
    """A command line: bad input (`minimind.errors.InputError`: a path, a data line, a checkpoint) ends it with the
    message alone and exit code 2, no traceback. Called with
    `argv` it returns what the command made; run as a program (argv=None) it returns None, because console
    scripts hand the return value to sys.exit, where anything else becomes an error exit."""

    @functools.wraps(run)
    def main(argv=None):
        from minimind.errors import InputError

        try:
            result = run(argv)
        except InputError as error:
            print(f"error: {error}", file=sys.stderr)
            raise SystemExit(2) from None
        return result if argv is not None else None

    return main


def _parser(doc):
    return argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)


# --------------------------------------------------------------------------------------------------------------
# Training (every TrainingArguments flag, see minimind.training)
# --------------------------------------------------------------------------------------------------------------


@command
def pretrain(argv=None):
    """Pretrain MiniMind on packed text blocks (data/pretrain.jsonl format: {"text": ...} per line).

    minimind-pretrain --output_dir out/pretrain --hidden_size 512 --num_hidden_layers 8 --max_steps 2000
    accelerate launch --num_processes 2 scripts/pretrain.py ...      # or: torchrun --nproc_per_node 2 ...
    """
    from minimind.training import BUNDLED_DATA, parse_args, run_pretrain

    model_args, data_args, training_args = parse_args(
        argv, output_dir="out/pretrain", data_path=BUNDLED_DATA["pretrain"]
    )
    return run_pretrain(model_args, data_args, training_args)


@command
def sft(argv=None):
    """Supervised fine-tuning on chats (data/sft.jsonl format); only assistant replies are trained."""
    from minimind.training import BUNDLED_DATA, parse_args, run_sft

    model_args, data_args, training_args = parse_args(argv, output_dir="out/sft", data_path=BUNDLED_DATA["sft"])
    return run_sft(model_args, data_args, training_args)


@command
def lora(argv=None):
    """LoRA fine-tuning with PEFT; with --merge also a full merged model in <output_dir>/merged."""
    from minimind.training import BUNDLED_DATA, LoraArguments, parse_args, run_lora

    model_args, data_args, lora_args, training_args = parse_args(
        argv, LoraArguments, output_dir="out/lora", data_path=BUNDLED_DATA["sft"]
    )
    return run_lora(model_args, data_args, lora_args, training_args)


@command
def dpo(argv=None):
    """Direct preference optimisation with TRL's DPOTrainer (data/dpo.jsonl format); every DPOConfig flag."""
    from minimind.training import BUNDLED_DATA, dpo_config_class, parse_args, run_dpo

    model_args, data_args, training_args = parse_args(
        argv, training_args_class=dpo_config_class(), output_dir="out/dpo", data_path=BUNDLED_DATA["dpo"]
    )
    return run_dpo(model_args, data_args, training_args)


@command
def distill(argv=None):
    """Knowledge distillation from any causal LM teacher that shares the student's vocabulary."""
    from minimind.training import BUNDLED_DATA, DistillArguments, parse_args, run_distill

    model_args, data_args, distill_args, training_args = parse_args(
        argv, DistillArguments, output_dir="out/distill", data_path=BUNDLED_DATA["sft"]
    )
    return run_distill(model_args, data_args, distill_args, training_args)


@command
def grpo(argv=None):
    """GRPO with TRL's GRPOTrainer and verifiable rewards on the bundled chats' fact questions (answer correct,
    format followed; optional length and repetition penalties, --reward module:function, --reward_model DIR).
    Every GRPOConfig flag.

    minimind-grpo --model_name_or_path runs/demo/sft --output_dir runs/grpo --max_steps 40
    """
    from minimind.rl import RewardArguments, grpo_config_class, run_grpo
    from minimind.training import BUNDLED_DATA, parse_args

    # TRL's defaults are for billion-parameter models; these suit MiniMind's short fact answers.
    model_args, data_args, reward_args, training_args = parse_args(
        argv,
        RewardArguments,
        training_args_class=grpo_config_class(),
        output_dir="out/grpo",
        data_path=BUNDLED_DATA["sft"],
        eval_fraction=0.0,
        learning_rate=1e-5,
        num_generations=8,
        max_completion_length=32,
        logging_steps=1,
    )
    return run_grpo(model_args, data_args, reward_args, training_args)


@command
def demo(argv=None):
    """The whole MiniMind pipeline in about five minutes on a CPU: pretrain a small model on the bundled corpus,
    fine-tune it on the bundled chats, save a Hugging Face directory, reload it with AutoModelForCausalLM
    (trust_remote_code=True) and check its greedy answers to the README's questions.

    minimind-demo                        # writes runs/demo/{pretrain,sft}
    """
    from minimind.demo import DemoSettings, run_demo

    defaults = DemoSettings()
    parser = _parser(demo.__doc__)
    parser.add_argument("--output_dir", default=defaults.output_dir)
    parser.add_argument("--pretrain_steps", type=int, default=defaults.pretrain_steps)
    parser.add_argument("--sft_steps", type=int, default=defaults.sft_steps)
    parser.add_argument("--hidden_size", type=int, default=defaults.hidden_size)
    parser.add_argument("--num_hidden_layers", type=int, default=defaults.num_hidden_layers)
    parser.add_argument("--max_seq_length", type=int, default=defaults.max_seq_length, help="pretraining block length")
    parser.add_argument(
        "--sft_max_seq_length", type=int, default=defaults.sft_max_seq_length, help="the bundled chats are short"
    )
    parser.add_argument("--logging_steps", type=int, default=defaults.logging_steps)
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument(
        "--threads",
        type=int,
        default=defaults.threads,
        help="torch threads; results are reproducible at a fixed count",
    )
    return run_demo(DemoSettings(**vars(parser.parse_args(argv))))


# --------------------------------------------------------------------------------------------------------------
# Using a model: chat, serve, export, publish, import
# --------------------------------------------------------------------------------------------------------------


def _add_model_flags(parser):
    from minimind.chat import DTYPES

    parser.add_argument("--model_name_or_path", required=True, help="a model directory (or Hub id) with tokenizer")
    parser.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32")


COMPILE_NOTICE = (
    "the first reply compiles the decode step for this model (10-60 s on a CPU) before it starts streaming; "
    "--no-compile answers at once, decoding more slowly"
)


def _add_decode_flags(parser):
    parser.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="decode with the one-token step compiled against a static cache (default; the first "
        "reply waits 10-60 s for compilation on a CPU); --no-compile uses model.generate",
    )
    parser.add_argument(
        "--int8",
        action="store_true",
        help="weight-only int8 decoder layers (torchao; pip install 'minimind[int8]'), the rest "
        "in bfloat16 unless --dtype float16: the fastest CPU decode",
    )


@command
def chat(argv=None):
    """Chat with a MiniMind checkpoint in the terminal, the reply streamed token by token.

    minimind-chat --model_name_or_path runs/sft --temperature 0.7 --top_p 0.9

    Type a message and press Enter. /reset starts a new conversation, /exit (or Ctrl-D) quits.
    """
    from minimind import chat as engine

    parser = _parser(chat.__doc__)
    _add_model_flags(parser)
    parser.add_argument("--system_prompt", default=None)
    parser.add_argument("--max_new_tokens", type=int, default=engine.DEFAULT_MAX_NEW_TOKENS)
    parser.add_argument(
        "--do_sample",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="sample (default) or, with --no-do_sample, decode greedily",
    )
    parser.add_argument("--temperature", type=float, default=engine.CHAT_TEMPERATURE)
    parser.add_argument("--top_p", type=float, default=engine.CHAT_TOP_P)
    parser.add_argument("--top_k", type=int, default=0, help="0 disables top-k filtering")
    parser.add_argument(
        "--enable_thinking",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="let the model reason in a <think> block, shown apart from the answer (default); "
        "--no-enable_thinking puts an empty think block in the prompt so it answers directly",
    )
    _add_decode_flags(parser)
    args = parser.parse_args(argv)
    model, tokenizer = engine.load_model_and_tokenizer(args.model_name_or_path, args.device, args.dtype, args.int8)
    decoder = None
    if args.compile:
        from minimind.decode import CompiledDecoder

        decoder = CompiledDecoder(model)
        print(COMPILE_NOTICE, file=sys.stderr, flush=True)
    params = engine.SamplingParams(
        max_new_tokens=args.max_new_tokens,
        do_sample=args.do_sample,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
    )
    engine.chat_loop(
        model,
        tokenizer,
        params,
        system_prompt=args.system_prompt,
        read_line=input,
        out=sys.stdout,
        enable_thinking=args.enable_thinking,
        decoder=decoder,
    )


@command
def serve(argv=None):
    """Serve a MiniMind checkpoint over an OpenAI-compatible HTTP API.

    minimind-serve --model_name_or_path runs/sft --port 8000

    Then point any OpenAI client at http://127.0.0.1:8000/v1. With --api_key (or MINIMIND_API_KEY set), clients
    must send it as `Authorization: Bearer <key>`.
    """
    import os

    from minimind import serving
    from minimind.chat import load_model_and_tokenizer

    limits = serving.ServerLimits()
    parser = _parser(serve.__doc__)
    _add_model_flags(parser)
    parser.add_argument(
        "--served_model_name", default=None, help="the `model` name clients must send (default: the directory's name)"
    )
    parser.add_argument("--host", default="127.0.0.1", help="use 0.0.0.0 to accept other machines (with --api_key)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument(
        "--api_key",
        default=os.environ.get("MINIMIND_API_KEY") or None,
        help="require `Authorization: Bearer <key>` (default: $MINIMIND_API_KEY; unset: no key)",
    )
    parser.add_argument(
        "--max_context",
        type=int,
        default=None,
        help="longest prompt + completion in tokens (default: the model's max_position_embeddings)",
    )
    parser.add_argument(
        "--default_max_tokens",
        type=int,
        default=limits.default_max_tokens,
        help="completion length when a request sets no max_tokens",
    )
    parser.add_argument(
        "--max_tokens",
        type=int,
        default=limits.max_tokens,
        help="most completion tokens a request may ask for; more is a 400",
    )
    parser.add_argument("--max_n", type=int, default=limits.max_n, help="most choices (n) per request; more is a 400")
    parser.add_argument(
        "--max_prompt_tokens",
        type=int,
        default=None,
        help="longest prompt in tokens; longer is a 400 (default: max_context - 1)",
    )
    parser.add_argument(
        "--max_concurrent_requests",
        type=int,
        default=limits.max_concurrent_requests,
        help="requests in progress at once; more get 429 with Retry-After",
    )
    parser.add_argument(
        "--request_timeout",
        type=float,
        default=limits.request_timeout,
        help="seconds a request may take; then its generation stops and it gets a 504",
    )
    parser.add_argument(
        "--max_request_bytes",
        type=int,
        default=limits.max_request_bytes,
        help="largest request body in bytes; a larger one gets 413 before it is read or parsed",
    )
    parser.add_argument(
        "--kv_cache_tokens",
        type=int,
        default=None,
        help="tokens the paged KV cache holds for all requests together; requests that do not fit "
        "wait (default: every admitted request at full context, at most "
        f"{serving.ServerLimits.DEFAULT_KV_CACHE_TOKENS} unless 2 x max_context is more)",
    )
    parser.add_argument(
        "--engine",
        default="paged",
        choices=serving.Generator.ENGINES,
        help="paged: transformers' continuous batching over a paged KV cache (any context, eager "
        "steps); compiled: torch.compile'd steps over max_batch rows of max_context positions "
        "(faster; compiles for a minute at start)",
    )
    parser.add_argument(
        "--max_batch",
        type=int,
        default=limits.max_batch,
        help="--engine compiled: sequences decoded together; more wait for a free row",
    )
    parser.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="--engine compiled: --no-compile runs its steps eagerly",
    )
    args = parser.parse_args(argv)
    limits = serving.ServerLimits(
        max_context=args.max_context,
        default_max_tokens=args.default_max_tokens,
        max_tokens=args.max_tokens,
        max_n=args.max_n,
        max_prompt_tokens=args.max_prompt_tokens,
        max_concurrent_requests=args.max_concurrent_requests,
        request_timeout=args.request_timeout,
        kv_cache_tokens=args.kv_cache_tokens,
        max_batch=args.max_batch,
        max_request_bytes=args.max_request_bytes,
    )
    model, tokenizer = load_model_and_tokenizer(args.model_name_or_path, args.device, args.dtype)
    model_id = args.served_model_name or os.path.basename(os.path.normpath(args.model_name_or_path))
    try:
        generator = serving.Generator(
            model, tokenizer, model_id, limits=limits, engine=args.engine, compile=args.compile
        )
    except ValueError as error:
        parser.error(str(error))
    if args.engine == "compiled" and args.compile:
        print(f"compiling the decode step for batches of {generator.engine.batch_sizes} rows ...", flush=True)
        print(f"compiled in {generator.engine.warm_up():.0f} s", flush=True)
    if not args.api_key and not serving.is_loopback_host(args.host):
        address = f"[{args.host}]" if ":" in args.host else args.host
        print(
            f"warning: serving on {address}:{args.port} without --api_key: anyone who can reach this port can use "
            "the model; pass --api_key (or set MINIMIND_API_KEY)",
            file=sys.stderr,
            flush=True,
        )
    serving.serve(serving.create_app(generator, api_key=args.api_key or None), host=args.host, port=args.port)


@command
def web(argv=None):
    """Chat with a MiniMind checkpoint in the browser (Gradio, `pip install "minimind[web]"`): streamed replies,
    the reasoning of a <think> reply folded, sampling controls, a system prompt and a choice of model on the page.

    minimind-web --model_name_or_path runs/demo/sft          # then open http://127.0.0.1:7860
    minimind-web --model_name_or_path runs/a --model_name_or_path runs/b --host 0.0.0.0 --auth me:secret

    Visitors choose among the models named here; the page never loads a path typed into it.
    """
    from minimind import web as page
    from minimind.chat import CHAT_TEMPERATURE, CHAT_TOP_P, DEFAULT_MAX_NEW_TOKENS, DTYPES, SamplingParams
    from minimind.serving import is_loopback_host

    parser = _parser(web.__doc__)
    parser.add_argument(
        "--model_name_or_path",
        action="append",
        required=True,
        help="a MiniMind directory (or Hub id) with tokenizer; repeat it to offer several models",
    )
    parser.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    parser.add_argument("--system_prompt", default=None)
    parser.add_argument("--max_new_tokens", type=int, default=DEFAULT_MAX_NEW_TOKENS)
    parser.add_argument(
        "--temperature", type=float, default=CHAT_TEMPERATURE, help="the page's starting value; 0 = greedy"
    )
    parser.add_argument("--top_p", type=float, default=CHAT_TOP_P)
    parser.add_argument(
        "--enable_thinking",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="the page's starting value of 'Let the model think'",
    )
    parser.add_argument("--host", default="127.0.0.1", help="use 0.0.0.0 to accept other machines (with --auth)")
    parser.add_argument("--port", type=int, default=7860)
    parser.add_argument(
        "--auth",
        metavar="USER:PASSWORD",
        default=os.environ.get("MINIMIND_WEB_AUTH") or None,
        help="ask visitors for this user name and password (Gradio's login; default: "
        "$MINIMIND_WEB_AUTH; unset: no login)",
    )
    _add_decode_flags(parser)
    args = parser.parse_args(argv)
    user, colon, password = (args.auth or "").partition(":")
    if args.auth is not None and not (user and colon and password):
        parser.error("--auth takes USER:PASSWORD, both non-empty")
    if not is_loopback_host(args.host) and args.auth is None:
        print(
            f"warning: the page is served on {args.host}:{args.port} without --auth: anyone who can reach this "
            "port can chat with the model; pass --auth USER:PASSWORD",
            file=sys.stderr,
            flush=True,
        )
    defaults = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p)
    app = page.build_app(
        args.model_name_or_path,
        device=args.device,
        dtype=args.dtype,
        defaults=defaults,
        system_prompt=args.system_prompt,
        enable_thinking=args.enable_thinking,
        compile=args.compile,
        int8=args.int8,
    )
    if args.compile:
        print(COMPILE_NOTICE, file=sys.stderr, flush=True)
    page.launch(app, host=args.host, port=args.port, auth=(user, password) if args.auth else None)
    return app


@command
def export(argv=None):
    """Export a MiniMind model directory to a native transformers Qwen3 checkpoint or to GGUF (llama.cpp).

    minimind-export --to qwen3 --model_name_or_path runs/sft --output_dir runs/sft-qwen3
    minimind-export --to gguf  --model_name_or_path runs/sft --output_dir runs/gguf --outtype f16

    The tokenizer is taken from the model directory unless --tokenizer_name_or_path says otherwise.
    Settings the target cannot reproduce exactly (e.g. qk_norm=False) stop the export with a ValueError.
    """
    from pathlib import Path

    from minimind.export import GGUF_OUTTYPES, export_gguf, export_qwen3

    parser = _parser(export.__doc__)
    parser.add_argument(
        "--to",
        required=True,
        choices=("qwen3", "gguf"),
        help="qwen3: transformers Qwen3ForCausalLM / Qwen3MoeForCausalLM; gguf: llama.cpp file",
    )
    parser.add_argument("--model_name_or_path", required=True, help="MiniMind directory (save_pretrained)")
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--tokenizer_name_or_path", default=None)
    parser.add_argument("--outtype", choices=GGUF_OUTTYPES, default="f16", help="gguf only: tensor precision")
    parser.add_argument(
        "--outfile",
        default=None,
        help="gguf only: file name inside --output_dir (default: <model dir name>-<outtype>.gguf)",
    )
    args = parser.parse_args(argv)
    if args.to == "qwen3":
        written = export_qwen3(args.model_name_or_path, args.output_dir, args.tokenizer_name_or_path)
    else:
        name = args.outfile or f"{Path(args.model_name_or_path).resolve().name}-{args.outtype}.gguf"
        written = export_gguf(
            args.model_name_or_path, Path(args.output_dir) / name, args.tokenizer_name_or_path, outtype=args.outtype
        )
    print(f"wrote {written}")
    return written


@command
def push_to_hub(argv=None):
    """Publish a MiniMind model directory on the Hugging Face Hub with a generated model card.

    minimind-push --model_name_or_path runs/sft --repo_id you/minimind-sft
    minimind-push --model_name_or_path runs/sft --repo_id you/minimind-sft --tokenizer_name_or_path tokenizer --private

    minimind-push --model_name_or_path runs/sft --repo_id you/minimind-sft --dry_run   # list, upload nothing

    Log in first (`hf auth login`) or pass --token / set HF_TOKEN.
    """
    from minimind.hub import DEFAULT_LICENSE, describe_plan, push_model_dir, upload_plan

    parser = _parser(push_to_hub.__doc__)
    parser.add_argument("--model_name_or_path", required=True, help="directory written by save_pretrained")
    parser.add_argument("--repo_id", required=True, help="USER/NAME on the Hub")
    parser.add_argument(
        "--tokenizer_name_or_path",
        default=None,
        help="tokenizer directory, if the model directory has no tokenizer files",
    )
    parser.add_argument("--private", action="store_true", help="create the repository as private")
    parser.add_argument("--token", default=None, help="Hub token (default: the logged-in one)")
    parser.add_argument("--license", default=DEFAULT_LICENSE, help="license id for the model card")
    parser.add_argument("--commit_message", default="Upload MiniMind model")
    parser.add_argument("--dry_run", action="store_true", help="list the files and the model card, upload nothing")
    args = parser.parse_args(argv)
    if args.dry_run:
        plan = upload_plan(args.model_name_or_path, args.repo_id, args.tokenizer_name_or_path, license=args.license)
        print("\n".join([f"would upload to {args.repo_id} (nothing sent):", *describe_plan(plan)]))
        return plan
    commit = push_model_dir(
        args.model_name_or_path,
        args.repo_id,
        tokenizer_dir=args.tokenizer_name_or_path,
        private=args.private or None,
        token=args.token,
        license=args.license,
        commit_message=args.commit_message,
    )
    print(f"published {args.model_name_or_path} to {args.repo_id}: {getattr(commit, 'commit_url', commit)}")
    return commit


@command
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

    parser = _parser(evaluate.__doc__)
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


_CONVERT_INT_FLAGS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "max_position_embeddings",
    "num_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
)
_CONVERT_FLOAT_FLAGS = ("rope_theta", "rms_norm_eps")
_CONVERT_BOOL_FLAGS = ("use_moe", "qk_norm", "tie_word_embeddings", "norm_topk_prob", "inference_rope_scaling")


@command
def convert(argv=None):
    """Import an upstream MiniMind checkpoint (a .pth, or a transformers-format directory) into a MiniMind
    Hugging Face directory.

    minimind-convert --pth full_sft_768.pth --output_dir runs/upstream-768 \\
        --hidden_size 768 --num_hidden_layers 8 --tokenizer_name_or_path tokenizer
    minimind-convert --pth full_sft_640_moe.pth --config_json upstream_config.json --output_dir runs/upstream-moe
    minimind-convert --from upstream-hf --model_name_or_path MiniMind2 --output_dir runs/minimind2

    With --from upstream-hf the directory's config.json and tensors give the settings (the flags still override)
    and its tokenizer is copied along unless --tokenizer_name_or_path names another.

    Settings come from --config_json (upstream names such as n_routed_experts are accepted), then the flags
    below override them; anything unset takes MiniMindConfig's default. Keys that do not match are listed by
    name. The result loads with AutoModelForCausalLM.from_pretrained(output_dir, trust_remote_code=True).
    """
    from minimind.convert import (
        config_from_upstream_settings,
        convert_upstream_checkpoint,
        convert_upstream_directory,
        read_settings_json,
    )

    parser = _parser(convert.__doc__)
    # --model_name_or_path like every other command: here the model to import is the upstream .pth file.
    parser.add_argument(
        "--pth",
        "--model_name_or_path",
        dest="pth",
        required=True,
        help="upstream state dict saved with torch.save, or with --from upstream-hf the upstream "
        "directory (the model to import)",
    )
    parser.add_argument(
        "--from",
        dest="source",
        choices=("pth", "upstream-hf"),
        default="pth",
        help="upstream-hf: a directory upstream's save_pretrained wrote (config.json, safetensors)",
    )
    parser.add_argument("--output_dir", required=True, help="MiniMind model directory to write")
    parser.add_argument("--config_json", default=None, help="JSON object of upstream/MiniMind config settings")
    parser.add_argument("--tokenizer_name_or_path", default=None, help="tokenizer directory to copy along")
    for name in _CONVERT_INT_FLAGS:
        parser.add_argument(f"--{name}", type=int, default=None)
    for name in _CONVERT_FLOAT_FLAGS:
        parser.add_argument(f"--{name}", type=float, default=None)
    for name in _CONVERT_BOOL_FLAGS:  # --use_moe / --no_use_moe; unset = from the JSON or MiniMindConfig's default
        switch = parser.add_mutually_exclusive_group()
        switch.add_argument(f"--{name}", dest=name, action="store_true", default=None)
        switch.add_argument(f"--no_{name}", dest=name, action="store_false", default=None)
    args = parser.parse_args(argv)
    settings = read_settings_json(args.config_json) if args.config_json else {}
    settings.update(
        {
            name: getattr(args, name)
            for name in _CONVERT_INT_FLAGS + _CONVERT_FLOAT_FLAGS + _CONVERT_BOOL_FLAGS
            if getattr(args, name) is not None
        }
    )
    if args.source == "upstream-hf":
        model = convert_upstream_directory(args.pth, args.output_dir, args.tokenizer_name_or_path, settings)
    else:
        model = convert_upstream_checkpoint(
            args.pth, config_from_upstream_settings(settings), args.output_dir, args.tokenizer_name_or_path
        )
    print(f"wrote {args.output_dir}: {sum(p.numel() for p in model.parameters()):,} parameters, dtype {model.dtype}")
    return model


# --------------------------------------------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------------------------------------------


@command
def train_tokenizer(argv=None):
    """Train MiniMind's byte-level BPE tokenizer and save it for transformers.

    minimind-train-tokenizer                       # bundled data -> tokenizer/
    minimind-train-tokenizer --files my.jsonl --vocab_size 6400 --output_dir out/

    Input files may be MiniMind JSONL (pretrain / SFT / DPO) or plain text.
    """
    import logging
    from pathlib import Path

    from minimind.tokenizer import DEFAULT_VOCAB_SIZE
    from minimind.tokenizer import train_tokenizer as train
    from minimind.training import BUNDLED_DATA, BUNDLED_TOKENIZER

    parser = _parser(train_tokenizer.__doc__)
    parser.add_argument(
        "--files",
        nargs="+",
        type=Path,
        default=[Path(path) for path in BUNDLED_DATA.values()],
        help="training text: .jsonl corpora or plain text files (default: bundled data/)",
    )
    # Underscored like every other command's flags; the dashed spellings stay as aliases.
    parser.add_argument("--vocab_size", "--vocab-size", type=int, default=DEFAULT_VOCAB_SIZE)
    parser.add_argument("--min_frequency", "--min-frequency", type=int, default=2)
    parser.add_argument("--output_dir", "--output-dir", type=Path, default=BUNDLED_TOKENIZER)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
    tokenizer = train(
        args.files, vocab_size=args.vocab_size, output_dir=args.output_dir, min_frequency=args.min_frequency
    )
    print(f"saved tokenizer with {len(tokenizer)} tokens to {args.output_dir}")
    return tokenizer
