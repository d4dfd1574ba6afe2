"""Zero-shot classification: class embeddings from prompts, then nearest class per image.

Follows open_clip / CLIP_benchmark: each class is the normalised mean of the
normalised text embeddings of its prompts (one prompt per template), and an
image is classified by cosine similarity to these class vectors. Metric names
are CLIP_benchmark's: acc1, acc5, mean_per_class_recall (sklearn's
balanced accuracy: the mean over classes present in the labels of per-class
top-1 recall). As in CLIP_benchmark, acc5 is NaN with fewer than 5 classes.
num_samples counts the images classified, num_skipped those left out
(`clipscale.eval.datasets.Skipped`).
Ties between classes: see clipscale.eval.ranking (lower class index wins).
"""

from __future__ import annotations

from typing import Callable, Sequence, Union

import torch

from clipscale.eval.datasets import NoUsableSample, Skips, usable_batches
from clipscale.eval.gather import sum_over_ranks
from clipscale.eval.inference import Autocast, encode_images, encode_texts, evaluating, progress_bar, say_skipped
from clipscale.eval.ranking import target_rank

Template = Union[str, Callable[[str], str]]


def fill_template(template: Template, classname: str) -> str:
    """A prompt from a "{c}" string template or a callable one (open_clip's are lambdas)."""
    if callable(template):
        return template(classname)
    if "{c}" not in template:
        raise ValueError(f"string template {template!r} has no '{{c}}' placeholder for the class name")
    return template.replace("{c}", classname)


def zeroshot_classifier(
    model,
    tokenizer,
    classnames: Sequence[str],
    templates: Sequence[Template],
    device,
    batch_size: int = 256,
    autocast: Autocast = None,
) -> torch.Tensor:
    """Class embeddings as a float32 [embed_dim, num_classes] matrix on `device`.

    Prompts are encoded `batch_size` at a time, class-major: prompt k of class c
    is row c * len(templates) + k.
    """
    if not classnames or not templates:
        raise ValueError("zero-shot classifier needs at least one class name and one template")
    prompts = [fill_template(template, name) for name in classnames for template in templates]
    with evaluating(model) as inner:
        embeddings = torch.cat(
            [
                encode_texts(inner, tokenizer, prompts[start : start + batch_size], device, autocast)
                for start in range(0, len(prompts), batch_size)
            ]
        )
    class_means = embeddings.view(len(classnames), len(templates), -1).mean(dim=1)
    return torch.nn.functional.normalize(class_means, dim=-1).T.contiguous()


def evaluate_zeroshot(
    model,
    classifier: torch.Tensor,
    dataloader,
    device,
    autocast: Autocast = None,
    progress: bool = True,
    name: str = "zero-shot",
) -> dict:
    """acc1, acc5, mean_per_class_recall, num_samples and num_skipped over `dataloader`'s
    (images, labels) or (images, labels, skipped samples) batches (`collate_samples`). Skipped
    samples are counted, and the first few named in a line on stderr, headed by `name`.

    Under torch.distributed each rank passes the loader of its own part of the
    data; counts are summed across ranks once and every rank returns the same dict.
    """
    num_classes = classifier.shape[1]
    top1 = torch.zeros((), dtype=torch.long, device=device)
    top5 = torch.zeros((), dtype=torch.long, device=device)
    per_class_total = torch.zeros(num_classes, dtype=torch.long, device=device)
    per_class_top1 = torch.zeros(num_classes, dtype=torch.long, device=device)
    skips = Skips()
    with evaluating(model) as inner:
        for images, labels in usable_batches(progress_bar(dataloader, progress, name), skips):
            labels = torch.as_tensor(labels, device=device)
            rank = target_rank(encode_images(inner, images, device, autocast) @ classifier, labels)
            top1 += (rank < 1).sum()
            top5 += (rank < 5).sum()
            per_class_total += torch.bincount(labels, minlength=num_classes)
            per_class_top1 += torch.bincount(labels[rank == 0], minlength=num_classes)

    # One collective for everything: counts add up exactly across ranks.
    skip_count = torch.tensor([skips.count], dtype=torch.long, device=device)
    counts = sum_over_ranks(torch.cat([torch.stack([top1, top5]), skip_count, per_class_total, per_class_top1])).cpu()
    top1, top5, skipped_total = counts[:3].tolist()
    per_class_total, per_class_top1 = counts[3:].view(2, num_classes)
    n = int(per_class_total.sum())
    say_skipped(name, skips, n + skipped_total)
    if n == 0:
        raise NoUsableSample("no usable sample" + (f": {skips.summary()}" if skips.count else ""))
    present = per_class_total > 0
    return {
        "acc1": top1 / n,
        "acc5": top5 / n if num_classes >= 5 else float("nan"),
        "mean_per_class_recall": (per_class_top1[present].double() / per_class_total[present]).mean().item(),
        "num_samples": n,
        "num_skipped": skipped_total,
    }
