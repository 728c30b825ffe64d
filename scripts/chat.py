"""Chat with a MiniMind checkpoint in the terminal, the reply streamed token by token.

    python scripts/chat.py --model_name_or_path runs/sft --temperature 0.7 --top_p 0.9

Type a message and press Enter. /reset starts a new conversation, /exit (or Ctrl-D) quits.
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout

from minimind.chat import DTYPES, SamplingParams, chat_loop, load_model_and_tokenizer  # noqa: E402


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model_name_or_path", required=True, help="a model directory (or Hub id) with tokenizer")
    parser.add_argument("--system_prompt", default=None)
    parser.add_argument("--max_new_tokens", type=int, default=512)
    parser.add_argument("--do_sample", action=argparse.BooleanOptionalAction, default=True,
                        help="sample (default) or, with --no-do_sample, decode greedily")
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--top_p", type=float, default=0.9)
    parser.add_argument("--top_k", type=int, default=0, help="0 disables top-k filtering")
    parser.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    model, tokenizer = load_model_and_tokenizer(args.model_name_or_path, args.device, args.dtype)
    params = SamplingParams(max_new_tokens=args.max_new_tokens, do_sample=args.do_sample,
                            temperature=args.temperature, top_p=args.top_p, top_k=args.top_k)
    chat_loop(model, tokenizer, params, system_prompt=args.system_prompt)


if __name__ == "__main__":
    main()
