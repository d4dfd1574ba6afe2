"""Training and evaluation data: the embedded digits or user webdataset shards."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist
import webdataset as wds

from clipscale.config import ConfigError, DataConfig
from clipscale.data.digits import write_digits_shards
from clipscale.data.members import decode_label, first_member, open_image
from clipscale.data.shards import IMAGE_KEYS
from clipscale.distributed import World


@dataclass
class PreparedData:
    train_shards: list[str]
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


def local_shards(pattern: str, key: str) -> list[str]:
    """The shards a brace pattern names; a ConfigError when a local one is missing (URLs and pipes are not checked)."""
    shards = wds.shardlists.expand_urls(pattern)
    missing = [s for s in shards if "://" not in s and not s.startswith("pipe:") and not Path(s).is_file()]
    if missing:
        which = "no file" if len(missing) == len(shards) else f"{len(missing)} missing files of {len(shards)}"
        raise ConfigError(f"{key}: {pattern!r} matches {which} (first missing: {missing[0]})")
    return shards


def prepare_data(cfg: DataConfig, world: World) -> PreparedData:
    if cfg.kind == "webdataset":
        return PreparedData(train_shards=local_shards(cfg.train_shards, "data.train_shards"), num_train=0)
    if world.is_main:  # one writer; the others wait for the manifest
        write_digits_shards(cfg.root, cfg.image_size)
    if dist.is_initialized():
        dist.barrier()
    manifest = write_digits_shards(cfg.root, cfg.image_size)
    root = Path(cfg.root)
    return PreparedData(
        train_shards=[str(root / name) for name in manifest["train_shards"]],
        num_train=manifest["num_train"],
        val_shards=[str(root / name) for name in manifest["val_shards"]],
        classnames=manifest["classnames"],
        templates=manifest["templates"],
    )
