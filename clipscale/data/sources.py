"""Where training samples come from: webdataset shards, one or several sources, how they are drawn.

A `ShardSource` is what `ShardStream` reads: a list of *shards* (tar URLs: local paths,
`pipe:` commands, `http(s)://` URLs, opened by webdataset; or a CSV table's row blocks,
`clipscale.data.csv_table`), how a shard is read, and how shards are drawn:

- several sources joined with `::` (open_clip's `--train-data a::b`): their shards form one list;
- `upsampling_factors` (open_clip's `--train-data-upsampling-factors`): each shard is drawn with
  its source's factor as weight, so source i gives a share of the samples proportional to
  factor_i x its samples. Like open_clip, only when shards are drawn with replacement;
- `resampled` (open_clip's `--dataset-resampled`): every epoch, each consumer draws its shards
  with replacement (see `ShardStream`) instead of taking its share of a permutation.

A shard's samples leave the source in one shape whatever its keys: {"__key__", IMAGE: the image
bytes, CAPTION: the caption bytes}, from the first of the configured image keys and caption keys
the sample has (webdataset's "jpg;png" alternatives); other members (img2dataset's json
metadata) are dropped here, before the shuffle buffer holds them. A sample without one of them
keeps only what it has and is skipped and counted by the stream.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Optional, Sequence

import webdataset as wds
IMAGE_KEYS = ("jpg", "jpeg", "png", "webp")  # data.image_key's default
TEXT_KEYS = ("txt", "text", "caption")  # data.caption_key's default
# Where a sample's image and caption are when it leaves its source: load_sample looks there
# (PIL reads the image format from the bytes, not from the key).
IMAGE, CAPTION = IMAGE_KEYS[0], TEXT_KEYS[0]


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

    def read(self, shard, errors) -> Iterator[dict]:
        """The samples of one shard, in order, each with only its image and caption; `errors`
        (a ShardErrors) decides what a damaged shard does."""
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


def split_sources(patterns: str) -> list[list[str]]:
    """'a/{0..9}.tar::b/{0..3}.tar' -> the shards of each source, braces expanded."""
    return [wds.shardlists.expand_urls(pattern) for pattern in patterns.split("::")]


def shard_weights(sources: list[list], factors: Optional[Sequence[float]]) -> Optional[list[float]]:
    """Each shard's draw weight: its source's upsampling factor (open_clip's expand_urls(urls, weights))."""
    if factors is None:
        return None
    return [float(factor) for shards, factor in zip(sources, factors) for _ in shards]

