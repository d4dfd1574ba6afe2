"""DisCo-CLIP (Chen et al. 2023): the local loss with a cheaper gather.

Forward: all_gather the features *without* autograd (images and texts packed
into one collective), compute this rank's rows of both directions (as `local`).
Backward: every rank holds a gradient for *all* gathered features (its rows
touch every column); one all_reduce sums them and each rank keeps its own
slice, which is sum_q dL_q/dfeatures_r = world * dL_global/dfeatures_r. No
graph of other ranks' features is kept, and the gradient exchange is a single
all_reduce of the packed [world, m + n, d] tensor.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from clipscale.losses import register_loss
from clipscale.losses.common import ClipLoss, report_global_mean
from clipscale.losses.local import local_rows_loss


class DisCoGather(torch.autograd.Function):
    """(image [m, d], text [n, d]) -> (all images [world*m, d], all texts [world*n, d])."""

    @staticmethod
    def forward(ctx, image, text, group):
        ctx.group, ctx.images = group, len(image)
        packed = torch.cat([image, text])
        parts = [torch.empty_like(packed) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, packed, group=group)
        gathered = torch.stack(parts)  # [world, m + n, d]
        return gathered[:, : len(image)].flatten(0, 1), gathered[:, len(image) :].flatten(0, 1)

    @staticmethod
    def backward(ctx, grad_all_image, grad_all_text):
        world, rank = dist.get_world_size(ctx.group), dist.get_rank(ctx.group)
        packed = torch.cat(
            [grad_all_image.unflatten(0, (world, -1)), grad_all_text.unflatten(0, (world, -1))], dim=1
        ).contiguous()
        dist.all_reduce(packed, group=ctx.group)
        mine = packed[rank]
        return mine[: ctx.images], mine[ctx.images :], None


@register_loss("disco")
class DisCoLoss(ClipLoss):
    def compute(self, image, text, logit_scale, layout):
        if layout.world == 1:
            all_image, all_text = image, text
        else:
            all_image, all_text = DisCoGather.apply(image, text, self.group)
        local = local_rows_loss(image, text, all_image, all_text, logit_scale, layout)
        return report_global_mean(local, self.group)
