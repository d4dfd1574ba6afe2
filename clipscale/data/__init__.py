"""Training data: the embedded digits, or the user's webdataset shards or CSV table. (The digits' held-out
set is an evaluation task, clipscale.eval.tasks.digits_task.)"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path
import torch.distributed as dist
import webdataset as wds

from clipscale.config import ConfigError, DataConfig
from clipscale.data.csv_table import CsvTable, read_rows
from clipscale.data.digits import write_digits_shards
from clipscale.data.sources import ShardSource, keys, shard_weights
from clipscale.distributed import World


@dataclass
class PreparedData:
    train_shards: list[str] | ShardSource  # what ShardStream reads
    num_train: int


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
    )
