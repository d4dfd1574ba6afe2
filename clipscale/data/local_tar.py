"""A local tar shard's samples, as webdataset's `tarfile_to_samples` yields them, at a sixth of its
cost a sample.

webdataset reads a shard through Python's `tarfile`, which builds an object per member (checksum,
fields, a file object to read it), and groups the members into samples with several calls more
each: about 220 us a sample of three members on our CPU machines, a quarter of a loader worker's
work once the JPEG decode is cheap. A local, uncompressed shard is here read through a memory
map, each member's 512-byte header parsed by one `struct` call: about 35 us a sample.

The samples are the same dicts webdataset gives: {"__key__", "__url__", one entry a member named by
its suffix, lower-cased}; the same members are left out (anything but a regular file, names without
a suffix, `__...__` metadata) and a shard cut short behaves the same: the member whose bytes are
missing is dropped, the sample being grouped is yielded with what it has, and the error handler is
told once. Pax headers (Python's tarfile, so webdataset's writer, puts one before every member for
its fractional mtime) and GNU long names are read for the path and size they give; a header this
reader does not parse (global pax headers, sparse files, base-256 sizes) sends the whole shard to
webdataset: every header is checked before the first sample leaves.
tests/data/test_local_tar.py compares both readers on ordinary, odd and damaged shards.
"""

from __future__ import annotations

import mmap
import re
import struct
from pathlib import Path
from typing import Callable, Iterator, Optional

import webdataset as wds

BLOCK = 512
# name, mode, uid, gid, size, mtime, checksum, type flag, link name, magic, version, owner, group,
# device numbers, prefix (ustar's fields, in order)
HEADER = struct.Struct("100s8s8s8s12s12s8sc100s6s2s32s32s8s8s155s12x")
REGULAR = (b"0", b"\0", b"7")  # tarfile's isreg(): a regular file, an old-style one, a contiguous one
SKIPPED = (b"1", b"2", b"3", b"4", b"5", b"6", b"K")  # links, devices, folders, FIFOs, long link names: skipped
EXTENDED = (b"x", b"L")  # a pax header, a GNU long name: fields of the member after it
META = re.compile(r"__[^/]*__($|/)")  # webdataset's metadata members, skipped


class Unreadable(Exception):
    """The shard is not a tar file, or a member's bytes run past its end."""


def is_local_tar(url: str) -> bool:
    """Whether `url` is a local, uncompressed tar file this reader takes."""
    return "://" not in url and not url.startswith("pipe:") and url.lower().endswith(".tar") and Path(url).is_file()


def samples(url: str, handler: Callable[[Exception], bool]) -> Iterator[dict]:
    """The samples of shard `url`: this reader's where it takes the shard, else webdataset's."""
    if is_local_tar(url) and Path(url).stat().st_size > 0:
        with open(url, "rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as shard:
            members, error = member_table(shard)
            if members is not None:
                yield from grouped(shard, members, url, handler, error)
                return
    yield from wds.tarfile_to_samples(handler=handler)(iter([{"url": url}]))  # remote, compressed, empty or odd


def member_table(shard) -> tuple[Optional[list[tuple[str, int, int]]], Optional[Exception]]:
    """(name, start, size) of each regular member, and the error that ends the shard early (None if
    none); None for the members where a header is one this reader leaves to webdataset, or the
    first is not a tar header (webdataset then says so)."""
    members, at, end = [], 0, len(shard)
    extended: dict[bytes, bytes] = {}  # the next member's pax records, or its GNU long name as b"path"
    while at + BLOCK <= end:
        block = shard[at : at + BLOCK]
        if not any(block):  # the end-of-archive blocks
            break
        fields = HEADER.unpack(block)
        name, size, checksum, kind, magic, prefix = fields[0], fields[4], fields[6], fields[7], fields[9], fields[15]
        if not checksum_holds(block, checksum):
            if at == 0:
                return None, None
            break  # tarfile ends the archive at a damaged header past the first, without an error
        if kind not in REGULAR + SKIPPED + EXTENDED or size[0] & 0x80:
            return None, None  # global pax headers, sparse files, base-256 sizes...: tarfile's
        length = int(extended[b"size"]) if b"size" in extended else int(size.rstrip(b"\0 ") or b"0", 8)
        start = at + BLOCK
        if start + length > end:
            return members, Unreadable(f"a member's {length:,} bytes run past the shard's end (byte {end:,})")
        at = start + (length + BLOCK - 1) // BLOCK * BLOCK
        if kind in EXTENDED and at <= end:
            data = shard[start : start + length]
            extended = pax_records(data) if kind == b"x" else {b"path": data.split(b"\0", 1)[0]}
            continue
        if kind in REGULAR:
            text = extended.get(b"path") or name.split(b"\0", 1)[0]
            if b"path" not in extended and magic.startswith(b"ustar") and prefix[:1] not in (b"\0", b""):
                text = prefix.split(b"\0", 1)[0] + b"/" + text
            members.append((text.decode("utf-8", "surrogateescape"), start, length))
        extended = {}
        if at > end:  # tarfile fails passing over the padding after the last member's bytes
            return members, Unreadable(f"the shard ends in the padding after a member (byte {end:,})")
    if at == 0 and end < BLOCK:
        return None, None
    if extended:  # tarfile reads the member after a pax header or long name at once, and fails without it
        return members, Unreadable("the shard ends after a pax header or long name, without its member")
    return members, None


def pax_records(data: bytes) -> dict[bytes, bytes]:
    """A pax extended header's records ("length key=value\\n" each): the next member's fields."""
    records, at = {}, 0
    while at < len(data) and data[at:at + 1] != b"\0":
        space = data.index(b" ", at)
        record_end = at + int(data[at:space])
        key, _, value = data[space + 1 : record_end - 1].partition(b"=")
        records[key] = value
        at = record_end
    return records


def checksum_holds(block: bytes, field: bytes) -> bool:
    """Whether a header's checksum field matches its bytes, summed (8 spaces for the field itself)
    unsigned, or signed as some old tar programs summed them."""
    try:
        stored = int(field.rstrip(b"\0 ").strip() or b"0", 8)
    except ValueError:
        return False
    unsigned = sum(block) - sum(field) + 8 * 32
    return stored == unsigned or stored == unsigned - 256 * sum(1 for byte in block[:148] + block[156:] if byte > 127)


def grouped(shard, members: list[tuple[str, int, int]], url: str, handler: Callable[[Exception], bool],
            error: Optional[Exception]) -> Iterator[dict]:
    """The members grouped into samples by key, as webdataset's `group_by_keys` groups them; the
    handler told of `error` where webdataset meets it: before the last sample, which it cut."""
    current = None
    for name, start, length in members:
        if "/" not in name and name.startswith("__") and name.endswith("__") or META.match(name):
            continue
        key, suffix = wds.tariterators.base_plus_ext(name)
        if key is None:
            continue
        suffix = suffix.lower()
        if current is None or key != current["__key__"]:
            if current is not None:
                yield current
            current = {"__key__": key, "__url__": url}
        if suffix in current:
            handler(ValueError(f"{name}: duplicate file name in tar file {suffix} {current.keys()}"))
            continue
        current[suffix] = shard[start : start + length]
    if error is not None:
        handler(error)
    if current is not None:
        yield current
