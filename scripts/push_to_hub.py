#!/usr/bin/env python3
"""Publish a MiniMind model directory on the Hugging Face Hub with a generated model card.

    python scripts/push_to_hub.py --model_name_or_path runs/sft --repo_id you/minimind-sft
    python scripts/push_to_hub.py --model_name_or_path runs/sft --repo_id you/minimind-sft \
        --tokenizer_name_or_path tokenizer --private

Log in first (`hf auth login`) or pass --token / set HF_TOKEN.
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from minimind.hub import DEFAULT_LICENSE, push_model_dir  # noqa: E402


def main(argv=None):
    parser = argparse.ArgumentParser(description="Publish a MiniMind model directory on the Hub.")
    parser.add_argument("--model_name_or_path", required=True, help="directory written by save_pretrained")
    parser.add_argument("--repo_id", required=True, help="USER/NAME on the Hub")
    parser.add_argument("--tokenizer_name_or_path", default=None,
                        help="tokenizer directory, if the model directory has no tokenizer files")
    parser.add_argument("--private", action="store_true", help="create the repository as private")
    parser.add_argument("--token", default=None, help="Hub token (default: the logged-in one)")
    parser.add_argument("--license", default=DEFAULT_LICENSE, help="license id for the model card")
    parser.add_argument("--commit_message", default="Upload MiniMind model")
    args = parser.parse_args(argv)

    commit = push_model_dir(args.model_name_or_path, args.repo_id, tokenizer_dir=args.tokenizer_name_or_path,
                            private=args.private or None, token=args.token, license=args.license,
                            commit_message=args.commit_message)
    print(f"published {args.model_name_or_path} to {args.repo_id}: {getattr(commit, 'commit_url', commit)}")
    return commit


if __name__ == "__main__":
    main()
