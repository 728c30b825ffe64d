"""glibc's heap in a process that runs a model: freed memory kept for the next forward (`keep_heap`, which the
inference commands set when they start) and handed back where a decoder wants its resident memory small
(`trim_heap`).

A forward pass allocates and frees the same large activations in every layer. glibc returns a freed block to the
system when it was mapped on its own (above its mmap threshold) or when the free top of the heap passes its trim
threshold, and the next allocation of that size is then faulted in again page by page, each page zeroed by the
kernel, at every forward pass. PyTorch's CPU tuning guide points to jemalloc or
tcmalloc for the same reason; glibc's own thresholds give the reuse without another library. Elsewhere (not glibc)
these do nothing."""

from __future__ import annotations

import ctypes
import os

# mallopt's parameters (malloc.h)
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
# Blocks above this still get a mapping of their own, returned when freed (weights, KV caches): glibc's largest
# accepted value, as far as its dynamic threshold goes by itself.
MMAP_THRESHOLD = 32 << 20
# The free memory the heap's top keeps before glibc returns it: more than a forward pass's activations over a long
# prompt of the models this project trains.
TRIM_THRESHOLD = 256 << 20
# Set by the user, glibc reads them at start-up; `keep_heap` leaves them as they are.
USER_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")
_kept = False


def _libc_function(name):
    try:
        return getattr(ctypes.CDLL(None), name)
    except (OSError, AttributeError, TypeError):  # not glibc (Windows has no process-wide CDLL(None))
        return None


def keep_heap() -> bool:
    """Keeps freed memory in the heap for reuse (glibc's mmap and trim thresholds fixed at MMAP_THRESHOLD and
    TRIM_THRESHOLD): True where set, False where the user set either threshold or the C library is not glibc."""
    global _kept
    mallopt = _libc_function("mallopt")
    if mallopt is None or any(name in os.environ for name in USER_SETTINGS):
        return False
    _kept = bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    return _kept


def heap_kept() -> bool:
    """Whether `keep_heap` has set this process's thresholds."""
    return _kept


def trim_heap() -> None:
    """Hands the free memory inside glibc's heap back to the system (`malloc_trim`): blocks freed below others stay
    resident otherwise, whatever the trim threshold."""
    malloc_trim = _libc_function("malloc_trim")
    if malloc_trim is not None:
        malloc_trim(0)
