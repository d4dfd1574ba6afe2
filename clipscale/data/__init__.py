"""Training and evaluation data: the embedded digits or user webdataset shards."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist
import webdataset as wds

from clipscale.config import DataConfig
from clipscale.data.digits import write_digits_shards
from clipscale.distributed import World


@dataclass
class PreparedData:
    train_shards: list[str]
    num_train: int
    val_shards: list[str] = field(default_factory=list)
    classnames: Optional[list[str]] = None
    templates: Optional[list[str]] = None

    def val_loader(self, transform, world: World, batch_size: int):
        """(images, labels) batches of this rank's share (every world_size-th sample) of the validation shards."""
        samples = (
            wds.WebDataset(self.val_shards, shardshuffle=False, nodesplitter=None, empty_check=False)
            .decode("pil")
            .to_tuple("png;jpg;jpeg;webp", "cls")
        )
        mine = (s for i, s in enumerate(samples) if i % world.world_size == world.rank)
        batch_images, batch_labels = [], []
        for image, label in mine:
            batch_images.append(transform(image))
            batch_labels.append(int(label))
            if len(batch_images) == batch_size:
                yield torch.stack(batch_images), torch.tensor(batch_labels)
                batch_images, batch_labels = [], []
        if batch_images:
            yield torch.stack(batch_images), torch.tensor(batch_labels)


def prepare_data(cfg: DataConfig, world: World) -> PreparedData:
    if cfg.kind == "webdataset":
        return PreparedData(train_shards=wds.shardlists.expand_urls(cfg.train_shards), num_train=0)
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
