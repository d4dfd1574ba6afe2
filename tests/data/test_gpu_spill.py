"""Pass 2's chunks on disk (`SpillFile`) on a GPU: the copies to and from its page-locked staging
buffers run on the copy stream, ordered after the step's work and kept from memory the caching
allocator hands out again; on a CPU they are plain copies, so this half is GPU only."""

from __future__ import annotations

from collections import deque

import pytest
import torch

from clipscale.data.chunks import LOOKAHEAD, SpillFile

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(120)]


def test_spilled_chunks_come_back_to_the_gpu_bit_for_bit_through_the_copy_stream(tmp_path):
    """Chunks written from the device after the compute stream's work that made them, their device
    memory given up at once and written over by new tensors (the copy must have read it first:
    `record_stream`), then read back `LOOKAHEAD` ahead into page-locked buffers and copied to the
    device on a copy stream: every byte equal, the buffers page-locked."""
    device = torch.device("cuda")
    spill = SpillFile(str(tmp_path), share=1.0)
    copy_stream = torch.cuda.Stream(device)
    expected, held = [], []
    for k in range(2 * SpillFile.BUFFERS + 1):
        chunk = torch.randint(0, 256, (64, 3, 224, 224), dtype=torch.uint8, device=device)  # on the compute stream
        held.append(spill.hold(chunk, copy_stream))
        expected.append(chunk.cpu())
        del chunk
        torch.full((64, 3, 224, 224), 7, dtype=torch.uint8, device=device)  # may take the freed memory
    assert all(buffer.is_pinned() for buffer in spill.buffers)
    pending, back = deque(chunk.prepared() for chunk in held[:LOOKAHEAD]), []
    for chunk in held[LOOKAHEAD:] + [None] * LOOKAHEAD:
        back.append(pending.popleft().on_device(device, copy_stream).cpu())
        if chunk is not None:
            pending.append(chunk.prepared())
    assert all(torch.equal(got, sent) for got, sent in zip(back, expected))
    spill.close()
