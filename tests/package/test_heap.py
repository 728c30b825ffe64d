"""minimind/heap.py: freed memory kept in glibc's heap for the next forward pass, set by every command run as a
program, left alone where the user set glibc's thresholds or the caller is Python code."""

import os
import platform
import subprocess
import sys

import pytest

from minimind.heap import USER_SETTINGS, trim_heap

pytestmark = pytest.mark.skipif(
    platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="sets glibc's heap thresholds"
)

# A layer's activations: eight blocks of just under 2 MiB alive at once, written, then freed, five times over, after
# a first 2 MiB block that glibc mapped on its own and returned (which sets its dynamic thresholds to about 2 MiB and
# 4 MiB). Printed: the page faults of each round (Linux counts one for every page first written). C's malloc, not
# tensors: a tensor's own small objects could land above the blocks in the heap and change where they are freed to.
ROUNDS = """
import ctypes, resource, sys
from minimind.heap import keep_heap
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes, libc.free.argtypes = ctypes.c_void_p, [ctypes.c_size_t], [ctypes.c_void_p]
print(keep_heap() if sys.argv[1] == "kept" else False)
libc.free(libc.malloc(2 << 20))
size = (2 << 20) - 4096
for _ in range(5):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    blocks = [libc.malloc(size) for _ in range(8)]
    for block in blocks:
        ctypes.memset(block, 1, size)
    for block in reversed(blocks):
        libc.free(block)
    print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""
PAGES_WRITTEN = 8 * 511


def python(code, *args, env=None):
    """Runs `code` in a fresh interpreter (the heap's thresholds are the process's), its printed lines back."""
    env = {**{k: v for k, v in os.environ.items() if k not in USER_SETTINGS}, **(env or {})}
    done = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, env=env, check=True)
    return done.stdout.split()


def test_a_kept_heap_reuses_freed_activations_without_page_faults():
    # the first round faults in what it writes, less what the process had touched there before: not counted
    kept, _, *later = python(ROUNDS, "kept")
    assert kept == "True"
    assert later == ["0"] * 4  # every later round writes into the pages the first one faulted in
    default, _, *later = python(ROUNDS, "default")
    assert default == "False"
    # glibc's own thresholds return the 16 MiB top of the heap at every round's end, and every round faults again
    assert all(PAGES_WRITTEN - 64 <= int(n) <= PAGES_WRITTEN + 64 for n in later)


COMMAND = """
import sys
from minimind.cli.base import command
from minimind.heap import heap_kept
main = command(keeps_heap=sys.argv[2] == "keeps")(lambda argv: print(heap_kept()))
main() if sys.argv[1] == "program" else main([])
"""


def test_an_inference_command_run_as_a_program_keeps_the_heap_and_nothing_else_does():
    assert python(COMMAND, "program", "keeps") == ["True"]
    assert python(COMMAND, "call", "keeps") == ["False"]
    assert python(COMMAND, "program", "leaves") == ["False"]  # the training commands
    for name in USER_SETTINGS:  # the user's own thresholds stay
        assert python(COMMAND, "program", "keeps", env={name: str(64 << 20)}) == ["False"]


def test_the_inference_commands_keep_the_heap_and_the_training_commands_do_not():
    import minimind.cli as cli

    commands = ["chat", "serve", "web", "evaluate", "pretrain", "sft", "lora", "dpo", "reward", "distill", "grpo"]
    commands += ["demo", "prepare", "export", "push_to_hub", "convert", "train_tokenizer"]
    keeping = {name for name in commands if getattr(cli, name).keeps_heap}
    assert keeping == {"chat", "serve", "web", "evaluate"}


def test_trim_heap_returns_nothing_and_raises_nothing():
    assert trim_heap() is None
