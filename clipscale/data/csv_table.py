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
from typing import Iterator, Optional

from clipscale.config import ConfigError
from clipscale.data.sources import CAPTION, IMAGE, ShardSource, shard_weights

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

    def read(self, shard, errors) -> Iterator[dict]:
        start, stop = shard
        for index in range(start, stop):
            path, caption = self.rows[index]
            sample = {"__key__": str(index), CAPTION: caption.encode("utf-8")}
            try:
                sample[IMAGE] = Path(path).read_bytes()
            except OSError:
                pass
            yield sample


def read_rows(path: str, image_column: str, caption_column: str, separator: str, key: str) -> list[tuple[str, str]]:
    """(image path, caption) of every row of a CSV file, the paths made relative to its folder.
    A missing file or column is a ConfigError naming `key`."""
    table = Path(path)
    if not table.is_file():
        raise ConfigError(f"{key}: no CSV file at {path!r}")
    with table.open(newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f, delimiter=separator)
        columns = reader.fieldnames or []
        missing = [c for c in (image_column, caption_column) if c not in columns]
        if missing:
            raise ConfigError(f"{key}: {path} has no column {missing[0]!r} (its columns, split at {separator!r}: "
                              f"{', '.join(map(repr, columns))}); set data.csv_image_key / data.csv_caption_key / "
                              "data.csv_separator")
        rows = [(str(table.parent / row[image_column]), row[caption_column] or "") for row in reader]
    if not rows:
        raise ConfigError(f"{key}: {path} has no rows")
    return rows
