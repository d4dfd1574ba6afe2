"""Training data as users have it, written for a test: img2dataset shards and CSV tables."""

from __future__ import annotations

import io
import json
from pathlib import Path

import torch
import webdataset as wds
from PIL import Image


def seeded_noise(size: tuple[int, int], sigma: float, seed: int) -> Image.Image:
    """Grey Gaussian noise around 128, as PIL's `Image.effect_noise(size, sigma)` draws it, but from a
    seeded generator: effect_noise uses the C library's unseeded one, so its images (and their
    encoded sizes) change from one process to the next, and a failure would not come back."""
    width, height = size
    grey = 128 + sigma * torch.randn(height, width, generator=torch.Generator().manual_seed(seed))
    return Image.fromarray(grey.round().clamp(0, 255).to(torch.uint8).numpy(), "L").convert("RGB")


def noise_image(index: int, fmt: str = "JPEG") -> bytes:
    buffer = io.BytesIO()
    seeded_noise((24, 24), 20 + index % 70, seed=index).save(buffer, fmt)
    return buffer.getvalue()


def write_img2dataset_shards(folder: Path, shards: int, per_shard: int, prefix: str = "", image_key: str = "jpg",
                             caption_key: str = "txt") -> str:
    """Shards in img2dataset's layout: KEY.jpg, KEY.txt and KEY.json (metadata whose values are
    not the caption); returns their brace pattern. Captions: '<prefix>caption <i>'."""
    folder.mkdir(parents=True, exist_ok=True)
    for s in range(shards):
        with wds.TarWriter(str(folder / f"{s:05d}.tar")) as sink:
            for j in range(per_shard):
                i = s * per_shard + j
                key = f"{s:05d}{j:04d}"
                metadata = {"key": key, "status": "success", "caption": "not the caption", "width": 24, "height": 24}
                sink.write({"__key__": key, image_key: noise_image(i), caption_key: f"{prefix}caption {i}".encode(),
                            "json": json.dumps(metadata).encode()})
    return str(folder / f"{{00000..{shards - 1:05d}}}.tar")


def write_csv(folder: Path, rows: int, separator: str = "\t", image_column="filepath", caption_column="title",
              missing: set = frozenset()) -> Path:
    """A CSV of image paths relative to its folder (images/<i>.png, those in `missing` not written)."""
    (folder / "images").mkdir(parents=True)
    lines = [f"{image_column}{separator}{caption_column}"]
    for i in range(rows):
        if i not in missing:
            (folder / "images" / f"{i}.png").write_bytes(noise_image(i, "PNG"))
        lines.append(f"images/{i}.png{separator}a csv caption {i}")
    path = folder / "train.csv"
    path.write_text("\n".join(lines) + "\n")
    return path
