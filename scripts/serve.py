"""Serve a MiniMind checkpoint over an OpenAI-compatible HTTP API.

    python scripts/serve.py --model_name_or_path runs/sft --port 8000

Then point any OpenAI client at http://127.0.0.1:8000/v1 (the API key is not checked).
"""

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout

from minimind.chat import DTYPES, load_model_and_tokenizer  # noqa: E402
from minimind.serving import DEFAULT_MAX_TOKENS, Generator, create_app, serve  # noqa: E402


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model_name_or_path", required=True, help="a model directory (or Hub id) with tokenizer")
    parser.add_argument("--served_model_name", default=None,
                        help="the `model` name clients must send (default: the directory's name)")
    parser.add_argument("--host", default="127.0.0.1", help="use 0.0.0.0 to accept other machines (no auth!)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--max_context", type=int, default=None,
                        help="longest prompt + completion in tokens (default: the model's max_position_embeddings)")
    parser.add_argument("--default_max_tokens", type=int, default=DEFAULT_MAX_TOKENS,
                        help="completion length when a request sets no max_tokens")
    parser.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    model, tokenizer = load_model_and_tokenizer(args.model_name_or_path, args.device, args.dtype)
    model_id = args.served_model_name or os.path.basename(os.path.normpath(args.model_name_or_path))
    generator = Generator(model, tokenizer, model_id, max_context=args.max_context,
                          default_max_tokens=args.default_max_tokens)
    serve(create_app(generator), host=args.host, port=args.port)


if __name__ == "__main__":
    main()
