"""The embedded dataset: scikit-learn's handwritten digits as webdataset shards.

`sklearn.datasets.load_digits` ships 1,797 8x8 grey images of the digits 0-9
inside the package, so a first run needs no download. `write_digits_shards`
splits them once (seeded, stratified) into train and validation, upscales each
image to a small RGB PNG and pairs every training image with a caption drawn
from varied templates. The validation split is only ever seen by zero-shot
evaluation, whose prompts (`ZEROSHOT_TEMPLATES`) differ from every training
caption template.
"""

from __future__ import annotations

import io
import json
import random
import tempfile
from pathlib import Path

import numpy as np
import webdataset as wds
from PIL import Image

from clipscale.config import ConfigError

CLASSNAMES = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")

# Training captions: the class appears as a word or a numeral in varied phrasing.
CAPTION_TEMPLATES = (
    "a handwritten {word}",
    "the digit {numeral} written by hand",
    "a scan of a handwritten {word}",
    "{word}, drawn with a pen",
    "a small grey image of the number {word}",
    "someone wrote the number {numeral}",
    "a blurry {word} on paper",
    "the numeral {word}",
    "a pixelated {numeral}",
    "handwriting of the digit {word}",
)

# Zero-shot prompts: phrasing never used in training captions.
ZEROSHOT_TEMPLATES = (
    "a photo of the number {c}.",
    "an image showing a {c}.",
    "a picture of {c}.",
    "{c}.",
)

TRAIN_FRACTION = 0.8
SPLIT_SEED = 1234
IMAGES_PER_SHARD = 180


def _to_png(pixels: np.ndarray, size: int) -> bytes:
    """8x8 values 0..16 -> size x size RGB PNG, white digit on black as in the source."""
    grey = Image.fromarray((pixels * (255.0 / 16.0)).astype(np.uint8), mode="L")
    rgb = grey.resize((size, size), Image.BILINEAR).convert("RGB")
    buffer = io.BytesIO()
    rgb.save(buffer, format="PNG")
    return buffer.getvalue()


def _split(labels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Stratified, seeded train/validation indices: each class split 80/20."""
    rng = np.random.default_rng(SPLIT_SEED)
    train, val = [], []
    for cls in range(len(CLASSNAMES)):
        idx = rng.permutation(np.flatnonzero(labels == cls))
        cut = int(round(TRAIN_FRACTION * len(idx)))
        train.extend(idx[:cut])
        val.extend(idx[cut:])
    return rng.permutation(train), np.sort(val)


def _write_split(directory: Path, prefix: str, indices, images, labels, size: int, captions: bool) -> list[str]:
    rng = random.Random(SPLIT_SEED)
    pattern = str(directory / f"{prefix}-%04d.tar")
    with wds.ShardWriter(pattern, maxcount=IMAGES_PER_SHARD, verbose=0) as sink:
        for i in indices:
            label = int(labels[i])
            sample = {"__key__": f"digit{i:05d}", "png": _to_png(images[i], size), "cls": label}
            if captions:
                template = rng.choice(CAPTION_TEMPLATES)
                sample["txt"] = template.format(word=CLASSNAMES[label], numeral=label)
            sink.write(sample)
    return sorted(p.name for p in directory.glob(f"{prefix}-*.tar"))


def write_digits_shards(root: str | Path, image_size: int) -> dict:
    """Write the shards under `root` once; later calls reuse them. Returns the manifest."""
    root = Path(root)
    manifest_path = root / "manifest.json"
    if manifest_path.exists():
        manifest = json.loads(manifest_path.read_text())
        if manifest["image_size"] == image_size:
            return manifest
        raise ConfigError(
            f"data.root: {root} holds digits shards of image size {manifest['image_size']}, not {image_size}: "
            "choose another data.root or delete the folder"
        )
    from sklearn.datasets import load_digits

    digits = load_digits()
    train_idx, val_idx = _split(digits.target)
    root.mkdir(parents=True, exist_ok=True)
    # Written aside, then moved: an interrupted write is never read, and jobs that start together
    # on one root each write their own (identical) copy and the last move wins.
    partial = Path(tempfile.mkdtemp(prefix=".partial-", dir=root))
    train = _write_split(partial, "train", train_idx, digits.images, digits.target, image_size, captions=True)
    val = _write_split(partial, "val", val_idx, digits.images, digits.target, image_size, captions=False)
    for name in train + val:
        (partial / name).replace(root / name)
    manifest = {
        "image_size": image_size,
        "train_shards": train,
        "val_shards": val,
        "num_train": len(train_idx),
        "num_val": len(val_idx),
        "classnames": CLASSNAMES,
        "templates": ZEROSHOT_TEMPLATES,
    }
    # So scripts/eval_zeroshot.py can evaluate the same split: --task wds --classnames ... --templates ...
    (partial / "classnames.txt").write_text("\n".join(CLASSNAMES) + "\n")
    (partial / "templates.txt").write_text("\n".join(ZEROSHOT_TEMPLATES) + "\n")
    (partial / "manifest.json").write_text(json.dumps(manifest, indent=1))
    for name in ("classnames.txt", "templates.txt", "manifest.json"):  # the manifest last: it marks the shards done
        (partial / name).replace(root / name)
    partial.rmdir()
    print(f"wrote the digits shards to {root}: {len(train_idx)} training images in {len(train)} shards, "
          f"{len(val_idx)} held out in {len(val)}", flush=True)
    return manifest
