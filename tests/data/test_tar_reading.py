"""The local tar reader (`clipscale.data.sources.tar_samples`) against webdataset's own `tarfile_to_samples`,
on shards written by webdataset's writer and by Python's tarfile in its three formats, with the
members webdataset leaves out, and on damaged shards: the same samples, in the same order, and the
error handler told on the same shards."""

from __future__ import annotations

import gzip
import io
import tarfile

import pytest
import webdataset as wds

from clipscale.data.sources import is_local_tar, tar_members, tar_samples


def webdataset_samples(path: str) -> tuple[list[dict], int]:
    errors = []
    return list(wds.tarfile_to_samples(handler=lambda e: errors.append(e) or True)(iter([{"url": path}]))), len(errors)


def our_samples(path: str) -> tuple[list[dict], int]:
    errors = []
    return list(tar_samples(path, lambda e: errors.append(e) or True)), len(errors)


def write_tar(path, members: list[tuple[str, bytes]], format=tarfile.PAX_FORMAT, kinds: dict | None = None) -> str:
    """A tar of `members` (name, bytes); `kinds`: {name: tarfile type} for members that are not files."""
    with tarfile.open(path, "w", format=format) as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size, info.mtime = len(data), 1795843669.944863  # a fractional mtime: a pax header each
            if kinds and name in kinds:
                info.type, info.size = kinds[name], 0
                tar.addfile(info)
            else:
                tar.addfile(info, io.BytesIO(data))
    return str(path)


def ordinary(n: int = 7) -> list[tuple[str, bytes]]:
    return [member for k in range(n) for member in
            ((f"s{k:04d}.jpg", bytes([k]) * (300 + 700 * k)), (f"s{k:04d}.txt", f"caption {k}".encode()),
             (f"s{k:04d}.json", b"{}"))]


def test_webdatasets_own_shards_read_alike(tmp_path):
    path = str(tmp_path / "w.tar")
    with wds.TarWriter(path) as sink:
        for k in range(9):
            sink.write({"__key__": f"sample{k:05d}", "jpg": bytes(range(256)) * (k + 1), "txt": f"a dog {k}".encode(), "cls": b"3"})
    theirs, our = webdataset_samples(path), our_samples(path)
    assert len(theirs[0]) == 9 and our == theirs
    members, _ = tar_members(open(path, "rb").read())
    assert members is not None  # read here, not handed back to webdataset


@pytest.mark.parametrize("format", [tarfile.PAX_FORMAT, tarfile.GNU_FORMAT, tarfile.USTAR_FORMAT])
def test_odd_members_are_left_out_or_named_as_webdataset_does(tmp_path, format):
    long_folder = "d" * 120 if format != tarfile.USTAR_FORMAT else "d" * 90  # ustar: the name's prefix field
    members = ordinary(3) + [
        ("__meta__", b"x"), ("folder/__info__/a.txt", b"y"), ("noext", b"z"), ("folder", b""),
        (f"{long_folder}/deep.JPG", b"upper-case suffix"), (f"{long_folder}/deep.txt", b"in a long folder"),
        ("link.jpg", b""), ("two.dots.tar.jpg", b"w"), ("two.dots.tar.txt", b"v"), ("é.txt", "ü".encode()),
    ]
    path = write_tar(tmp_path / "odd.tar", members, format, kinds={"folder": tarfile.DIRTYPE, "link.jpg": tarfile.SYMTYPE})
    theirs, our = webdataset_samples(path), our_samples(path)
    assert our == theirs and theirs[1] == 0
    assert any(sample["__key__"] == f"{long_folder}/deep" and "jpg" in sample for sample in theirs[0])
    assert tar_members(open(path, "rb").read())[0] is not None


def test_a_duplicate_member_is_dropped_and_reported(tmp_path):
    path = write_tar(tmp_path / "dup.tar", ordinary(2) + [("s0001.txt", b"again")])
    (theirs, told), (our, our_told) = webdataset_samples(path), our_samples(path)
    assert our == theirs and told == 1 and our_told == 1


@pytest.mark.parametrize("cut", ["in a member's bytes", "in a header", "after a member's bytes"])
def test_a_shard_cut_short_gives_what_webdataset_gives_and_is_reported_alike(tmp_path, cut):
    whole = open(write_tar(tmp_path / "whole.tar", ordinary(5)), "rb").read()
    starts = [info.offset_data for info in tarfile.open(fileobj=io.BytesIO(whole))]
    at = {"in a member's bytes": starts[9] + 100, "in a header": starts[9] - 700,
          "after a member's bytes": starts[9] + 3 * 700 + 300 + 1}[cut]
    path = tmp_path / "cut.tar"
    path.write_bytes(whole[:at])
    (theirs, told), (our, our_told) = webdataset_samples(str(path)), our_samples(str(path))
    assert our == theirs and bool(our_told) == bool(told)
    assert 2 <= len(theirs) < 5


@pytest.mark.parametrize("content", [b"", b"not a tar file at all" * 3, b"\x01" * 2048])
def test_what_is_not_a_tar_is_left_to_webdataset(tmp_path, content):
    path = tmp_path / "bad.tar"
    path.write_bytes(content)
    assert our_samples(str(path)) == webdataset_samples(str(path))


def test_a_global_pax_header_and_compressed_shards_go_to_webdataset(tmp_path):
    path = tmp_path / "global.tar"
    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT, pax_headers={"comment": "global"}) as tar:
        for name, data in ordinary(2):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    assert tar_members(path.read_bytes()) == (None, None)
    assert our_samples(str(path)) == webdataset_samples(str(path))
    packed = tmp_path / "packed.tar.gz"
    packed.write_bytes(gzip.compress(open(write_tar(tmp_path / "plain.tar", ordinary(3)), "rb").read()))
    assert not is_local_tar(str(packed))
    assert our_samples(str(packed)) == webdataset_samples(str(packed)) and len(our_samples(str(packed))[0]) == 3
