"""Chat with a MiniMind checkpoint in the terminal: the `minimind-chat` command, run from a checkout.

python scripts/chat.py --model_name_or_path runs/sft --temperature 0.7
"""

from minimind.cli import chat as main

if __name__ == "__main__":
    main()
