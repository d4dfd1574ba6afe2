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


def test_a_slot_of_the_host_room_is_written_again_only_after_its_read_has_run():
    """Pass 2 copies a chunk from the room back to the device on its copy stream and frees the slot
    (`OnHost.leave`) as soon as that copy is issued; the next batch's chunk prepared ahead into the
    same slot (`hold_ahead`, another stream) must wait for the read, or it overwrites the pixels
    pass 2 is about to train on. The read is held back behind a long sleep on its stream, and the
    writer's current stream is not one that waited for it."""
    from clipscale.data.chunks import HostWaitingRoom

    device = torch.device("cuda")
    room = HostWaitingRoom(chunk_bytes=64 * 3 * 224 * 224)
    write_stream, read_stream, ahead_stream = (torch.cuda.Stream(device) for _ in range(3))
    first = torch.randint(0, 256, (64, 3, 224, 224), dtype=torch.uint8, device=device)
    held = room.hold(first, write_stream)
    read_stream.wait_event(held.copied)
    read_stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(read_stream):
        torch.cuda._sleep(2_000_000_000)  # about a second: the read below runs long after the write is issued
    back = held.on_device(device, read_stream)
    held.leave(read_stream)
    with torch.cuda.stream(torch.cuda.Stream(device)):  # a current stream that did not wait for the read either
        second = torch.full_like(first, 7)
        again = room.hold_ahead(second, ahead_stream)
    assert again is not None and again.host.data_ptr() == held.host.data_ptr(), "the slot pass 2 read is the one taken"
    torch.cuda.synchronize()
    assert torch.equal(back, first), "pass 2's chunk was written over before it was read"
    assert torch.equal(again.host, second.cpu())
