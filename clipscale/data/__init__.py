"""Training data: the embedded digits, or the user's webdataset shards or CSV table. (The digits' held-out
set is an evaluation task, clipscale.eval.tasks.digits_task.)"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
import torch.distributed as dist

from clipscale.config import DataConfig
from clipscale.data.digits import write_digits_shards
from clipscale.data.sources import CsvTable, ShardSource, check_table, count_rows, keys, read_rows, shard_weights, source_shards
from clipscale.distributed import World


@dataclass
class PreparedData:
    train_shards: list[str] | ShardSource  # what ShardStream reads
    num_train: int


DIGITS_IMAGE_SIZE = 32  # data.image_size's value for digits when unset


def data_source(cfg: DataConfig, pattern: str, key: str, csv: bool, sampling: bool = True) -> ShardSource:
    """The shards (or CSV rows) `pattern` names, read with data.*'s keys; drawn as data.* says
    (`sampling`), or each read once in order (a validation set)."""
    factors = cfg.upsampling_factors if sampling else None
    sampling = {"resampled": cfg.resampled and sampling}
    if csv:
        tables = [read_rows(path, *_columns(cfg), key) for path in pattern.split("::")]
        return CsvTable(tables, factors=factors, **sampling)
    sources = [source_shards(part, key) for part in pattern.split("::")]
    return ShardSource([shard for shards in sources for shard in shards], image_keys=keys(cfg.image_key),
                       caption_keys=keys(cfg.caption_key), weights=shard_weights(sources, factors),
                       **sampling)


def check_source(cfg: DataConfig, pattern: str, key: str, csv: bool) -> None:
    """data_source's checks of what `pattern` names, before any work: the shards listed, a CSV
    table's header read (not its rows)."""
    for part in pattern.split("::"):
        if csv:
            check_table(part, *_columns(cfg), key)
        else:
            source_shards(part, key)


def table_rows(cfg: DataConfig, pattern: str, key: str) -> int:
    """The rows of the CSV tables `pattern` names, summed over its "::" sources."""
    return sum(count_rows(path, *_columns(cfg), key) for path in pattern.split("::"))


def _columns(cfg: DataConfig) -> tuple[str, str, str]:
    return cfg.csv_image_key, cfg.csv_caption_key, cfg.csv_separator


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
