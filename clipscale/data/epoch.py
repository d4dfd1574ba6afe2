"""One consumer's epoch: its samples read in order, through a shuffle buffer, resumable by seeking.

A consumer reads the shards of its `EpochPlan` in order; with a `stride` above 1 (fewer shards
than consumers) it keeps every stride-th sample of them, from `phase`. The samples it keeps are
numbered 0, 1, ... (their *raw index*) and pass through a shuffle buffer of `buffer_size`: once
it is full, each sample read goes in and one drawn at random comes out (webdataset's shuffle:
the drawn slot takes the last one); at the end of the epoch the buffer drains. Draw n uses a
generator seeded by (seed, n) alone, so a draw depends on the buffer's contents and nothing else.

Where the epoch stands is a small `position`: the draws made, the sizes (in samples, kept or
not) of the shards read to their end, and the raw indices in the buffer, in buffer order
(samples read = draws + buffered). A resume from it reads the buffer's samples again, and
nothing else of the epoch before the cursor:

- a shard before the current one is skipped unopened unless the buffer still holds one of its
  samples; one that does is read (its tar members, not decoded) up to its last buffered sample;
- the current shard is read from its start (a tar stream does not seek), keeping only buffered
  samples up to the cursor, and goes on from there.

The buffer's oldest samples decide how far back that reaches: a sample stays in a full buffer
of B for B draws on average, and the oldest of B for about B x ln(B). Errors met while seeking
(a damaged shard read again) were counted before the cursor and are not counted again; a
buffered sample that cannot be read again (a shard gone since) comes out of its draw as None,
to be skipped and counted.
"""

from __future__ import annotations

import random
import zlib
from bisect import bisect_right
from collections import defaultdict
from dataclasses import dataclass
from itertools import accumulate
from typing import Iterator, Optional


@dataclass(frozen=True)
class EpochPlan:
    shards: list
    stride: int = 1  # keep every stride-th sample of the shards...
    phase: int = 0  # ...from this one


class ShuffledEpoch:
    """The samples of one consumer's epoch, shuffled; `position()` after any of them resumes there."""

    def __init__(self, source, plan: EpochPlan, buffer_size: int, seed: str, errors):
        self.source, self.plan, self.buffer_size, self.seed, self.errors = source, plan, max(1, buffer_size), seed, errors
        self.draws = 0
        self.sizes: list[int] = []  # samples in each shard read to its end, in plan order
        self.buffer: list[tuple[int, Optional[dict]]] = []  # (raw index, sample)
        self.opened = 0  # shards opened, seeking included: what a resume costs

    def position(self) -> tuple:
        """(draws, shard sizes, buffered raw indices): plain tuples, as a checkpoint holds them."""
        return self.draws, tuple(self.sizes), tuple(index for index, _ in self.buffer)

    def samples(self, draws: int = 0, sizes: tuple = (), buffered: tuple = ()) -> Iterator[Optional[dict]]:
        """The epoch's samples in shuffled order, from `position()`'s (draws, sizes, buffered) on."""
        self.draws, self.sizes = draws, list(sizes)
        for item in self._seek(buffered, read=draws + len(buffered)):
            self.buffer.append(item)
            if len(self.buffer) >= self.buffer_size:
                yield self._draw()
        while self.buffer:
            yield self._draw()

    def _draw(self) -> Optional[dict]:
        slot = random.Random(zlib.crc32(f"{self.seed}/{self.draws}".encode())).randrange(len(self.buffer))
        _, sample = self.buffer[slot]
        self.buffer[slot] = self.buffer[-1]
        self.buffer.pop()
        self.draws += 1
        return sample

    def _seek(self, buffered: tuple, read: int) -> Iterator[tuple[int, dict]]:
        """Refill the buffer with the samples `buffered` names; the samples from raw index `read` on."""
        if read == 0:
            return self._kept(self._members(0))
        stride, phase = self.plan.stride, self.plan.phase
        offsets = list(accumulate(self.sizes, initial=0))  # where each shard read to its end starts
        current = len(self.sizes)  # the shard that holds the last sample read, unless the epoch is read
        slot_of = {phase + index * stride: slot for slot, index in enumerate(buffered)}  # member -> buffer slot
        found: list[Optional[dict]] = [None] * len(buffered)
        earlier = defaultdict(set)  # shard read to its end -> its buffered members
        for member in slot_of:
            if member < offsets[current]:
                earlier[bisect_right(offsets, member) - 1].add(member)
        for shard, wanted in sorted(earlier.items()):
            self.opened += 1
            for member, sample in enumerate(self.source.read(self.plan.shards[shard], self.errors), offsets[shard]):
                if member in wanted:
                    found[slot_of[member]] = sample
                    wanted.discard(member)
                    if not wanted:
                        break
        members = self._members(current)
        last = phase + (read - 1) * stride  # the member of the last sample read
        if last >= offsets[current]:
            for member, sample in members:
                if member in slot_of:
                    found[slot_of[member]] = sample
                if member >= last:
                    break
        self.errors.count = 0  # met before the cursor: counted then
        self.buffer = list(zip(buffered, found))
        return self._kept(members)

    def _members(self, first: int) -> Iterator[tuple[int, dict]]:
        """(member index in the plan's shards, sample) from shard `first` on, recording shard sizes."""
        member = sum(self.sizes[:first])
        for shard in self.plan.shards[first:]:
            self.opened += 1
            count = 0
            for sample in self.source.read(shard, self.errors):
                yield member + count, sample
                count += 1
            self.sizes.append(count)
            member += count

    def _kept(self, members: Iterator[tuple[int, dict]]) -> Iterator[tuple[int, dict]]:
        stride, phase = self.plan.stride, self.plan.phase
        for member, sample in members:
            if member >= phase and (member - phase) % stride == 0:
                yield (member - phase) // stride, sample
