"""OpenCLIP's local loss: gather with gradient, each rank computes only its own rows.

    all_image, all_text = gather(image), gather(text)       # with gradient
    logits_per_image = s * image @ all_text.T                 # [m, world * n]
    logits_per_text  = s * text[:m] @ all_image.T             # [m, world * m]
    L_r = (CE(logits_per_image, partners) + CE(logits_per_text, own images)) / 2

The global loss is the mean of the L_r (every direction's rows are split
evenly across ranks), and that mean is what every rank returns. Compute and
memory per rank are O(B^2 / world). The backward of the gather sums the
gradient every rank computed for rank r's features: world * dL/dfeatures_r.
"""

from __future__ import annotations

import torch

from clipscale.losses import register_loss
from clipscale.losses.common import ClipLoss, Layout, clip_cross_entropy, gather_with_grad, report_global_mean


def local_rows_loss(image, text, all_image, all_text, logit_scale, layout: Layout) -> torch.Tensor:
    """This rank's rows of both directions (L_r above), given the gathered features."""
    logits_per_image = logit_scale * image @ all_text.T
    # Only the paired texts have a text->image row; extra texts are negatives of images.
    logits_per_text = logit_scale * text[: layout.images] @ all_image.T
    own_images = layout.rank * layout.images + torch.arange(layout.images, device=image.device)
    return clip_cross_entropy(logits_per_image, layout.local_partners(image.device), logits_per_text, own_images)


@register_loss("local")
class LocalLoss(ClipLoss):
    def compute(self, image, text, logit_scale, layout):
        all_image = gather_with_grad(image, self.group)
        all_text = gather_with_grad(text, self.group)
        local = local_rows_loss(image, text, all_image, all_text, logit_scale, layout)
        return report_global_mean(local, self.group)
