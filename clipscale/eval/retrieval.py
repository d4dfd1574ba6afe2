"""Image-text retrieval Recall@k over a set with several captions per image.

Definitions and names follow CLIP_benchmark (and the CLIP paper's tables):

- image_retrieval_recall@k (text -> image): over all captions, the fraction
  whose own image is among the k images most similar to the caption.
- text_retrieval_recall@k (image -> text): over all images, the fraction with
  at least one of its captions among the k captions most similar to the image.
  An image without captions counts as a miss, as in CLIP_benchmark.

num_samples counts the images evaluated, num_skipped those left out
(`clipscale.eval.datasets.Skipped`).

Ties: see clipscale.eval.ranking (lower index wins; index = position in the
dataset, or in the rank-order concatenation under torch.distributed).
"""

from __future__ import annotations

import torch

from clipscale.eval.datasets import NoUsableSample, Skips, usable_batches
from clipscale.eval.gather import concat_over_ranks, offset_of_this_rank, sum_over_ranks
from clipscale.eval.inference import Autocast, encode_images, encode_texts, evaluating, progress_bar, say_skipped
from clipscale.eval.ranking import target_rank

RECALL_AT = (1, 5, 10)


def evaluate_retrieval(model, tokenizer, dataloader, device, autocast: Autocast = None, progress: bool = True,
                       name: str = "retrieval") -> dict:
    """Recall@{1,5,10} both ways, num_samples and num_skipped, from a loader of (images, list of
    caption lists), or (images, caption lists, skipped samples) (`collate_samples`). Skipped samples
    are counted, and the first few named in a line on stderr, headed by `name`.

    A batch's captions may also be plain strings (one caption per image).
    Under torch.distributed each rank passes the loader of its own contiguous
    part; features are gathered once and every rank returns the same dict.
    """
    image_features, text_features, text_to_image = [], [], []
    num_images = 0
    skips = Skips()
    with evaluating(model) as inner:
        for images, captions in usable_batches(progress_bar(dataloader, progress, name), skips):
            captions = [[c] if isinstance(c, str) else list(c) for c in captions]
            image_features.append(encode_images(inner, images, device, autocast))
            text_features.append(encode_texts(inner, tokenizer, [c for cs in captions for c in cs], device, autocast))
            text_to_image += [num_images + i for i, cs in enumerate(captions) for _ in cs]
            num_images += len(captions)
        num_samples, num_skipped = sum_over_ranks(torch.tensor([num_images, skips.count], device=device)).tolist()
        say_skipped(name, skips, num_samples + num_skipped)
        if num_samples == 0:
            raise NoUsableSample("no usable sample" + (f": {skips.summary()}" if skips.count else ""))
        if not image_features:  # this rank used no image; it still joins the gathers, with none
            text_features = [encode_texts(inner, tokenizer, [], device, autocast)]  # [0, embedding width]
            image_features = [text_features[0].clone()]

    # Each rank numbered its images from 0; shift by the images of lower ranks.
    first_image = offset_of_this_rank(num_images, device)
    text_to_image = torch.tensor(text_to_image, dtype=torch.long, device=device) + first_image
    metrics = recall_metrics(
        concat_over_ranks(torch.cat(image_features)),
        concat_over_ranks(torch.cat(text_features)),
        concat_over_ranks(text_to_image),
    )
    return {**metrics, "num_samples": num_samples, "num_skipped": num_skipped}


def recall_metrics(image_features: torch.Tensor, text_features: torch.Tensor, text_to_image: torch.Tensor) -> dict:
    """The metrics above from normalised features and each caption's image index."""
    if len(image_features) == 0 or len(text_features) == 0:
        raise ValueError("retrieval evaluation needs at least one image and one caption")
    scores = text_features @ image_features.T  # [captions, images]
    image_rank = target_rank(scores, text_to_image)

    best_caption = best_caption_per_image(scores, text_to_image, len(image_features))
    has_caption = best_caption >= 0
    text_rank = target_rank(scores.T, best_caption.clamp(min=0))

    metrics = {}
    for k in RECALL_AT:
        metrics[f"image_retrieval_recall@{k}"] = (image_rank < k).double().mean().item()
        metrics[f"text_retrieval_recall@{k}"] = ((text_rank < k) & has_caption).double().mean().item()
    return metrics


def best_caption_per_image(scores: torch.Tensor, text_to_image: torch.Tensor, num_images: int) -> torch.Tensor:
    """For each image, its caption that ranks highest for it (tie rule: lowest index); -1 if none.

    "Any of the image's captions in the top k" is the same as "its best-ranked
    caption in the top k", and this finds that caption in O(captions) without
    a dense [images, captions] mask.
    """
    own_score = scores.gather(1, text_to_image[:, None]).squeeze(1)
    best_score = own_score.new_full((num_images,), float("-inf"))
    best_score.scatter_reduce_(0, text_to_image, own_score, reduce="amax")
    is_best = own_score == best_score[text_to_image]
    caption = torch.arange(len(own_score), device=scores.device)
    best = caption.new_full((num_images,), len(own_score))
    best.scatter_reduce_(0, text_to_image[is_best], caption[is_best], reduce="amin")
    return best.masked_fill(best == len(own_score), -1)
