"""Evaluation data: ImageFolder directories, webdataset shards, COCO-style caption JSON, CSV tables.

Classification sets yield (image, label); retrieval sets yield
(image, [caption, ...]); both batch with `collate_samples`, which keeps the
caption lists intact (the default collate would transpose them).

A sample that cannot be used (an image that does not decode or is over PIL's pixel bound, a
missing member, an empty caption) is yielded as `Skipped` (where it is and why), as training
skips it; `collate_samples` puts a batch's skipped samples beside its images and targets, and the
evaluation counts them (`num_skipped`) and names the first few (`Skips`). A missing file is not a
sample to skip: `clipscale.eval.tasks.check_data` names it before any work.

Shards are read as bytes and only the members used are decoded, by explicit decoders
(`clipscale.data.sources`): a shard's other members (pickles, torch or numpy files) are
never loaded. Folder and COCO images open only as the image formats ImageFolder lists. Retrieval reads captions from the members training reads them from.

Distributed evaluation: a map-style set is cut into one contiguous block per
rank (`rank_shard`), so concatenating the ranks' results in rank order gives
the dataset order; shards are split across ranks (and loader workers) by
webdataset, one shard to one reader.
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator, Optional

import torch
import torch.distributed as dist
import torchvision
import webdataset as wds
from PIL import Image, UnidentifiedImageError

from clipscale.data.sources import (DATA_ERRORS, FOLDER_FORMATS, IMAGE_KEYS, TEXT_KEYS, ImageTooLarge, decode_label, decode_text,
                                    first_member, open_image)
from clipscale.distributed import is_distributed
from clipscale.worker_server import worker_context


@dataclass(frozen=True)
class Skipped:
    """A sample an evaluation leaves out: where it is (a file, or a shard and key) and why."""

    where: str
    reason: str


def reason_of(err: BaseException) -> str:
    """Why a sample is unusable, in a few words: the error's type and message, on one line."""
    if isinstance(err, UnidentifiedImageError):  # PIL's message names only a BytesIO object
        return f"{type(err).__name__}: not an image of the formats read here, or cut short before its size"
    message = " ".join(str(err).split())
    return f"{type(err).__name__}: {message}" if message else type(err).__name__


class NoUsableSample(ValueError):
    """An evaluation whose every sample was skipped (`clipscale.eval.tasks.run_task` names the task's data)."""


class Skips:
    """The samples an evaluation skipped on this rank: how many, and the first `shown` of them."""

    def __init__(self, shown: int = 3):
        self.shown = shown
        self.count = 0
        self.first: list[Skipped] = []

    def add(self, skipped) -> None:
        for item in skipped:
            self.count += 1
            if len(self.first) < self.shown:
                self.first.append(item)

    def summary(self) -> str:
        """'2 samples skipped (a.png: OSError: ...; b.png: ...)'."""
        listed = "; ".join(f"{s.where}: {s.reason}" for s in self.first)
        more = f"; and {self.count - len(self.first)} more" if self.count > len(self.first) else ""
        return f"{self.count} sample{'' if self.count == 1 else 's'} skipped ({listed}{more})"


def usable_batches(batches: Iterable, skips: Skips) -> Iterator[tuple]:
    """(images, targets) of each batch that kept a sample, its skipped samples added to `skips`: a
    batch is `collate_samples`' three (images, targets, skipped), or any other loader's two."""
    for images, targets, *rest in batches:
        skips.add(rest[0] if rest else [])
        if len(images):
            yield images, targets


class LabelledFolder(torchvision.datasets.ImageFolder):
    """ImageFolder whose folder -> label assignment can be given instead of sorted order.

    folder_labels: {folder name: label}; only these folders are read (ObjectNet
    keeps 113 of its 313). numeric_folders: the folder names are the labels
    ("0" ... "999" in ImageNet-V2, where sorted order would put "10" before "2").
    """

    def __init__(self, root, transform, folder_labels: Optional[dict] = None, numeric_folders: bool = False):
        self.folder_labels = folder_labels
        self.numeric_folders = numeric_folders
        super().__init__(root, transform=transform, loader=load_image_file)

    def __getitem__(self, index):
        path, target = self.samples[index]
        try:
            image = load_image_file(path)
        except DATA_ERRORS as err:
            return Skipped(path, reason_of(err))
        return self.transform(image), target

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


class ListedImages(torch.utils.data.Dataset):
    """(transformed image, target) of a list of (image path, target): a CSV table's rows, a caption JSON's
    images; `Skipped` for an image that does not decode, or a retrieval image without a caption (an
    empty list of them: a table's rows whose captions are all empty, which training skips too)."""

    def __init__(self, items: list[tuple[str, object]], transform: Callable):
        self.items = items
        self.transform = transform

    def __len__(self):
        return len(self.items)

    def __getitem__(self, index):
        path, target = self.items[index]
        if isinstance(target, list) and not target:
            return Skipped(path, "an empty caption")
        try:
            image = load_image_file(path)
        except DATA_ERRORS as err:
            return Skipped(path, reason_of(err))
        return self.transform(image), target


class CaptionedImages(ListedImages):
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
            items = [
                (os.path.join(entry.get("filepath", ""), entry["filename"]),
                 [s["raw"].strip() for s in entry["sentences"] if s["raw"].strip()])
                for entry in data["images"]
                if entry.get("split") == split
            ]
        else:
            items = [(entry["image"], _caption_list(entry["caption"])) for entry in data]
        if not items:
            raise ValueError(f"{annotations}: no images" + (f" in split {split!r}" if isinstance(data, dict) else ""))
        super().__init__([(str(Path(image_root) / path), captions) for path, captions in items], transform)


def load_image_file(path) -> Image.Image:
    """An evaluation folder's image as RGB, opened only as one of the formats ImageFolder lists (never
    as one PIL hands to another program: EPS runs Ghostscript); over PIL's pixel bound, refused."""
    try:
        with open_image(Path(path).read_bytes(), formats=FOLDER_FORMATS) as image:
            return image.convert("RGB")
    except ImageTooLarge as err:
        raise ImageTooLarge(f"{path}: {err}") from None


def shard_classification(urls, transform: Callable) -> wds.WebDataset:
    """(image, label) from shards with an image member and a `cls` member (an integer)."""
    return _shards(urls).compose(DecodedSamples(transform, _label))


def shard_retrieval(urls, transform: Callable) -> wds.WebDataset:
    """(image, captions) from shards with an image member and captions (see `_captions`)."""
    return _shards(urls).compose(DecodedSamples(transform, _captions))


def _shards(urls) -> wds.WebDataset:
    # In order, no shuffling; each shard is read by exactly one rank and one worker. No `.decode`:
    # members stay bytes, and DecodedSamples decodes only those it uses (clipscale.data.sources).
    return wds.WebDataset(
        urls, shardshuffle=False, nodesplitter=wds.split_by_node, workersplitter=wds.split_by_worker, empty_check=False
    )


class DecodedSamples:
    """A webdataset stage from raw samples to (transformed image, target(sample)), or `Skipped`
    (naming its shard and key, and why) for a sample that training would skip too: an image that
    does not decode or whose header claims more pixels than PIL's bound (Image.MAX_IMAGE_PIXELS),
    a missing member, an empty caption. The evaluation counts them (`num_skipped`)."""

    def __init__(self, transform: Callable, target: Callable[[dict], object]):
        self.transform = transform
        self.target = target

    def __call__(self, samples):
        for sample in samples:
            image_key = first_member(sample, IMAGE_KEYS)
            try:
                if image_key is None:
                    raise MissingMember(f"no image member ({', '.join(IMAGE_KEYS)})")
                target = self.target(sample)
                with open_image(sample[image_key]) as image:
                    rgb = image.convert("RGB")  # PIL decodes here
            except DATA_ERRORS as err:  # ImageTooLarge and MissingMember are ValueErrors
                where = _where(sample) + (f".{image_key}" if image_key and not isinstance(err, MissingMember) else "")
                yield Skipped(where, str(err) if isinstance(err, (MissingMember, ImageTooLarge)) else reason_of(err))
                continue
            yield self.transform(rgb), target


class MissingMember(ValueError):
    """A shard sample without a member that the evaluation reads, or with an empty one."""


def _where(sample: dict) -> str:
    return f"{sample.get('__url__')}: sample {sample.get('__key__')}"


def _label(sample: dict) -> int:
    if "cls" not in sample:
        raise MissingMember("no class label (a `cls` member)")
    return decode_label(sample["cls"])


def _captions(sample: dict) -> list[str]:
    """The captions of a retrieval sample: training's caption member (TEXT_KEYS, the first found),
    one caption per line (CLIP_benchmark's retrieval shards put an image's captions in `txt`,
    one a line); else a `json` member holding a list of strings. Any other `json` (img2dataset
    writes a metadata dict there) is not a caption."""
    text_key = first_member(sample, TEXT_KEYS)
    if text_key is not None:
        captions = [line.strip() for line in decode_text(sample[text_key]).splitlines() if line.strip()]
    elif "json" in sample:
        captions = json.loads(sample["json"])
        if not (isinstance(captions, list) and all(isinstance(c, str) for c in captions)):
            raise MissingMember(f"no caption member ({', '.join(TEXT_KEYS)}) and its json is not a list of caption strings")
        captions = [c.strip() for c in captions if c.strip()]
    else:
        raise MissingMember(f"no caption member ({', '.join(TEXT_KEYS)}, or json: a list of strings)")
    if not captions:
        raise MissingMember("an empty caption")
    return captions


def _caption_list(captions) -> list[str]:
    """A caption JSON entry's captions, the empty ones left out (an image without any is skipped)."""
    if isinstance(captions, str):
        captions = [captions]
    return [str(c).strip() for c in captions if str(c).strip()]


def collate_samples(batch):
    """(images stacked, their targets as a list, the batch's `Skipped` samples); a batch whose every
    sample was skipped has no images (an empty tensor)."""
    kept = [item for item in batch if not isinstance(item, Skipped)]
    skipped = [item for item in batch if isinstance(item, Skipped)]
    images = torch.stack([image for image, _ in kept]) if kept else torch.empty(0)
    return images, [target for _, target in kept], skipped


collate_captions = collate_samples  # retrieval's name for it: caption lists stay one list per image


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


def make_loader(dataset, batch_size: int, workers: int, collate_fn=collate_samples) -> torch.utils.data.DataLoader:
    return torch.utils.data.DataLoader(
        dataset,
        batch_size=batch_size,
        num_workers=workers,
        collate_fn=collate_fn or collate_samples,
        pin_memory=torch.cuda.is_available(),
        persistent_workers=False,
        multiprocessing_context=worker_context() if workers else None,  # not forked from the trainer's threads
    )
