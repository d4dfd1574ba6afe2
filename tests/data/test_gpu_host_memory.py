"""Page-locked host memory of our own (`pinned_empty`): registered with CUDA at its exact size, so
copies from and to it are asynchronous DMA, holding what was copied in, and not copied into a forked
child.

On a CPU `pinned_empty` is a plain tensor and there is nothing to register: GPU only.
"""

from __future__ import annotations

import pytest
import torch

from clipscale.data.chunks import pinned_empty
from tests.helpers.forked_child import answer_in_a_forked_child

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(120)]


def test_pinned_empty_is_page_locked_at_its_exact_size_and_carries_copies_both_ways():
    shape = (3, 1_001, 7)  # an odd size: no page or power of two
    host = pinned_empty(shape, torch.float32)
    assert host.shape == shape and host.dtype == torch.float32
    assert host.is_pinned(), "CUDA does not know the memory as page-locked: copies would be staged"
    assert host.untyped_storage().nbytes() == 3 * 1_001 * 7 * 4, "more host memory held than asked for"

    sent = torch.randn(shape, device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        host.copy_(sent, non_blocking=True)
        back = host.to("cuda", non_blocking=True)
    stream.synchronize()
    assert torch.equal(host, sent.cpu())
    assert torch.equal(back, sent)


def test_pinned_empty_of_a_gibibyte_is_written_in_and_registered_at_once():
    host = pinned_empty((2**30,), torch.uint8)
    assert host.is_pinned()
    host[::4096].fill_(1)  # a byte of every page: the memory is the process's to use
    assert int(host[::4096].sum()) == 2**30 // 4096


def anon_pages_bytes() -> int:
    """The host's anonymous memory in use (/proc/meminfo AnonPages), in bytes."""
    with open("/proc/meminfo") as meminfo:
        return next(int(line.split()[1]) * 1024 for line in meminfo if line.startswith("AnonPages:"))


@pytest.mark.filterwarnings("ignore:This process.*multi-threaded:DeprecationWarning")  # the child only writes to a pipe and exits
def test_a_forked_child_takes_no_copy_of_page_locked_memory():
    """Linux copies pinned private pages into a child at fork, at once: 14 loader workers forked
    beside pass 2's page-locked waiting room each took a copy (a million samples on one H100 ran
    out of the host's 128 GiB). A child forked beside 2 GiB of `pinned_empty` adds almost nothing
    to the host's anonymous memory, where a copy would add the 2 GiB."""
    host = pinned_empty((2 * 2**30,), torch.uint8)
    assert host.is_pinned()
    before = anon_pages_bytes()
    in_the_child = int(answer_in_a_forked_child(lambda: str(anon_pages_bytes()).encode()))
    assert in_the_child - before < 2**29, f"the fork added {(in_the_child - before) / 2**30:.2f} GiB of anonymous memory"
