"""CLIP's loss as written in the paper: every rank builds the whole global matrix.

    all_image, all_text = gather(image), gather(text)      # with gradient
    logits = s * all_image @ all_text.T                     # [B, world * texts]
    L = (CE(logits, partner) + CE(logits[:, partner].T, arange(B))) / 2

Memory and compute are O(B^2) on every rank; this is the baseline the other
losses must equal. Each rank computes the same L, so the gather's backward (a
sum over ranks) hands rank r world * dL/dfeatures_r.
"""

from __future__ import annotations

import torch

from clipscale.losses import register_loss
from clipscale.losses.common import ClipLoss, clip_cross_entropy, gather_with_grad


@register_loss("vanilla")
class VanillaLoss(ClipLoss):
    def compute(self, image, text, logit_scale, layout):
        all_image = gather_with_grad(image, self.group)
        all_text = gather_with_grad(text, self.group)
        logits = logit_scale * all_image @ all_text.T
        partner = layout.global_partners(logits.device)
        # Text->image runs over the paired texts only; extra texts are negatives of images.
        paired = logits if layout.texts == layout.images else logits[:, partner]
        return clip_cross_entropy(logits, partner, paired.T, torch.arange(len(partner), device=logits.device))
