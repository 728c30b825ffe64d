"""Every MiniMind command line, one function per command: the `minimind-*` console scripts and `scripts/*.py`.

Argument parsing for all commands lives here, apart from the modules that do the work, so each of those stays a
library (no argparse, nothing read from sys.argv) and every command is reachable the same two ways:
`minimind-pretrain ...` after `pip install -e .`, or `python scripts/pretrain.py ...` in a checkout. Each function
takes `argv` (default: the process's arguments) and, given one, returns what it made, so tests call them
in-process. Work modules are imported inside the functions: `minimind-chat --help` needs neither TRL nor fastapi.
"""

from minimind.cli.base import command
from minimind.cli.data import prepare
from minimind.cli.evaluate import evaluate
from minimind.cli.export import convert, export, push_to_hub
from minimind.cli.generate import COMPILE_NOTICE, chat, serve, web
from minimind.cli.tokenizer import train_tokenizer
from minimind.cli.train import demo, distill, dpo, grpo, lora, pretrain, reward, sft

__all__ = [
    "COMPILE_NOTICE",
    "chat",
    "command",
    "convert",
    "demo",
    "distill",
    "dpo",
    "evaluate",
    "export",
    "grpo",
    "lora",
    "prepare",
    "pretrain",
    "push_to_hub",
    "reward",
    "serve",
    "sft",
    "train_tokenizer",
    "web",
]
