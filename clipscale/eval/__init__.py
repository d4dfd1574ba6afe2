"""Zero-shot classification and image-text retrieval evaluation.

    classifier = zeroshot_classifier(model, tokenizer, classnames, templates, device)
    metrics = evaluate_zeroshot(model, classifier, dataloader, device)
    metrics = evaluate_retrieval(model, tokenizer, dataloader, device)

Metric names and definitions follow CLIP_benchmark so results drop into
existing tables. Ties are broken toward the lower index (clipscale.eval.ranking).
"""

from clipscale.eval.retrieval import evaluate_retrieval
from clipscale.eval.zeroshot import evaluate_zeroshot, zeroshot_classifier

__all__ = ["zeroshot_classifier", "evaluate_zeroshot", "evaluate_retrieval"]
