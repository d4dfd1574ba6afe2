"""Distributed evaluation in a 2-process gloo world equals the single-process result exactly."""

from __future__ import annotations

import pytest
import torch

from clipscale.eval import evaluate_retrieval, evaluate_zeroshot, zeroshot_classifier
from clipscale.eval.datasets import collate_captions, make_loader, rank_shard
from tests.helpers.gloo_world import run_in_gloo_world
from tests.helpers.rigged import (
    CLASSES,
    EXPECTED_RETRIEVAL,
    RETRIEVAL_CAPTIONS,
    RETRIEVAL_IMAGES,
    RiggedModel,
    as_images,
    retrieval_model,
    tied_classifier_model,
)

pytestmark = pytest.mark.slow


def random_tied_sets():
    """A classification and a retrieval set with integer features, so exact ties are common."""
    generator = torch.Generator().manual_seed(0)
    features = torch.randint(0, 3, (41, 6, 1, 1), generator=generator).float()
    labels = torch.randint(0, len(CLASSES), (41,), generator=generator)
    classification = list(zip(features, labels))
    captions = [[f"t{i}-{j}" for j in range(1 + i % 3)] for i in range(31)]
    text_features = {c: torch.randint(0, 3, (6,), generator=generator).float().tolist() for cs in captions for c in cs}
    retrieval = list(zip(features[:31], captions))
    return classification, retrieval, RiggedModel(text_features)


def evaluate_all(batch_size: int = 4) -> dict:
    """Every metric on the rigged sets, each process on its rank_shard (the whole set outside a world)."""
    classification, retrieval, random_text_model = random_tied_sets()
    model = tied_classifier_model()
    classifier = zeroshot_classifier(model, model.tokenize, CLASSES, ["a {c}"], "cpu")
    hand_retrieval = list(zip(as_images(RETRIEVAL_IMAGES), RETRIEVAL_CAPTIONS))

    def loader(items, collate=None):
        return make_loader(rank_shard(items), batch_size, workers=0, collate_fn=collate)

    captions_model = retrieval_model()
    return {
        "zeroshot": evaluate_zeroshot(model, classifier, loader(classification), "cpu", progress=False),
        "hand_retrieval": evaluate_retrieval(
            captions_model, captions_model.tokenize, loader(hand_retrieval, collate_captions), "cpu", progress=False
        ),
        "random_retrieval": evaluate_retrieval(
            random_text_model, random_text_model.tokenize, loader(retrieval, collate_captions), "cpu", progress=False
        ),
    }


def worker(rank, world_size):
    return evaluate_all()


def test_two_ranks_equal_one_process():
    single = evaluate_all()
    assert single["hand_retrieval"] == EXPECTED_RETRIEVAL
    assert run_in_gloo_world(worker, world_size=2, timeout=120) == [single, single]
