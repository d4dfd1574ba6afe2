"""SigLIP's sigmoid loss (Zhai et al. 2023), gathered like OpenCLIP's local loss.

Every image-text pair is its own binary problem: z_ij = +1 for partners, -1
otherwise (extra texts of rectangular batches are negatives), with a learned
bias b (open_clip's `logit_bias`; a bias only matters here, a softmax is
blind to it):

    x_ij = s * <I_i, T_j> + b
    L = -1/B sum_i sum_j log sigmoid(z_ij x_ij)          (B global images)

Rank r computes its images' rows against all gathered texts; the global loss
is the mean of the rank losses (what every rank returns) and the text gather's
backward sums the ranks' gradients: world * dL/dfeatures_r, as DDP expects.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from clipscale.losses import CLIP_INPUTS, register_loss
from clipscale.losses.common import check_clip_inputs, gather_with_grad, report_global_mean


@register_loss("siglip", inputs=CLIP_INPUTS + ("logit_bias",))
class SigLipLoss(nn.Module):
    def __init__(self, group=None):
        super().__init__()
        self.group = group

    def forward(self, image_features, text_features, logit_scale, logit_bias=None):
        layout, logit_scale = check_clip_inputs(image_features, text_features, logit_scale, self.group)
        # The bias is a replicated parameter (same on every rank), so a local check cannot diverge.
        if logit_bias is not None and not (logit_bias.numel() == 1 and bool(torch.isfinite(logit_bias.detach()))):
            raise ValueError(f"logit_bias must be one finite number, got {logit_bias.detach().flatten()[:4]}")
        all_text = gather_with_grad(text_features, self.group)
        logits = logit_scale * image_features @ all_text.T
        if logit_bias is not None:
            logits = logits + logit_bias
        signs = torch.full_like(logits, -1.0)
        signs[torch.arange(layout.images), layout.local_partners(logits.device)] = 1.0
        local = -F.logsigmoid(signs * logits).sum() / layout.images
        return report_global_mean(local, self.group)
