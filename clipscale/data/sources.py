"""Where training samples come from: webdataset shards or CSV tables, one or several sources, how they are drawn.

A `ShardSource` is what `ShardStream` reads: a list of *shards* (tar URLs: local paths,
`pipe:` commands, `http(s)://` URLs, opened by webdataset, which `source_shards` lists from a brace
pattern, a folder or a glob; or a CSV table's row blocks, `CsvTable`), how a shard
is read, and how shards are drawn:

- several sources joined with `::` (open_clip's `--train-data a::b`): their shards form one list;
- `upsampling_factors` (open_clip's `--train-data-upsampling-factors`): each shard is drawn with
  its source's factor as weight, so source i gives a share of the samples proportional to
  factor_i x its samples. Like open_clip, only when shards are drawn with replacement;
- `resampled` (open_clip's `--dataset-resampled`): every epoch, each consumer draws its shards
  with replacement (see `ShardStream`) instead of taking its share of a permutation.

A local, uncompressed tar shard is read here (`tar_samples`: the same samples as webdataset's
reader at a sixth of its cost); any other shard by webdataset. A shard's samples leave the source
in one shape whatever its keys: {"__key__", IMAGE: the image
bytes, CAPTION: the caption bytes}, from the first of the configured image keys and caption keys
the sample has (webdataset's "jpg;png" alternatives); other members (img2dataset's json
metadata) are dropped here, before the shuffle buffer holds them. A sample without one of them
keeps only what it has and is skipped and counted by the stream.

**A sample's members are decoded safely**: only the members a reader uses, each by an explicit decoder.
webdataset's `.decode()` runs a decoder on every member of a sample, whatever the reader
keeps afterwards, and its defaults unpickle `.pyd` / `.pickle` members, `torch.load` `.pth`
ones and `np.load` `.npy` ones: a shard from elsewhere could run code. Every reader in
clipscale takes the raw bytes (`wds.WebDataset` or `tarfile_to_samples` without `.decode`)
and decodes its image, text and label members with the functions below; any other member
stays bytes that nothing looks at.

Images open only as JPEG, PNG or WebP (evaluation folders: also BMP, PPM and TIFF); PIL
would otherwise try every format it knows, EPS through Ghostscript among them. An image whose header claims more pixels than the bound
(`data.max_image_pixels`, by default PIL's `Image.MAX_IMAGE_PIXELS`) is refused from its
header, before anything is allocated for its pixels.
"""

from __future__ import annotations

import csv
import glob
import io
import mmap
import re
import shutil
import struct
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator, Optional, Sequence

import webdataset as wds
from PIL import Image

from clipscale.config import ConfigError, relative_note

IMAGE_KEYS = ("jpg", "jpeg", "png", "webp")  # data.image_key's default
TEXT_KEYS = ("txt", "text", "caption")  # data.caption_key's default

# Where a sample's image and caption are when it leaves its source: load_sample looks there
# (PIL reads the image format from the bytes, not from the key).
IMAGE, CAPTION = IMAGE_KEYS[0], TEXT_KEYS[0]


# --- a sample's members, decoded safely ------------------------------------------------------

IMAGE_FORMATS = ("JPEG", "PNG", "WEBP")
FOLDER_FORMATS = (*IMAGE_FORMATS, "BMP", "PPM", "TIFF")  # and the others torchvision's ImageFolder lists


class ImageTooLarge(ValueError):
    """An image whose header claims more pixels than the bound: an image bomb, or a picture too big to train on."""


# What bad sample bytes raise while being opened and decoded (UnicodeDecodeError and
# ImageTooLarge are ValueErrors; PIL raises SyntaxError and struct.error from broken chunks,
# DecompressionBombError where a later step finds an image too large).
# Anything else is a bug in the reader and keeps its traceback.
DATA_ERRORS = (OSError, ValueError, SyntaxError, EOFError, struct.error, Image.DecompressionBombError)


def first_member(sample: dict, keys: Iterable[str]) -> Optional[str]:
    """The first of `keys` that the sample has, or None."""
    return next((key for key in keys if key in sample), None)


def open_image(data: bytes, max_pixels: Optional[int] = None, formats: tuple[str, ...] = IMAGE_FORMATS) -> Image.Image:
    """A PIL image over `data` with only its header read (PIL decodes on `convert` or `load`).

    ImageTooLarge when the header claims more than `max_pixels` pixels (None: PIL's
    `Image.MAX_IMAGE_PIXELS`). A bound above PIL's own raises PIL's in this process,
    which would otherwise refuse such images itself."""
    bound = Image.MAX_IMAGE_PIXELS if max_pixels is None else max_pixels  # None there too: the user lifted PIL's
    if Image.MAX_IMAGE_PIXELS is not None and bound is not None and bound > Image.MAX_IMAGE_PIXELS:
        Image.MAX_IMAGE_PIXELS = bound
    with warnings.catch_warnings():  # between PIL's bound and twice it PIL only warns; the check below decides
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        try:
            image = Image.open(io.BytesIO(data), formats=formats)
        except Image.DecompressionBombError as err:  # over twice PIL's bound: PIL refuses it first
            raise ImageTooLarge(f"its header claims more pixels than PIL allows: {err}") from None
    try:
        check_pixel_bound(*image.size, max_pixels)
    except ImageTooLarge:
        image.close()
        raise
    return image


def check_pixel_bound(width: int, height: int, max_pixels: Optional[int] = None) -> None:
    """ImageTooLarge when a header's width x height is above `max_pixels` (None: PIL's
    `Image.MAX_IMAGE_PIXELS`, itself None when a user lifted it)."""
    bound = Image.MAX_IMAGE_PIXELS if max_pixels is None else max_pixels
    if bound is not None and width * height > bound:
        raise ImageTooLarge(f"its header claims {width} x {height} pixels, more than the bound of {bound:,}")


def decode_text(data: bytes) -> str:
    return data.decode("utf-8").strip()


def decode_label(data: bytes) -> int:
    """A class label member (`cls`): an integer written as text."""
    return int(data.decode("ascii").strip())


# --- sources ----------------------------------------------------------------------------------


def everything(index: int) -> bool:
    """Every sample of a shard is wanted (`ShardSource.read`'s default)."""
    return True


def keys(alternatives: str | Sequence[str]) -> tuple[str, ...]:
    """'jpg;png' or [jpg, png] -> ('jpg', 'png'), lower case (webdataset lower-cases member suffixes)."""
    if isinstance(alternatives, str):
        alternatives = alternatives.split(";")
    return tuple(k.strip().lower() for k in alternatives if k.strip())


@dataclass
class ShardSource:
    """webdataset tar shards; subclasses read other shard kinds into the same samples."""

    shards: list
    image_keys: tuple[str, ...] = IMAGE_KEYS
    caption_keys: tuple[str, ...] = TEXT_KEYS
    weights: Optional[list[float]] = None  # per shard, for draws with replacement
    resampled: bool = False

    def __post_init__(self):
        if not self.shards:
            raise ValueError("no training shards given")
        if self.weights is not None and len(self.weights) != len(self.shards):
            raise ValueError(f"{len(self.weights)} weights for {len(self.shards)} shards")
        if self.weights is not None and not self.resampled:
            raise ValueError("shard weights are draw weights: they need resampled shards")

    def read(self, shard, errors, wanted: Callable[[int], bool] = everything) -> Iterator[dict]:
        """The samples of one shard, in order, each with only its image and caption; `errors`
        (a ShardErrors) decides what a damaged shard does. `wanted(i)`: whether the shard's i-th
        sample will be used; a source that can pass over a sample without reading it (a CSV
        table's image file) hands the others over without their image. A tar shard is read
        member after member whatever is wanted."""
        for raw in errors.read(shard):
            yield self.select(raw)

    def select(self, raw: dict) -> dict:
        sample = {"__key__": raw.get("__key__"), "__url__": raw.get("__url__")}
        image = next((k for k in self.image_keys if k in raw), None)
        caption = next((k for k in self.caption_keys if k in raw), None)
        if image is not None:
            sample[IMAGE] = raw[image]
        if caption is not None:
            sample[CAPTION] = raw[caption]
        return sample


TAR_SUFFIXES = (".tar", ".tar.gz", ".tgz")  # what a folder's or a glob's shards are named
CSV_SUFFIXES = (".csv", ".tsv")


def is_remote(shard: str) -> bool:
    """A URL or `pipe:` command: webdataset opens it, nothing here looks for it."""
    return "://" in shard or shard.startswith("pipe:")


def source_shards(pattern: str, key: str) -> list[str]:
    """The shards of one source (a part of `key`'s value between "::"), named as webdataset names
    them: a brace pattern ("data/{00000..00099}.tar"), a folder (the .tar files in it, sorted), a
    glob ("data/*.tar", its .tar matches, sorted), a file, a `pipe:` command or an http(s) URL
    (http(s) needs curl, which webdataset opens them with). A ConfigError naming `key` when a
    local name leads to no shard, or a local shard is missing."""
    shards = []
    for name in wds.shardlists.expand_urls(pattern):
        if is_remote(name):
            shards.append(name)
        elif Path(name).is_dir():
            shards += _named_by(name, sorted(str(p) for p in Path(name).iterdir()), key, folder=True)
        elif any(c in name for c in "*?[") and not Path(name).exists():
            shards += _named_by(name, sorted(glob.glob(name)), key, folder=False)
        else:
            shards.append(name)
    missing = [s for s in shards if not is_remote(s) and not Path(s).is_file()]
    if missing:
        which = "no file" if len(missing) == len(shards) else f"{len(missing)} missing files of {len(shards)}"
        raise ConfigError(f"{key}: {pattern!r} matches {which} (first missing: {missing[0]}){relative_note(missing[0])}")
    tables = [s for s in shards if s.lower().endswith(CSV_SUFFIXES)]
    if tables:
        raise ConfigError(f"{key}: {tables[0]} is a CSV table, not webdataset shards (data.kind: csv reads tables)")
    if any(s.startswith(("http://", "https://")) for s in shards) and shutil.which("curl") is None:
        raise ConfigError(f"{key}: webdataset reads http(s) shards with curl, which is not installed")
    return shards


def _named_by(name: str, paths: list[str], key: str, folder: bool) -> list[str]:
    """The tar files among `paths`, which the folder or glob `name` gives; a ConfigError saying
    what it gives instead."""
    shards = [p for p in paths if p.lower().endswith(TAR_SUFFIXES) and Path(p).is_file()]
    if shards:
        return shards
    if not paths:
        what = "is an empty folder" if folder else f"matches no file{relative_note(name)}"
        raise ConfigError(f"{key}: {name!r} {what}")
    what = "is a folder with no .tar file (it holds" if folder else "matches no .tar file (it matches"
    raise ConfigError(f"{key}: {name!r} {what} {holds(paths)})")


def holds(paths: list[str], shown: int = 4) -> str:
    """'3 files: a.jpg, b.jpg, c.csv' (folders as 'x/'), the first `shown` names and how many more."""
    names = [Path(p).name + ("/" if Path(p).is_dir() else "") for p in paths]
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    files = sum(not n.endswith("/") for n in names)
    counted = " and ".join(f"{n} {w}{'s' if n != 1 else ''}" for n, w in ((files, "file"), (len(names) - files, "folder")) if n)
    return f"{counted}: {', '.join(names[:shown])}{more}"


def shard_weights(sources: list[list], factors: Optional[Sequence[float]]) -> Optional[list[float]]:
    """Each shard's draw weight: its source's upsampling factor (open_clip's expand_urls(urls, weights))."""
    if factors is None:
        return None
    return [float(factor) for shards, factor in zip(sources, factors) for _ in shards]


# --- a local tar shard, read fast ------------------------------------------------------------
#
# A local tar shard's samples, as webdataset's `tarfile_to_samples` yields them, at a sixth of its
# cost a sample.
#
# webdataset reads a shard through Python's `tarfile`, which builds an object per member (checksum,
# fields, a file object to read it), and groups the members into samples with several calls more
# each: about 220 us a sample of three members on our CPU machines, a quarter of a loader worker's
# work once the JPEG decode is cheap. A local, uncompressed shard is here read through a memory
# map, each member's 512-byte header parsed by one `struct` call: about 35 us a sample.
#
# The samples are the same dicts webdataset gives: {"__key__", "__url__", one entry a member named by
# its suffix, lower-cased}; the same members are left out (anything but a regular file, names without
# a suffix, `__...__` metadata) and a shard cut short behaves the same: the member whose bytes are
# missing is dropped, the sample being grouped is yielded with what it has, and the error handler is
# told once. Pax headers (Python's tarfile, so webdataset's writer, puts one before every member for
# its fractional mtime) and GNU long names are read for the path and size they give; a header this
# reader does not parse (global pax headers, sparse files, base-256 sizes) sends the whole shard to
# webdataset: every header is checked before the first sample leaves.
# tests/data/test_tar_reading.py compares both readers on ordinary, odd and damaged shards.

TAR_BLOCK = 512
# name, mode, uid, gid, size, mtime, checksum, type flag, link name, magic, version, owner, group,
# device numbers, prefix (ustar's fields, in order)
TAR_HEADER = struct.Struct("100s8s8s8s12s12s8sc100s6s2s32s32s8s8s155s12x")
TAR_REGULAR = (b"0", b"\0", b"7")  # tarfile's isreg(): a regular file, an old-style one, a contiguous one
TAR_SKIPPED = (b"1", b"2", b"3", b"4", b"5", b"6", b"K")  # links, devices, folders, FIFOs, long link names: skipped
TAR_EXTENDED = (b"x", b"L")  # a pax header, a GNU long name: fields of the member after it
TAR_META = re.compile(r"__[^/]*__($|/)")  # webdataset's metadata members, skipped


class UnreadableTar(Exception):
    """The shard is not a tar file, or a member's bytes run past its end."""


def is_local_tar(url: str) -> bool:
    """Whether `url` is a local, uncompressed tar file this reader takes."""
    return "://" not in url and not url.startswith("pipe:") and url.lower().endswith(".tar") and Path(url).is_file()


def tar_samples(url: str, handler: Callable[[Exception], bool]) -> Iterator[dict]:
    """The samples of shard `url`: this reader's where it takes the shard, else webdataset's."""
    if is_local_tar(url) and Path(url).stat().st_size > 0:
        with open(url, "rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as shard:
            members, error = tar_members(shard)
            if members is not None:
                yield from grouped_members(shard, members, url, handler, error)
                return
    yield from wds.tarfile_to_samples(handler=handler)(iter([{"url": url}]))  # remote, compressed, empty or odd


def tar_members(shard) -> tuple[Optional[list[tuple[str, int, int]]], Optional[Exception]]:
    """(name, start, size) of each regular member, and the error that ends the shard early (None if
    none); None for the members where a header is one this reader leaves to webdataset, or the
    first is not a tar header (webdataset then says so)."""
    members, at, end = [], 0, len(shard)
    extended: dict[bytes, bytes] = {}  # the next member's pax records, or its GNU long name as b"path"
    while at + TAR_BLOCK <= end:
        block = shard[at : at + TAR_BLOCK]
        if not any(block):  # the end-of-archive blocks
            break
        fields = TAR_HEADER.unpack(block)
        name, size, checksum, kind, magic, prefix = fields[0], fields[4], fields[6], fields[7], fields[9], fields[15]
        if not checksum_holds(block, checksum):
            if at == 0:
                return None, None
            break  # tarfile ends the archive at a damaged header past the first, without an error
        if kind not in TAR_REGULAR + TAR_SKIPPED + TAR_EXTENDED or size[0] & 0x80:
            return None, None  # global pax headers, sparse files, base-256 sizes...: tarfile's
        length = int(extended[b"size"]) if b"size" in extended else int(size.rstrip(b"\0 ") or b"0", 8)
        start = at + TAR_BLOCK
        if start + length > end:
            return members, UnreadableTar(f"a member's {length:,} bytes run past the shard's end (byte {end:,})")
        at = start + (length + TAR_BLOCK - 1) // TAR_BLOCK * TAR_BLOCK
        if kind in TAR_EXTENDED and at <= end:
            data = shard[start : start + length]
            extended = pax_records(data) if kind == b"x" else {b"path": data.split(b"\0", 1)[0]}
            continue
        if kind in TAR_REGULAR:
            text = extended.get(b"path") or name.split(b"\0", 1)[0]
            if b"path" not in extended and magic.startswith(b"ustar") and prefix[:1] not in (b"\0", b""):
                text = prefix.split(b"\0", 1)[0] + b"/" + text
            members.append((text.decode("utf-8", "surrogateescape"), start, length))
        extended = {}
        if at > end:  # tarfile fails passing over the padding after the last member's bytes
            return members, UnreadableTar(f"the shard ends in the padding after a member (byte {end:,})")
    if at == 0 and end < TAR_BLOCK:
        return None, None
    if extended:  # tarfile reads the member after a pax header or long name at once, and fails without it
        return members, UnreadableTar("the shard ends after a pax header or long name, without its member")
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


def grouped_members(shard, members: list[tuple[str, int, int]], url: str, handler: Callable[[Exception], bool],
                    error: Optional[Exception]) -> Iterator[dict]:
    """The members grouped into samples by key, as webdataset's `group_by_keys` groups them; the
    handler told of `error` where webdataset meets it: before the last sample, which it cut."""
    current = None
    for name, start, length in members:
        if TAR_META.match(name):
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


# CSV tables (open_clip's `--dataset-type csv`):
#
#     filepath	title
#     images/0001.jpg	a dog on a beach
#
# Columns are named by `data.csv_image_key` / `data.csv_caption_key` (open_clip's `filepath` /
# `title`), the separator by `data.csv_separator` (a tab); image paths are relative to the CSV
# file's folder (or absolute). The table is read once, when the run starts, and cut into blocks of
# `ROWS_PER_BLOCK` rows: a block is a shard for `ShardStream`, which reads, shuffles, resumes and
# counts them as it does tar shards; a block's samples are the image files' bytes and the
# captions, in the shape every source yields. An image file that cannot be read is a sample
# without an image: skipped and counted.

ROWS_PER_BLOCK = 1000  # a shard's worth: consumers split the blocks as they split tar shards


class CsvTable(ShardSource):
    """The rows of one or more CSV files (sources); shards are (first row, end row) blocks of one source."""

    def __init__(self, sources: list[list[tuple[str, str]]], factors: Optional[list[float]] = None, resampled: bool = False):
        self.rows = [row for rows in sources for row in rows]
        blocks, first = [], 0
        for rows in sources:
            blocks.append([(start, min(start + ROWS_PER_BLOCK, first + len(rows)))
                           for start in range(first, first + len(rows), ROWS_PER_BLOCK)])
            first += len(rows)
        super().__init__([block for each in blocks for block in each], weights=shard_weights(blocks, factors),
                         resampled=resampled)

    def read(self, shard, errors, wanted: Callable[[int], bool] = everything) -> Iterator[dict]:
        """A block's rows; the image files of the wanted ones read (a block cut into parts is read
        once a part: each part reads its own rows' files only)."""
        start, stop = shard
        for index in range(start, stop):
            path, caption = self.rows[index]
            sample = {"__key__": str(index), CAPTION: caption.encode("utf-8")}
            if wanted(index - start):
                try:
                    sample[IMAGE] = Path(path).read_bytes()
                except OSError:
                    pass
            yield sample


def read_rows(path: str, image_column: str, caption_column: str, separator: str, key: str) -> list[tuple[str, str]]:
    """(image path, caption) of every row of a CSV file, the paths made relative to its folder.
    A missing file or column, a folder or a table without rows is a ConfigError naming `key`."""
    rows = list(_rows(path, image_column, caption_column, separator, key))
    if not rows:
        raise ConfigError(f"{key}: {path} has no rows")
    return rows


def count_rows(path: str, image_column: str, caption_column: str, separator: str, key: str) -> int:
    """How many rows read_rows gives, without holding them; the same ConfigErrors."""
    rows = sum(1 for _ in _rows(path, image_column, caption_column, separator, key))
    if not rows:
        raise ConfigError(f"{key}: {path} has no rows")
    return rows


def check_table(path: str, image_column: str, caption_column: str, separator: str, key: str) -> None:
    """read_rows' checks of the file and its columns, reading only the header."""
    next(iter(_rows(path, image_column, caption_column, separator, key)), None)


def _rows(path: str, image_column: str, caption_column: str, separator: str, key: str) -> Iterator[tuple[str, str]]:
    table = Path(path)
    if table.is_dir():
        entries = sorted(map(str, table.iterdir()))
        held = f" (it holds {holds(entries)})" if entries else " (an empty one)"
        raise ConfigError(f"{key}: {path!r} is a folder, not a CSV file{held}")
    if not table.is_file():
        raise ConfigError(f"{key}: no CSV file at {path!r}{relative_note(path)}")
    with table.open(newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f, delimiter=separator)
        columns = reader.fieldnames or []
        missing = [c for c in (image_column, caption_column) if c not in columns]
        if missing:
            raise ConfigError(f"{key}: {path} has no column {missing[0]!r} (its columns, split at {separator!r}: "
                              f"{', '.join(map(repr, columns))}); set data.csv_image_key / data.csv_caption_key / "
                              "data.csv_separator")
        for row in reader:
            yield str(table.parent / (row[image_column] or "")), row[caption_column] or ""
