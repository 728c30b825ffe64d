"""Publish a MiniMind model directory on the Hugging Face Hub: the `minimind-push` command, run from a checkout.

python scripts/push_to_hub.py --model_name_or_path runs/sft --repo_id you/minimind-sft
"""

from minimind.cli import push_to_hub as main

if __name__ == "__main__":
    main()
