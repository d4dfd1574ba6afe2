"""Exact zero-shot and retrieval metrics on a model whose features are rigged.

RiggedModel: an image's feature is its per-channel mean (so a [B, d, 1, 1]
tensor is its own feature vector, and a solid-colour picture's feature is its
RGB colour); a text's feature is looked up in a table by the exact string.
Every expected number is worked out by hand in the comments (the retrieval case's in
tests/helpers/rigged.py).
"""

from __future__ import annotations

import math

import pytest
import torch
from sklearn.metrics import balanced_accuracy_score

from clipscale.eval import evaluate_retrieval, evaluate_zeroshot, zeroshot_classifier
from clipscale.eval.ranking import target_rank
from clipscale.eval.retrieval import recall_metrics

from tests.helpers.rigged import (CLASSES, EXPECTED_RETRIEVAL, RETRIEVAL_CAPTIONS, RETRIEVAL_IMAGES, RiggedModel, as_images,
                                  one_hot, retrieval_model, tied_classifier_model)


# ---- classification ---------------------------------------------------------------------


def test_classifier_is_normalised_mean_of_normalised_prompts_with_both_template_kinds():
    model = RiggedModel({"a x": [1.0, 0.0], "the x": [0.0, 3.0], "a y": [2.0, 0.0], "the y": [4.0, 0.0]})
    classifier = zeroshot_classifier(model, model.tokenize, ["x", "y"], ["a {c}", lambda c: f"the {c}"], "cpu", batch_size=3)
    s = 1 / math.sqrt(2)
    assert torch.allclose(classifier, torch.tensor([[s, 1.0], [s, 0.0]]))


def test_string_template_without_placeholder_is_an_error():
    model = RiggedModel({"x": [1.0]})
    with pytest.raises(ValueError, match="placeholder"):
        zeroshot_classifier(model, model.tokenize, ["x"], ["a photo"], "cpu")


def test_zeroshot_metrics_exact_with_ties():
    model = tied_classifier_model()
    classifier = zeroshot_classifier(model, model.tokenize, CLASSES, ["a {c}", lambda c: f"the {c}"], "cpu")
    # Scores of class c are the image feature's component min(c, 4). Ties go to the lower class index.
    descending = [5, 4, 3, 2, 1, 0]  # order c0 > c1 > c2 > c3 > c4 = c5
    samples = [
        (descending, 0),  # rank 0
        (descending, 4),  # rank 4: top-5 hit, top-1 miss
        (descending, 5),  # rank 5: tied with c4, which wins -> top-5 miss
        (one_hot(4, 6), 5),  # c4 = c5 ahead of the rest; c4 wins the tie -> rank 1
        (one_hot(4, 6), 4),  # rank 0
        ([1] * 6, 3),  # all classes tied -> rank 3 (c0, c1, c2 ahead)
        (one_hot(2, 6), 1),  # c2 greater, c0 tied and lower -> rank 2
    ]
    features, labels = zip(*samples)
    loader = [(as_images(features[:3]), torch.tensor(labels[:3])), (as_images(features[3:]), torch.tensor(labels[3:]))]
    metrics = evaluate_zeroshot(model, classifier, loader, "cpu", progress=False)
    # ranks [0, 4, 5, 1, 0, 3, 2]: top-1 hits 2 of 7, top-5 hits 6 of 7.
    # Per-class top-1 recall: c0 1/1, c1 0/1, c3 0/1, c4 1/2, c5 0/2 (c2 has no samples) -> mean 0.3.
    assert metrics == {"acc1": 2 / 7, "acc5": 6 / 7, "mean_per_class_recall": pytest.approx(0.3, abs=1e-12), "num_samples": 7,
                       "num_skipped": 0}
    predictions = [0, 0, 0, 4, 4, 0, 2]  # first maximal class of each sample
    assert metrics["mean_per_class_recall"] == pytest.approx(balanced_accuracy_score(labels, predictions), abs=1e-12)


def test_acc5_is_nan_below_five_classes_as_in_clip_benchmark():
    model = RiggedModel({"a x": [1.0, 0.0], "a y": [0.0, 1.0]})
    classifier = zeroshot_classifier(model, model.tokenize, ["x", "y"], ["a {c}"], "cpu")
    metrics = evaluate_zeroshot(model, classifier, [(as_images([[1, 0], [1, 0]]), torch.tensor([0, 1]))], "cpu", progress=False)
    assert metrics["acc1"] == 0.5 and math.isnan(metrics["acc5"]) and metrics["mean_per_class_recall"] == 0.5


def test_labels_outside_the_classes_and_nan_features_are_errors():
    model = tied_classifier_model()
    classifier = zeroshot_classifier(model, model.tokenize, CLASSES, ["a {c}"], "cpu")
    with pytest.raises(ValueError, match="targets must lie in"):
        evaluate_zeroshot(model, classifier, [(as_images([one_hot(0, 6)]), torch.tensor([6]))], "cpu", progress=False)
    with pytest.raises(ValueError, match="NaN"):
        evaluate_zeroshot(model, classifier, [(as_images([[math.nan] * 6]), torch.tensor([0]))], "cpu", progress=False)


def test_evaluation_restores_training_mode():
    model = tied_classifier_model().train()
    zeroshot_classifier(model, model.tokenize, CLASSES, ["a {c}"], "cpu")
    assert model.training


def test_target_rank_equals_stable_descending_sort():
    generator = torch.Generator().manual_seed(0)
    scores = torch.randint(0, 4, (300, 17), generator=generator).float()  # many ties
    target = torch.randint(0, 17, (300,), generator=generator)
    order = torch.sort(scores, dim=1, descending=True, stable=True).indices
    expected = (order == target[:, None]).float().argmax(dim=1)
    assert torch.equal(target_rank(scores, target), expected)


# ---- retrieval --------------------------------------------------------------------------


def test_retrieval_metrics_exact_with_ties_and_more_captions_than_images():
    model = retrieval_model()
    loader = [
        (as_images(RETRIEVAL_IMAGES[:3]), RETRIEVAL_CAPTIONS[:3]),
        (as_images(RETRIEVAL_IMAGES[3:]), RETRIEVAL_CAPTIONS[3:]),
    ]
    assert evaluate_retrieval(model, model.tokenize, loader, "cpu", progress=False) == EXPECTED_RETRIEVAL


def test_retrieval_accepts_one_caption_string_per_image_and_counts_captionless_images_as_misses():
    model = retrieval_model()
    loader = [(as_images(RETRIEVAL_IMAGES[:2]), ["a", "e"])]
    assert evaluate_retrieval(model, model.tokenize, loader, "cpu", progress=False)["text_retrieval_recall@1"] == 1.0
    # Image 1 has no caption: a miss in image->text, as in CLIP_benchmark (its recall is 0/0 there).
    features = torch.eye(3)
    metrics = recall_metrics(features, features[[0, 2]], torch.tensor([0, 2]))
    assert metrics["text_retrieval_recall@10"] == 2 / 3 and metrics["image_retrieval_recall@1"] == 1.0


def test_recall_equals_sorting_reference_on_random_tied_scores():
    generator = torch.Generator().manual_seed(1)
    num_images, num_texts = 23, 61
    image_features = torch.eye(num_images)
    text_features = torch.randint(0, 3, (num_texts, num_images), generator=generator).float()  # scores = these
    text_to_image = torch.randint(0, num_images, (num_texts,), generator=generator)
    metrics = recall_metrics(image_features, text_features, text_to_image)

    scores = text_features @ image_features.T
    by_text = torch.sort(scores, dim=1, descending=True, stable=True).indices
    by_image = torch.sort(scores.T, dim=1, descending=True, stable=True).indices
    positive = text_to_image[None, :] == torch.arange(num_images)[:, None]  # [images, texts]
    for k in (1, 5, 10):
        t2i = (by_text[:, :k] == text_to_image[:, None]).any(dim=1).double().mean().item()
        i2t = positive.gather(1, by_image[:, :k]).any(dim=1).double().mean().item()
        assert metrics[f"image_retrieval_recall@{k}"] == t2i
        assert metrics[f"text_retrieval_recall@{k}"] == i2t
