"""Agreement with an independent implementation: the clip-benchmark package (PyPI).

Same tiny open_clip model, same data, same loaders: our metrics must equal
CLIP_benchmark's. Random-noise pictures and distinct captions keep exact score
ties (where the two tie rules may differ) out of the comparison. Skipped when
clip-benchmark is not installed: it is a test-only dependency
(`pip install --no-deps clip-benchmark`).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image
from sklearn.metrics import balanced_accuracy_score

from clipscale.config import ModelConfig
from clipscale.eval import evaluate_retrieval, evaluate_zeroshot, zeroshot_classifier
from clipscale.eval.datasets import CaptionedImages, LabelledFolder, collate_samples, make_loader
from clipscale.models import build_model
from tests.helpers.towers import TINY_CLIP

zeroshot_classification = pytest.importorskip("clip_benchmark.metrics.zeroshot_classification")
zeroshot_retrieval = pytest.importorskip("clip_benchmark.metrics.zeroshot_retrieval")

CLASSES = ["apple", "boat", "cloud", "dog", "engine", "forest", "guitar"]
TEMPLATES = ["a photo of a {c}.", "a drawing of the {c}."]


def noise_picture(path, rng) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)).save(path)


@pytest.fixture(scope="module")
def towers():
    torch.manual_seed(0)
    return build_model(ModelConfig(custom=TINY_CLIP))


def pairs(batch):
    """(images, targets): CLIP_benchmark's loaders give pairs (ours add the skipped samples, none here)."""
    images, targets, skipped = collate_samples(batch)
    assert skipped == []
    return images, (torch.tensor(targets) if isinstance(targets[0], int) else targets)


def test_zeroshot_classification_agrees(tmp_path, towers):
    rng = np.random.default_rng(0)
    for i in range(42):
        noise_picture(tmp_path / CLASSES[i % len(CLASSES)] / f"{i}.png", rng)
    dataset = LabelledFolder(tmp_path, towers.val_transform)
    loader = make_loader(dataset, batch_size=8, workers=0, collate_fn=pairs)
    model, tokenizer = towers.model, towers.tokenizer

    # Their `evaluate` ends in `float(array of shape (1,))`, which numpy 2 rejects; run its two
    # steps and its final formulas (topk hits / n, sklearn balanced accuracy) instead.
    their_classifier = zeroshot_classification.zero_shot_classifier(model, tokenizer, CLASSES, TEMPLATES, "cpu", amp=False)
    logits, target = zeroshot_classification.run_classification(model, their_classifier, loader, "cpu", amp=False)
    top5 = logits.topk(5, dim=1).indices == target[:, None]
    theirs = {
        "acc1": top5[:, 0].sum().item() / len(target),
        "acc5": top5.any(dim=1).sum().item() / len(target),
        "mean_per_class_recall": balanced_accuracy_score(target, logits.argmax(dim=1)),
    }
    classifier = zeroshot_classifier(model, tokenizer, CLASSES, TEMPLATES, "cpu")
    ours = evaluate_zeroshot(model, classifier, loader, "cpu", progress=False)
    assert torch.allclose(classifier, their_classifier, atol=1e-6)
    assert ours["acc1"] == theirs["acc1"] and ours["acc5"] == theirs["acc5"]
    assert ours["mean_per_class_recall"] == pytest.approx(theirs["mean_per_class_recall"], abs=1e-12)
    assert 0 < ours["acc5"] < 1  # a comparison that could fail


def test_retrieval_agrees(tmp_path, towers):
    rng = np.random.default_rng(1)
    words = ["red", "small", "old", "wet", "loud", "bright", "quiet", "round", "tall", "soft", "dark", "fast"]
    entries = []
    for i in range(24):
        noise_picture(tmp_path / f"{i}.png", rng)
        captions = [f"a {words[i % 12]} {noun} number {i}" for noun in ("cat", "car", "tree")[: 1 + i % 3]]
        entries.append({"image": f"{i}.png", "caption": captions})
    (tmp_path / "captions.json").write_text(json.dumps(entries))
    loader = make_loader(CaptionedImages(str(tmp_path / "captions.json"), str(tmp_path), towers.val_transform), 5, 0, pairs)

    theirs = zeroshot_retrieval.evaluate(towers.model, loader, towers.tokenizer, "cpu", amp=False, recall_k_list=[1, 5, 10])
    ours = evaluate_retrieval(towers.model, towers.tokenizer, loader, "cpu", progress=False)
    assert {k: v for k, v in ours.items() if k in theirs} == pytest.approx(theirs, abs=1e-6)  # theirs: float32 means
    assert (ours["num_samples"], ours["num_skipped"]) == (24, 0)
    assert 0 < ours["text_retrieval_recall@5"] < 1 and 0 < ours["image_retrieval_recall@5"] < 1
