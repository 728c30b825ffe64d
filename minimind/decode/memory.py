"""Keeping the decoders' resident memory to what they use: zeroed tensors whose memory becomes resident only where
they are written (`lazy_zeros`: a static KV cache is allocated for a whole `CACHE_BUCKET` of positions, and a reply
that writes a few hundred of them should not hold the rest). Freed memory goes back through `minimind.heap.trim_heap`.

On Linux the tensor lies over an anonymous private mapping of its own: the kernel maps a zeroed page in at the first
write to it, and zeroing the tensor again hands its pages back (`madvise(MADV_DONTNEED)`) instead of writing every
byte. Pages that are only read map the kernel's one shared zero page, no memory of their own. Elsewhere, and on
other devices, these are plain `torch.zeros` and `zero_()`.

The decoders' memory by the pages it lies in, too: weights a step reads at every token lie in huge pages, read into
memory advised for them (`huge_page_bytes`) or moved there once written (`into_huge_pages`)."""

from __future__ import annotations

import contextlib
import ctypes
import functools
import math
import mmap
import sys

import torch

MADV_DONTNEED = 4
MADV_HUGEPAGE = 14
MADV_PAGEOUT = 21
MADV_COLLAPSE = 25
HUGE_PAGE = 2 << 20  # bytes: x86-64's and arm64's (4 KiB pages) transparent huge page
_MAPPED = sys.platform.startswith("linux")


def lazy_zeros(shape, dtype: torch.dtype, device=None) -> torch.Tensor:
    nbytes = math.prod(shape) * dtype.itemsize
    if not _MAPPED or nbytes == 0 or torch.device(device or "cpu").type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    # private: a shared mapping would keep its pages' contents when they are handed back. The tensor keeps the
    # mapping alive (it holds the buffer), and the mapping goes with the tensor's last view.
    pages = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(pages, dtype=dtype).view(shape)


def huge_page_bytes(nbytes: int, offset: int = 0) -> torch.Tensor:
    """[nbytes] uint8 on the CPU for weights a step reads through at every token, starting `offset` bytes past the
    start of a huge page: memory the kernel is asked to back with huge pages (`madvise(MADV_HUGEPAGE)`, which
    Linux's default transparent-huge-page mode, "madvise", waits for). In small pages every 4 KiB read costs an
    address translation of its own. Where huge pages are off, the same memory in small pages; off Linux,
    `torch.empty`. The tensor keeps its mapping alive; at most one huge page past its end becomes resident with it."""
    if not _MAPPED or not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.empty(nbytes + offset, dtype=torch.uint8)[offset:]
    # the kernel places a mapping on a page, not on a huge page: map one huge page more and start on one
    size = -(-(nbytes + offset) // HUGE_PAGE) * HUGE_PAGE + HUGE_PAGE
    pages = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    with contextlib.suppress(OSError):  # a kernel without transparent huge pages
        pages.madvise(mmap.MADV_HUGEPAGE)
    whole = torch.frombuffer(pages, dtype=torch.uint8)
    start = -whole.data_ptr() % HUGE_PAGE + offset
    return whole[start : start + nbytes]


def into_huge_pages(start: int, end: int) -> int:
    """Moves memory already written in [start, end) into huge pages, each whole huge page inside the range that is
    resident throughout (`madvise(MADV_COLLAPSE)`, Linux 6.1 and later): collapsing a partly written huge page
    would make the rest of it resident too. Returns the bytes collapsed (0 where the kernel refused or lacks it)."""
    first, last = -(-start // HUGE_PAGE) * HUGE_PAGE, end // HUGE_PAGE * HUGE_PAGE
    if last <= first or not madvise(first, last - first, MADV_HUGEPAGE):
        return 0
    pages = [page for page in range(first, last, HUGE_PAGE) if all(resident_pages(page, HUGE_PAGE) or [False])]
    return HUGE_PAGE * sum(madvise(page, HUGE_PAGE, MADV_COLLAPSE) for page in pages)


def resident_pages(start: int, length: int) -> list[bool] | None:
    """For each page of [start, start + length) (start on a page), whether it is resident (the kernel's `mincore`);
    None where the kernel refused or the call is missing."""
    call = _libc_call("mincore", ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)
    vector = (ctypes.c_ubyte * -(-length // mmap.PAGESIZE))()
    if call is None or call(start, length, vector) != 0:
        return None
    return [bool(byte & 1) for byte in vector]


def zero_again(tensor: torch.Tensor) -> None:
    """Zeroes a tensor made by `lazy_zeros` (its whole storage), its pages no longer resident; any other device's
    tensor: `zero_()`. Only the pages that lie wholly inside the storage are handed back: the kernel drops every page
    the range touches, and on a page shared with other memory (a small tensor from the heap) that would zero its
    neighbours too. The bytes outside those pages are written."""
    if not _MAPPED or tensor.device.type != "cpu" or tensor.numel() == 0:
        tensor.zero_()
        return
    storage = tensor.untyped_storage()
    start, end = storage.data_ptr(), storage.data_ptr() + storage.nbytes()
    first, last = -(-start // mmap.PAGESIZE) * mmap.PAGESIZE, end // mmap.PAGESIZE * mmap.PAGESIZE
    if last <= first or not madvise(first, last - first, MADV_DONTNEED):
        tensor.zero_()
        return
    data = torch.empty(0, dtype=torch.uint8).set_(storage)  # [nbytes], the storage's bytes
    data[: first - start].zero_()
    data[last - start :].zero_()


def madvise(start: int, length: int, advice: int) -> bool:
    """The kernel's `madvise` over [start, start + length) (start on a page); False where it refused or is missing."""
    call = _libc_call("madvise", ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    return call is not None and call(start, length, advice) == 0


@functools.cache
def _libc_call(name: str, *argtypes):
    """The C library's function `name` taking `argtypes`, or None where there is no such library or function."""
    try:
        call = getattr(ctypes.CDLL(None, use_errno=True), name)
    except (OSError, AttributeError):
        return None
    call.argtypes = list(argtypes)
    return call
