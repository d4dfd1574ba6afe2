"""A model whose features are rigged, so that every metric is known exactly, and pictures for it.

RiggedModel: an image's feature is its per-channel mean (so a [B, d, 1, 1] tensor is its own
feature vector, and a solid-colour picture's feature is its RGB colour); a text's feature is
looked up in a table by the exact string. The retrieval case's expected recalls are worked out
by hand in the comments.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from PIL import Image
from torchvision.transforms import ToTensor

from clipscale.eval.tasks import run_task


class RiggedModel(nn.Module):
    def __init__(self, text_features: dict[str, list[float]]):
        super().__init__()
        self.texts = list(text_features)
        self.register_buffer("table", torch.tensor(list(text_features.values()), dtype=torch.float32))

    def tokenize(self, texts: list[str]) -> torch.Tensor:
        return torch.tensor([self.texts.index(t) for t in texts], dtype=torch.long)

    def encode_image(self, images, normalize=False):
        return images.float().flatten(2).mean(dim=2)

    def encode_text(self, tokens, normalize=False):
        return self.table[tokens]


def as_images(features) -> torch.Tensor:
    return torch.tensor(features, dtype=torch.float32)[:, :, None, None]


def one_hot(i: int, d: int) -> list[float]:
    return [float(j == i) for j in range(d)]


# ---- classification ---------------------------------------------------------------------

CLASSES = ["c0", "c1", "c2", "c3", "c4", "c5"]


def tied_classifier_model() -> RiggedModel:
    # Class c has direction e_c, except c5 which shares c4's direction: an exact tie.
    # "a {c}" and "the {c}" point the same way (different lengths), so the class mean is unchanged.
    texts = {}
    for c, name in enumerate(CLASSES):
        direction = one_hot(min(c, 4), 6)
        texts[f"a {name}"] = direction
        texts[f"the {name}"] = [3 * x for x in direction]
    return RiggedModel(texts)


# ---- retrieval --------------------------------------------------------------------------

RETRIEVAL_IMAGES = [one_hot(0, 4), one_hot(1, 4), one_hot(2, 4), one_hot(0, 4)]  # image 3 duplicates image 0
RETRIEVAL_CAPTIONS = [["a", "b"], ["c", "d", "e"], ["f"], ["g", "h"]]  # 8 captions for 4 images
CAPTION_FEATURES = {
    "a": one_hot(0, 4), "b": one_hot(1, 4), "c": one_hot(2, 4), "d": one_hot(3, 4),
    "e": one_hot(1, 4), "f": one_hot(3, 4), "g": one_hot(0, 4), "h": [1.0, 1.0, 0.0, 0.0],
}  # fmt: skip


# Text -> image, rank of each caption's own image (ties to the lower image index):
#   a: img0 = img3 = 1, img0 wins -> 0     b: img1 ahead -> 1       c: img2 ahead, img0 tied lower -> 2
#   d: all 0, img0 lower -> 1              e: -> 0                  f: all 0, img0, img1 lower -> 2
#   g: img0 tied lower -> 1                h: img0, img1 tied lower -> 2
# recall@1 = 2/8, recall@5 = recall@10 = 1 (only 4 images).
# Image -> text, rank of the image's best caption (ties to the lower caption index):
#   img0: a (1), nothing ahead -> 0        img1: e (1), b tied lower -> 1
#   img2: f (0), c greater, a b d e tied lower -> 5      img3: g (1), a tied lower -> 1
# recall@1 = 1/4, recall@5 = 3/4, recall@10 = 4/4.
EXPECTED_RETRIEVAL = {
    "image_retrieval_recall@1": 2 / 8, "image_retrieval_recall@5": 1.0, "image_retrieval_recall@10": 1.0,
    "text_retrieval_recall@1": 1 / 4, "text_retrieval_recall@5": 3 / 4, "text_retrieval_recall@10": 1.0,
    "num_samples": 4, "num_skipped": 0,
}  # fmt: skip


def retrieval_model() -> RiggedModel:
    return RiggedModel(CAPTION_FEATURES)


# ---- solid-colour pictures: an image's feature is its RGB colour --------------------------

COLOURS = {"red": (255, 0, 0), "green": (0, 255, 0), "blue": (0, 0, 255), "purple": (255, 0, 255), "yellow": (255, 255, 0)}
FEATURE = {"red": [1.0, 0.0, 0.0], "green": [0.0, 1.0, 0.0], "blue": [0.0, 0.0, 1.0]}


def picture(path, colour: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", (4, 4), COLOURS[colour]).save(path)


def png_bytes(colour: str, tmp_path) -> bytes:
    path = tmp_path / "tmp.png"
    picture(path, colour)
    return path.read_bytes()


def write_lines(path, lines) -> str:
    path.write_text("\n".join(str(line) for line in lines) + "\n")
    return str(path)


def evaluate(task, model):
    return run_task(task, model, model.tokenize, ToTensor(), "cpu", batch_size=3, workers=0, progress=False)


def caption_model() -> RiggedModel:
    # The fourth feature dimension (no image has it) becomes the zero vector: scores 0 with every image.
    return RiggedModel({caption: feature[:3] for caption, feature in CAPTION_FEATURES.items()})
