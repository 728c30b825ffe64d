"""minimind/decode/memory.py: zeroed tensors resident only where written, zeroed again by handing pages back; weights
in memory advised for huge pages."""

import os

import pytest
import torch

from conftest import collapses_memory, mapping_holding, resident_kb, transparent_huge_pages
from minimind.decode.memory import HUGE_PAGE, huge_page_bytes, into_huge_pages, lazy_zeros, zero_again

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


def test_huge_page_bytes_lie_past_a_huge_page_in_memory_advised_for_them():
    size = 3 * HUGE_PAGE + 100
    block = huge_page_bytes(size, 16)
    assert (block.numel(), block.dtype, block.data_ptr() % HUGE_PAGE) == (size, torch.uint8, 16)
    block.fill_(5)  # resident from here on, in huge pages where the kernel has them
    assert block.sum().item() == 5 * size
    mapping, mode = mapping_holding(block.data_ptr()), transparent_huge_pages()
    if not mode:
        pytest.skip("this kernel has no transparent huge pages")
    assert "hg" in mapping["VmFlags"]
    if mode != "never":  # switched off by the machine's owner: advised, yet in small pages
        assert mapping["AnonHugePages"] >= 3 * HUGE_PAGE // 1024  # the three huge pages wholly inside the block


@pytest.mark.skipif(not collapses_memory(), reason="needs MADV_COLLAPSE (Linux 6.1) and transparent huge pages")
def test_into_huge_pages_moves_the_written_huge_pages_alone():
    """Memory written in small pages: the whole huge pages inside the range that are resident throughout move into
    huge pages, with their bytes; a partly written one stays as it is, so that nothing more becomes resident."""
    import mmap

    pages = mmap.mmap(-1, 6 * HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    pages.madvise(mmap.MADV_NOHUGEPAGE)  # written in small pages whatever the kernel's mode
    whole = torch.frombuffer(pages, dtype=torch.uint8)
    start = -whole.data_ptr() % HUGE_PAGE
    block = whole[start : start + 4 * HUGE_PAGE]  # four whole huge pages
    written = 2 * HUGE_PAGE + 4096  # two of them and one small page of the third
    block[:written] = torch.arange(written, dtype=torch.int64).remainder(251).to(torch.uint8)
    assert mapping_holding(block.data_ptr())["AnonHugePages"] == 0
    moved = into_huge_pages(block.data_ptr() - 100, block.data_ptr() + block.numel())  # a start inside a huge page
    assert moved == 2 * HUGE_PAGE
    assert mapping_holding(block.data_ptr())["AnonHugePages"] == 2 * HUGE_PAGE // 1024
    assert resident_kb(whole) == written // 1024  # nothing more became resident
    assert torch.equal(block[:written], torch.arange(written, dtype=torch.int64).remainder(251).to(torch.uint8))
    assert into_huge_pages(block.data_ptr() + 1, block.data_ptr() + HUGE_PAGE) == 0  # no whole huge page inside
