"""The epochs' order of samples, the same on any number of ranks and loader workers, and one slot's
samples read through a shuffle buffer, resumable by seeking.

**The order** (`EpochOrder`) depends on the seed and the source alone. Epoch e is a sequence of
*slots*: each shard (with resampled shards, each of as many draws with replacement as there are
shards, weighted by the sources' upsampling factors) cut into `parts` slots (every parts-th sample
of the shard, from a phase), where `parts` makes an epoch at least `MIN_SLOTS` slots, all of them
shuffled with a generator seeded by (seed, e). The epochs follow one another into one endless
sequence of slots, numbered globally.

**The work** (`WorkList`): the slots not yet used, in order. Consumer c of C (rank x loader
workers) takes items c, c + C, c + 2C, ... of it. A checkpoint holds, for each consumer, the item
it is in and how far (its `ShuffledEpoch.position`); a resume on the same shape goes on from
there, item for item. A resume on another shape first folds the consumers' cursors into a new
work list (`WorkList.after`): the slots used up drop out, each slot begun keeps its position, and
the new consumers take the rest round-robin, begun slots first. So every sample of an epoch is
used once, whatever shapes the run took.

**One slot** (`ShuffledEpoch`) reads the shards of its `EpochPlan` (a slot's: one shard) in
order; with a `stride` above 1 (a shard in parts) it keeps every stride-th sample of them, from
`phase`. The samples it keeps are numbered 0, 1, ... (their *raw index*) and pass through a
shuffle buffer of `buffer_size`: once it is full, each sample read goes in and one drawn at
random comes out (webdataset's shuffle: the drawn place takes the last one); at the slot's end
the buffer drains. Draw n uses a generator seeded by (seed, n) alone, so a draw depends on the
buffer's contents and nothing else.

Where the slot stands is a small `position`: the draws made, the sizes (in samples, kept or
not) of the shards read to their end, and the raw indices in the buffer, in buffer order
(samples read = draws + buffered). A resume from it reads the buffer's samples again, and
nothing else of the slot before the cursor:

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

import math
import random
import zlib
from bisect import bisect_right
from collections import defaultdict
from dataclasses import dataclass, field
from itertools import accumulate
from typing import Iterator, Optional

# An epoch has at least this many slots, so that as many consumers each read a part of it even
# from one shard (a small CSV table is one); a shard cut into k parts is read k times an epoch.
MIN_SLOTS = 64
SAMPLE_SEEDS = 2**32  # a sample's seed is a CRC-32: one of this many, spread evenly


@dataclass(frozen=True)
class Slot:
    epoch: int
    shard: object
    phase: int  # the slot keeps every `parts`-th sample of the shard, from this one
    parts: int


class EpochOrder:
    """Every epoch's slots, numbered globally (slot i of epoch e is number e x per_epoch + i)."""

    def __init__(self, source, seed: int):
        self.source, self.seed = source, seed
        self.parts = math.ceil(MIN_SLOTS / len(source.shards))
        self.per_epoch = len(source.shards) * self.parts
        self._drawn: dict[int, list] = {}  # epoch -> its (shard, phase) slots; the last two epochs asked for

    def slot(self, number: int) -> Slot:
        epoch, index = divmod(number, self.per_epoch)
        if epoch not in self._drawn:
            self._drawn = {e: slots for e, slots in self._drawn.items() if e == epoch - 1}
            self._drawn[epoch] = self._draw(epoch)
        shard, phase = self._drawn[epoch][index]
        return Slot(epoch, shard, phase, self.parts)

    def _draw(self, epoch: int) -> list:
        shards = self.source.shards
        if self.source.resampled:  # with replacement, weighted by the sources' upsampling factors
            shards = random.Random(f"{self.seed}/resampled/{epoch}").choices(shards, weights=self.source.weights,
                                                                            k=len(shards))
        slots = [(shard, phase) for shard in shards for phase in range(self.parts)]
        random.Random(f"{self.seed}/slots/{epoch}").shuffle(slots)
        return slots


@dataclass(frozen=True)
class WorkList:
    """The slots not yet used, in order: every slot from `frontier` on but those `done`; a slot in
    `partial` was used up to its position. Item k is the k-th of them; consumer c of C takes items
    c, c + C, ..."""

    frontier: int = 0
    partial: dict = field(default_factory=dict)  # slot number -> ShuffledEpoch.position() reached
    done: tuple = ()  # slot numbers after the frontier used to their end, sorted

    def item(self, k: int) -> tuple[int, tuple]:
        """(slot number, position to start from) of item k."""
        slot = self.frontier + k
        for used in self.done:
            if used > slot:
                break
            slot += 1
        return slot, self.partial.get(slot, ())

    def after(self, consumers: int, cursors: dict[int, tuple]) -> "WorkList":
        """This list once each of its `consumers` has used its items before its cursor's item and that
        one up to the cursor's position: cursors[c] = (item, *position); a consumer without one used
        nothing."""
        done, partial = set(self.done), dict(self.partial)
        for consumer in range(consumers):
            item, *position = cursors.get(consumer, (consumer,))
            for used in range(consumer, item, consumers):
                slot = self.item(used)[0]
                done.add(slot)
                partial.pop(slot, None)
            if position:
                partial[self.item(item)[0]] = tuple(position)
        frontier = self.frontier
        while frontier in done:
            done.discard(frontier)
            frontier += 1
        return WorkList(frontier, partial, tuple(sorted(done)))


@dataclass(frozen=True)
class EpochPlan:
    shards: list
    stride: int = 1  # keep every stride-th sample of the shards...
    phase: int = 0  # ...from this one


class ShuffledEpoch:
    """The samples of one slot, shuffled; `position()` after any of them resumes there."""

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
        """The slot's samples in shuffled order, from `position()`'s (draws, sizes, buffered) on."""
        self.draws, self.sizes = draws, list(sizes)
        for item in self._seek(buffered, read=draws + len(buffered)):
            self.buffer.append(item)
            if len(self.buffer) >= self.buffer_size:
                yield self._draw()
        while self.buffer:
            yield self._draw()

    def sample_seed(self) -> int:
        """The seed of the sample drawn last, one of `SAMPLE_SEEDS`: its augmentation's randomness,
        a function of its place in the order alone, so a resumed run, on any shape, draws the same
        crops. (The next draw's buffer slot is chosen by the same number.)"""
        return zlib.crc32(f"{self.seed}/{self.draws}".encode())

    def _draw(self) -> Optional[dict]:
        slot = random.Random(self.sample_seed()).randrange(len(self.buffer))
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
        counted = self.errors.count
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
            first = offsets[shard]
            for member, sample in enumerate(self.source.read(self.plan.shards[shard], self.errors,
                                                             lambda index: first + index in wanted), first):
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
        self.errors.count = counted  # those met while seeking were met before the cursor: counted then
        self.buffer = list(zip(buffered, found))
        return self._kept(members)

    def _members(self, first: int) -> Iterator[tuple[int, dict]]:
        """(member index in the plan's shards, sample) from shard `first` on, recording shard sizes."""
        member = sum(self.sizes[:first])
        for shard in self.plan.shards[first:]:
            self.opened += 1
            count = 0
            for sample in self.source.read(shard, self.errors, lambda index, start=member: self.keeps(start + index)):
                yield member + count, sample
                count += 1
            self.sizes.append(count)
            member += count

    def keeps(self, member: int) -> bool:
        """Whether the slot keeps member `member` of its shards: every stride-th from its phase."""
        return member >= self.plan.phase and (member - self.plan.phase) % self.plan.stride == 0

    def _kept(self, members: Iterator[tuple[int, dict]]) -> Iterator[tuple[int, dict]]:
        for member, sample in members:
            if self.keeps(member):
                yield (member - self.plan.phase) // self.plan.stride, sample
