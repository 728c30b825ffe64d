"""Using a model: chat in the terminal, the OpenAI-compatible server, the web page."""

from __future__ import annotations

import argparse
import os
import sys

from minimind.cli.base import command, make_parser


def _add_model_flags(parser):
    parser.add_argument("--model_name_or_path", required=True, help="a model directory (or Hub id) with tokenizer")
    parser.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    _add_dtype_flag(parser)


def _add_dtype_flag(parser):
    from minimind.chat import DTYPE_CHOICES

    parser.add_argument(
        "--dtype",
        choices=DTYPE_CHOICES,
        default="auto",
        help="the weights' precision; auto (default): the fastest for this device, bfloat16 on a CPU (also where "
        "it has no bfloat16 arithmetic: prompts are then multiplied in float32), and the command says which; "
        "float32: the checkpoint's own numbers",
    )


COMPILE_NOTICE = (
    "compiling the decode step for this model in the background (about a minute on a CPU, once: later starts load "
    "it from the compile cache in about a second); a reply sent before it is done waits for it; --no-compile "
    "answers at once, decoding more slowly"
)


def _announce(line):
    print(line, file=sys.stderr, flush=True)


def _compiled_decoder(model, args, announce=None):
    """The chat command's decoder, its step loaded from the compile cache or compiled in the background while the
    user types; says which once."""
    from minimind.decode import CACHE_BUCKET, CompiledDecoder

    decoder = CompiledDecoder(model)
    decoder.keep_steps(False if args.compile_cache_dir == "" else args.compile_cache_dir, announce)
    if decoder.is_packaged(1, CACHE_BUCKET):
        _announce(f"reusing the decode step compiled for this model before ({decoder.packages.directory})")
    else:
        _announce(COMPILE_NOTICE)
    decoder.prepare(1, CACHE_BUCKET, background=True)
    return decoder


def _add_decode_flags(parser):
    parser.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="decode with the one-token step compiled against a static cache (default; compiled once per model, "
        "about a minute on a CPU, then loaded from --compile_cache_dir); --no-compile uses model.generate",
    )
    parser.add_argument(
        "--compile_cache_dir",
        default=None,
        help="where compiled decode steps are kept between starts (default: $MINIMIND_CACHE/compiled, else "
        "~/.cache/minimind/compiled); '' keeps none",
    )
    parser.add_argument(
        "--int8",
        action="store_true",
        help="weight-only int8 decoder layers and LM head (torchao; pip install 'minimind[int8]'), the rest "
        "in bfloat16 (float32 on a CPU without bfloat16 arithmetic) unless --dtype says a 16-bit type: the "
        "fastest CPU decode",
    )


@command(keeps_heap=True)
def chat(argv=None):
    """Chat with a MiniMind checkpoint in the terminal, the reply streamed token by token.

    minimind-chat --model_name_or_path runs/sft --temperature 0.7 --top_p 0.9

    Type a message and press Enter. /reset starts a new conversation, /exit (or Ctrl-D) quits.
    """
    from minimind import chat as engine

    parser = make_parser(chat.__doc__)
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
    model, tokenizer = engine.load_model_and_tokenizer(
        args.model_name_or_path, args.device, args.dtype, args.int8, announce=_announce
    )
    decoder = None
    if args.compile:
        decoder = _compiled_decoder(model, args)
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
    if decoder is not None:
        decoder.wait_prepared()  # a chat left before its first reply still keeps the step for the next start


@command(keeps_heap=True)
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
    parser = make_parser(serve.__doc__)
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
        "--stream_interval",
        type=float,
        default=serving.Generator.STREAM_INTERVAL,
        help="seconds a streamed reply's text may wait to go out with the tokens after it (its first and last "
        "tokens go at once); 0 sends every token as it is made",
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
    parser.add_argument(
        "--compile_cache_dir",
        default=None,
        help="--engine compiled: where its compiled steps are kept between starts (default: "
        "$MINIMIND_CACHE/compiled, else ~/.cache/minimind/compiled); '' keeps none",
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
    model, tokenizer = load_model_and_tokenizer(args.model_name_or_path, args.device, args.dtype, announce=_announce)
    model_id = args.served_model_name or os.path.basename(os.path.normpath(args.model_name_or_path))
    try:
        generator = serving.Generator(
            model,
            tokenizer,
            model_id,
            limits=limits,
            engine=args.engine,
            compile=args.compile,
            stream_interval=args.stream_interval,
        )
    except ValueError as error:
        parser.error(str(error))
    if args.engine == "compiled" and args.compile:
        decoder = generator.engine.decoder
        decoder.keep_steps(False if args.compile_cache_dir == "" else args.compile_cache_dir, _announce)
        print(f"preparing the decode step for batches of {generator.engine.batch_sizes} rows ...", flush=True)
        print(f"ready in {generator.engine.warm_up():.0f} s", flush=True)
    if not args.api_key and not serving.is_loopback_host(args.host):
        address = f"[{args.host}]" if ":" in args.host else args.host
        print(
            f"warning: serving on {address}:{args.port} without --api_key: anyone who can reach this port can use "
            "the model; pass --api_key (or set MINIMIND_API_KEY)",
            file=sys.stderr,
            flush=True,
        )
    serving.serve(serving.create_app(generator, api_key=args.api_key or None), host=args.host, port=args.port)


@command(keeps_heap=True)
def web(argv=None):
    """Chat with a MiniMind checkpoint in the browser (Gradio, `pip install "minimind[web]"`): streamed replies,
    the reasoning of a <think> reply folded, sampling controls, a system prompt and a choice of model on the page.

    minimind-web --model_name_or_path runs/demo/sft          # then open http://127.0.0.1:7860
    minimind-web --model_name_or_path runs/a --model_name_or_path runs/b --host 0.0.0.0 --auth me:secret

    Visitors choose among the models named here; the page never loads a path typed into it.
    """
    from minimind import web as page
    from minimind.chat import CHAT_TEMPERATURE, CHAT_TOP_P, DEFAULT_MAX_NEW_TOKENS, SamplingParams
    from minimind.serving import is_loopback_host

    parser = make_parser(web.__doc__)
    parser.add_argument(
        "--model_name_or_path",
        action="append",
        required=True,
        help="a MiniMind directory (or Hub id) with tokenizer; repeat it to offer several models",
    )
    parser.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    _add_dtype_flag(parser)
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
        compile_cache_dir=False if args.compile_cache_dir == "" else args.compile_cache_dir,
    )
    if args.compile:
        print(COMPILE_NOTICE, file=sys.stderr, flush=True)
    page.launch(app, host=args.host, port=args.port, auth=(user, password) if args.auth else None)
    return app
