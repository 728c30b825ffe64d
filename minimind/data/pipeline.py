"""The streaming, parallel pass over a JSONL file: read it in chunks of whole lines, have `num_proc` processes
check and tokenise the chunks (each an `encoder(first_line_number, raw_lines)` call), and hand the results back in
file order. At most two chunks per process are in flight, so memory does not grow with the file; a bad line's
error reaches the caller as soon as its chunk and every chunk before it are done.
"""

from __future__ import annotations

import contextlib
import logging
import math
import multiprocessing
import os
import sys
import time
from collections import deque
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path

from minimind.errors import InputError

logger = logging.getLogger(__name__)

CHUNK_BYTES = 1 << 20  # lines per task: about 1 MB of text


def available_cores() -> int:
    """The cores this process may run on (its CPU affinity, which containers and taskset narrow)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        return os.cpu_count() or 1


def read_chunks(path: Path, chunk_bytes: int) -> Iterator[tuple[int, list[bytes]]]:
    """(1-based number of the chunk's first line, its raw lines), about ``chunk_bytes`` each, whole lines only."""
    lineno = 1
    with open(path, "rb") as f:
        while lines := f.readlines(chunk_bytes):
            yield lineno, lines
            lineno += len(lines)


_ENCODER = None


def _start_worker(encoder) -> None:
    global _ENCODER
    _ENCODER = encoder


def _encode(chunk):
    return _ENCODER(*chunk)


@contextlib.contextmanager
def _single_threaded_tokenizers():
    """Each worker process tokenises on one thread (the processes are the parallelism). Set while forking, the
    variable also keeps the tokenizers library from warning that the parent already used its thread pool."""
    previous = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        yield
    finally:
        if previous is None:
            del os.environ["TOKENIZERS_PARALLELISM"]
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = previous


class Progress:
    """Where the minimind logger shows INFO (as in the commands): a progress bar in MB of the file with MB/s on a
    terminal, else (a log file) a line every `LOG_EVERY` seconds. And the throughput for the summary line."""

    LOG_EVERY = 30.0

    def __init__(self, total_bytes: int, desc: str):
        from tqdm.auto import tqdm

        self.start = self.logged = time.perf_counter()
        self.done, self.total, self.desc = 0, total_bytes, desc
        self.show = logger.isEnabledFor(logging.INFO)
        terminal = self.show and hasattr(sys.stderr, "isatty") and sys.stderr.isatty()
        self.bar = tqdm(total=total_bytes, unit="B", unit_scale=True, desc=desc, mininterval=1.0, disable=not terminal)

    def update(self, nbytes: int) -> None:
        self.done += nbytes
        self.bar.update(nbytes)
        now = time.perf_counter()
        if self.show and self.bar.disable and now - self.logged >= self.LOG_EVERY:
            self.logged = now
            logger.info("%s: %.0f of %.0f MB, %.2f MB/s", self.desc, self.done / 1e6, self.total / 1e6, self.mb_per_s)

    def close(self) -> None:
        self.bar.close()

    @property
    def seconds(self) -> float:
        return time.perf_counter() - self.start

    @property
    def mb_per_s(self) -> float:
        return self.done / 1e6 / max(self.seconds, 1e-9)


def map_chunks(encoder, path: Path, num_proc: int, progress: Progress, chunk_bytes: int = CHUNK_BYTES):
    """``encoder``'s result for every chunk of ``path``, in file order, computed by up to ``num_proc`` processes
    (none for one: then in this process). Close the generator (or exhaust it) to stop the workers."""
    n_chunks = max(1, math.ceil(path.stat().st_size / chunk_bytes))
    processes = max(1, min(num_proc, n_chunks))
    if processes == 1:
        for chunk in read_chunks(path, chunk_bytes):
            result = encoder(*chunk)
            progress.update(result.nbytes)
            yield result
        return
    methods = multiprocessing.get_all_start_methods()
    context = multiprocessing.get_context("fork" if "fork" in methods else "spawn")
    with _single_threaded_tokenizers():
        # Not multiprocessing.Pool: a worker killed (by the out-of-memory killer, say) leaves Pool's results waiting
        # forever, where this executor fails every pending result at once.
        pool = ProcessPoolExecutor(processes, mp_context=context, initializer=_start_worker, initargs=(encoder,))
    try:
        pending = deque()
        try:
            for chunk in read_chunks(path, chunk_bytes):
                pending.append(pool.submit(_encode, chunk))
                if len(pending) >= 2 * processes:
                    result = pending.popleft().result()
                    progress.update(result.nbytes)
                    yield result
            while pending:
                result = pending.popleft().result()
                progress.update(result.nbytes)
                yield result
        except BrokenProcessPool as error:
            raise InputError(
                f"a process tokenising {path} ended without finishing its chunk (killed by the system, as when it "
                f"runs out of memory); the pass stops and nothing of it is kept. Fix: free memory or pass a smaller "
                f"--num_proc (this pass used {processes})"
            ) from error
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
