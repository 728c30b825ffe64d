"""minimind/decode/memory.py: zeroed tensors resident only where written, zeroed again by handing pages back."""

import os

import pytest
import torch

from conftest import resident_kb
from minimind.decode.memory import lazy_zeros, zero_again

pytestmark = pytest.mark.skipif(
    not os.path.exists("/proc/self/smaps"), reason="reads resident memory from Linux's /proc"
)


def test_lazy_zeros_hold_the_pages_written_and_give_them_back():
    zeros = lazy_zeros((1024, 1024, 4), torch.float32)  # 16 MiB, every byte zero
    assert zeros.data_ptr() % 4096 == 0 and zeros.shape == (1024, 1024, 4) and zeros.dtype == torch.float32
    assert resident_kb(zeros) == 0
    zeros[0, 0, 0] = 1.0
    zeros[0, 1023, 3] = 2.0  # the last float of the first 16 kB: the fourth page
    zeros[700, 5] = 3.0
    assert resident_kb(zeros) == 3 * 4
    zero_again(zeros)
    assert resident_kb(zeros) == 0
    assert zeros.count_nonzero().item() == 0  # read back as zeros (and resident again, having been read)


def test_zero_again_hands_back_only_pages_wholly_inside_the_storage():
    """A storage that starts on a page and ends inside one (a small tensor from the heap can): the memory after it
    on that page keeps its bytes, the storage reads as zeros, and its whole pages are no longer resident."""
    import mmap

    pages = mmap.mmap(-1, 3 * mmap.PAGESIZE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    whole = torch.frombuffer(pages, dtype=torch.uint8)
    whole.fill_(7)
    inside = torch.frombuffer(pages, dtype=torch.uint8, count=mmap.PAGESIZE + 100)  # one page and 100 bytes
    assert inside.data_ptr() == whole.data_ptr() and inside.data_ptr() % mmap.PAGESIZE == 0
    zero_again(inside)
    first_page = torch.frombuffer(pages, dtype=torch.uint8, count=mmap.PAGESIZE)
    assert resident_kb(first_page) == 0  # handed back (before anything reads it)
    assert inside.count_nonzero().item() == 0
    assert torch.equal(whole[mmap.PAGESIZE + 100 :], torch.full((2 * mmap.PAGESIZE - 100,), 7, dtype=torch.uint8))


def test_zero_again_zeroes_other_tensors_in_place():
    ones = torch.ones(3, 5)
    zero_again(ones)
    assert ones.count_nonzero().item() == 0
    assert lazy_zeros((0, 4), torch.bfloat16).shape == (0, 4)
