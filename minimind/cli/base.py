"""What every command shares: `command` (bad input ends it in one line, exit 2; the inference commands keep the
heap for reuse) and the argument parser."""

from __future__ import annotations

import argparse
import functools
import sys


def command(run=None, *, keeps_heap=False):
    """A command line: bad input (`minimind.errors.InputError`: a path, a data line, a checkpoint) ends it with the
    message alone and exit code 2, no traceback. Called with
    `argv` it returns what the command made; run as a program (argv=None) it returns None, because console
    scripts hand the return value to sys.exit, where anything else becomes an error exit.

    `@command(keeps_heap=True)`: run as a program, the command keeps freed memory in its heap for the next forward
    pass (`minimind.heap.keep_heap`); the inference commands do. The training commands leave glibc as it is: with
    the heap kept, two-process runs under torchrun sometimes hung or aborted at their exit (docs/performance.md).
    Called from Python, the caller's process is left as it is."""
    if run is None:
        return functools.partial(command, keeps_heap=keeps_heap)

    @functools.wraps(run)
    def main(argv=None):
        from minimind.errors import InputError
        from minimind.heap import keep_heap

        if argv is None and keeps_heap:
            keep_heap()
        try:
            result = run(argv)
        except InputError as error:
            print(f"error: {error}", file=sys.stderr)
            raise SystemExit(2) from None
        return result if argv is not None else None

    main.keeps_heap = keeps_heap
    return main


def make_parser(doc):
    return argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
