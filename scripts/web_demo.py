"""Chat with a MiniMind checkpoint in the browser: the `minimind-web` command, run from a checkout.

python scripts/web_demo.py --model_name_or_path runs/sft
"""

from minimind.cli import web as main

if __name__ == "__main__":
    main()
