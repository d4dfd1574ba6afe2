"""Training and evaluation data: the embedded digits, or the user's webdataset shards or CSV table."""

from __future__ import annotations

import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist
import webdataset as wds

from clipscale.config import ConfigError, DataConfig
from clipscale.data.csv_table import CsvTable, read_rows
from clipscale.data.digits import write_digits_shards
from clipscale.data.members import decode_label, first_member, open_image
from clipscale.data.shards import IMAGE_KEYS
from clipscale.data.sources import ShardSource, keys, shard_weights
from clipscale.distributed import World


@dataclass
class PreparedData:
    train_shards: list[str] | ShardSource  # what ShardStream reads
    num_train: int
    val_shards: list[str] = field(default_factory=list)
    classnames: Optional[list[str]] = None
    templates: Optional[list[str]] = None

    def val_loader(self, transform, world: World, batch_size: int):
        """(images, labels) batches of this rank's share (every world_size-th sample) of the validation shards.
        Only the image and `cls` members are decoded (clipscale.data.members); the set is ours, so a
        sample that does not decode is an error, not a skip."""
        samples = wds.WebDataset(self.val_shards, shardshuffle=False, nodesplitter=None, empty_check=False)
        mine = (s for i, s in enumerate(samples) if i % world.world_size == world.rank)
        batch_images, batch_labels = [], []
        for sample in mine:
            with open_image(sample[first_member(sample, IMAGE_KEYS)]) as image:
                batch_images.append(transform(image.convert("RGB")))
            batch_labels.append(decode_label(sample["cls"]))
            if len(batch_images) == batch_size:
                yield torch.stack(batch_images), torch.tensor(batch_labels)
                batch_images, batch_labels = [], []
        if batch_images:
            yield torch.stack(batch_images), torch.tensor(batch_labels)


DIGITS_IMAGE_SIZE = 32  # data.image_size's value for digits when unset


def local_shards(pattern: str, key: str) -> list[str]:
    """The shards a brace pattern names (several joined with "::"); a ConfigError when a local one
    is missing. `pipe:` commands and URLs are passed through to webdataset; http(s) needs curl,
    which webdataset opens them with."""
    shards = wds.shardlists.expand_urls(pattern)
    remote = [s for s in shards if "://" in s or s.startswith("pipe:")]
    missing = [s for s in shards if s not in remote and not Path(s).is_file()]
    if missing:
        which = "no file" if len(missing) == len(shards) else f"{len(missing)} missing files of {len(shards)}"
        raise ConfigError(f"{key}: {pattern!r} matches {which} (first missing: {missing[0]})")
    if any(s.startswith(("http://", "https://")) for s in remote) and shutil.which("curl") is None:
        raise ConfigError(f"{key}: webdataset reads http(s) shards with curl, which is not installed")
    return shards


def data_source(cfg: DataConfig, pattern: str, key: str, csv: bool, sampling: bool = True) -> ShardSource:
    """The shards (or CSV rows) `pattern` names, read with data.*'s keys; drawn as data.* says
    (`sampling`), or each read once in order (a validation set)."""
    factors = cfg.upsampling_factors if sampling else None
    sampling = {"resampled": cfg.resampled and sampling}
    if csv:
        tables = [read_rows(path, cfg.csv_image_key, cfg.csv_caption_key, cfg.csv_separator, key)
                  for path in pattern.split("::")]
        return CsvTable(tables, factors=factors, **sampling)
    sources = [local_shards(part, key) for part in pattern.split("::")]
    return ShardSource([shard for shards in sources for shard in shards], image_keys=keys(cfg.image_key),
                       caption_keys=keys(cfg.caption_key), weights=shard_weights(sources, factors),
                       **sampling)


def prepare_data(cfg: DataConfig, world: World) -> PreparedData:
    if cfg.kind in ("webdataset", "csv"):
        source = data_source(cfg, cfg.train_shards, "data.train_shards", csv=cfg.kind == "csv")
        return PreparedData(train_shards=source, num_train=len(source.rows) if cfg.kind == "csv" else 0)
    image_size = cfg.image_size or DIGITS_IMAGE_SIZE
    if world.is_main:  # one writer; the others wait for the manifest
        write_digits_shards(cfg.root, image_size)
    if dist.is_initialized():
        dist.barrier()
    manifest = write_digits_shards(cfg.root, image_size)
    root = Path(cfg.root)
    return PreparedData(
        train_shards=[str(root / name) for name in manifest["train_shards"]],
        num_train=manifest["num_train"],
        val_shards=[str(root / name) for name in manifest["val_shards"]],
        classnames=manifest["classnames"],
        templates=manifest["templates"],
    )
