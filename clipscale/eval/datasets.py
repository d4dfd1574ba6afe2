"""Evaluation data: ImageFolder directories, webdataset shards, COCO-style caption JSON.

Classification sets yield (image, label); retrieval sets yield
(image, [caption, ...]) and batch with `collate_captions`, which keeps the
caption lists intact (the default collate would transpose them).

Distributed evaluation: a map-style set is cut into one contiguous block per
rank (`rank_shard`), so concatenating the ranks' results in rank order gives
the dataset order; shards are split across ranks (and loader workers) by
webdataset, one shard to one reader.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.distributed as dist
import torchvision
import webdataset as wds
from PIL import Image

from clipscale.distributed import is_distributed

IMAGE_KEYS = "jpg;jpeg;png;webp"
CAPTION_KEYS = "json;txt"


class LabelledFolder(torchvision.datasets.ImageFolder):
    """ImageFolder whose folder -> label assignment can be given instead of sorted order.

    folder_labels: {folder name: label}; only these folders are read (ObjectNet
    keeps 113 of its 313). numeric_folders: the folder names are the labels
    ("0" ... "999" in ImageNet-V2, where sorted order would put "10" before "2").
    """

    def __init__(self, root, transform, folder_labels: Optional[dict] = None, numeric_folders: bool = False):
        self.folder_labels = folder_labels
        self.numeric_folders = numeric_folders
        super().__init__(root, transform=transform)

    def find_classes(self, directory):
        folders = sorted(entry.name for entry in os.scandir(directory) if entry.is_dir())
        if self.folder_labels is not None:
            missing = sorted(set(self.folder_labels) - set(folders))
            if missing:
                raise FileNotFoundError(f"{directory}: class folders {missing[:5]} (of {len(missing)}) are missing")
            mapping = dict(self.folder_labels)
        elif self.numeric_folders:
            mapping = {name: int(name) for name in folders}
        else:
            mapping = {name: i for i, name in enumerate(folders)}
        return list(mapping), mapping


class CaptionedImages(torch.utils.data.Dataset):
    """COCO/Flickr Karpathy-style retrieval set: images with several captions each.

    Reads either Karpathy's own file ({"images": [{"filepath", "filename",
    "split", "sentences": [{"raw"}]}]}, filtered to `split`) or the flat list
    used by CLIP_benchmark and BLIP ([{"image": path, "caption": [...]}]).
    Image paths are relative to `image_root`.
    """

    def __init__(self, annotations: str, image_root: str, transform: Callable, split: str = "test"):
        with open(annotations) as f:
            data = json.load(f)
        if isinstance(data, dict):
            self.items = [
                (os.path.join(entry.get("filepath", ""), entry["filename"]), [s["raw"].strip() for s in entry["sentences"]])
                for entry in data["images"]
                if entry.get("split") == split
            ]
        else:
            self.items = [(entry["image"], _caption_list(entry["caption"])) for entry in data]
        if not self.items:
            raise ValueError(f"{annotations}: no images" + (f" in split {split!r}" if isinstance(data, dict) else ""))
        self.image_root = Path(image_root)
        self.transform = transform

    def __len__(self):
        return len(self.items)

    def __getitem__(self, index):
        path, captions = self.items[index]
        with Image.open(self.image_root / path) as image:
            return self.transform(image.convert("RGB")), captions


def shard_classification(urls, transform: Callable) -> wds.WebDataset:
    """(image, label) from shards with an image key and a `cls` key."""
    return _shards(urls).to_tuple(IMAGE_KEYS, "cls").map_tuple(transform, int)


def shard_retrieval(urls, transform: Callable) -> wds.WebDataset:
    """(image, captions) from shards with an image key and `json` (a caption list) or `txt`."""
    return _shards(urls).to_tuple(IMAGE_KEYS, CAPTION_KEYS).map_tuple(transform, _caption_list)


def _shards(urls) -> wds.WebDataset:
    # In order, no shuffling; each shard is read by exactly one rank and one worker.
    return wds.WebDataset(
        urls, shardshuffle=False, nodesplitter=wds.split_by_node, workersplitter=wds.split_by_worker, empty_check=False
    ).decode("pil")


def _caption_list(captions) -> list[str]:
    if isinstance(captions, bytes):
        captions = captions.decode("utf-8")
    if isinstance(captions, str):
        return [captions.strip()]
    return [str(c).strip() for c in captions]


def collate_captions(batch):
    images, captions = zip(*batch)
    return torch.stack(images), list(captions)


def rank_shard(dataset: torch.utils.data.Dataset) -> torch.utils.data.Dataset:
    """This rank's contiguous block of a map-style set (the whole set outside torch.distributed).

    Unlike DistributedSampler nothing is padded or repeated, so counts summed
    over ranks are exactly the single-process counts.
    """
    if not is_distributed():
        return dataset
    rank, world = dist.get_rank(), dist.get_world_size()
    n = len(dataset)
    return torch.utils.data.Subset(dataset, range(rank * n // world, (rank + 1) * n // world))


def make_loader(dataset, batch_size: int, workers: int, collate_fn=None) -> torch.utils.data.DataLoader:
    return torch.utils.data.DataLoader(
        dataset,
        batch_size=batch_size,
        num_workers=workers,
        collate_fn=collate_fn,
        pin_memory=torch.cuda.is_available(),
        persistent_workers=False,
    )
