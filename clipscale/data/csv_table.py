"""Training data as a CSV table of image paths and captions (open_clip's `--dataset-type csv`).

    filepath	title
    images/0001.jpg	a dog on a beach

Columns are named by `data.csv_image_key` / `data.csv_caption_key` (open_clip's `filepath` /
`title`), the separator by `data.csv_separator` (a tab); image paths are relative to the CSV
file's folder (or absolute). The table is read once, when the run starts, and cut into blocks of
`ROWS_PER_BLOCK` rows: a block is a shard for `ShardStream`, which reads, shuffles, resumes and
counts them as it does tar shards; a block's samples are the image files' bytes and the
captions, in the samples every source yields (`clipscale.data.sources`). An image file that
cannot be read is a sample without an image: skipped and counted.
"""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Callable, Iterator, Optional

from clipscale.config import ConfigError, relative_note
from clipscale.data.sources import CAPTION, IMAGE, ShardSource, everything, holds, shard_weights

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
