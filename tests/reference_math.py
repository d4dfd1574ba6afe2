"""The losses written plainly over the full global matrix, in float64.

Every clipscale loss must match these: the value, each rank's feature gradient
(world * dL/dfeatures_r, DDP's convention) and dL/dscale (the rank-mean of the
scale gradients). Inputs are given per rank, as the ranks hold them.

    from reference_math import clip_loss_float64, ntxent_loss_float64
    ref = clip_loss_float64(images_per_rank, texts_per_rank, scale)
    ref.loss, ref.grads[0][r] (image grad of rank r), ref.grads[1][r], ref.scale_grad
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Reference:
    loss: float
    grads: list[list[torch.Tensor]]  # per input tensor, per rank: world * dL/dfeatures_r
    scale_grad: float
    bias_grad: float = 0.0


def _leaf(parts: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([p.detach().double() for p in parts]).requires_grad_()


def _with_gradients(loss, leaves, parts_per_leaf, scale=None) -> Reference:
    loss.backward()
    world = len(parts_per_leaf[0])
    grads = [
        [world * g for g in leaf.grad.split([len(p) for p in parts])]
        for leaf, parts in zip(leaves, parts_per_leaf)
    ]
    return Reference(loss.item(), grads, scale.grad.item() if scale is not None else 0.0)


def clip_loss_float64(images: list[torch.Tensor], texts: list[torch.Tensor], scale: float) -> Reference:
    """open_clip's symmetric CLIP loss over the concatenation of all ranks.

    Rank r holds m images and n >= m texts; its text k < m is the partner of
    its image k, the other texts are extra negatives (image->text only).

        x = s * I @ T.T
        L = 1/2 * [ mean_i (lse_j x_ij - x_i,p(i)) + mean_i (lse_i' x_i'p(i) - x_i,p(i)) ]
    """
    m, n = len(images[0]), len(texts[0])
    image, text = _leaf(images), _leaf(texts)
    s = torch.tensor(float(scale), dtype=torch.float64, requires_grad=True)
    logits = s * image @ text.T
    rows = torch.arange(len(image))
    partner = (rows // m) * n + rows % m
    image_to_text = (logits.logsumexp(1) - logits[rows, partner]).mean()
    paired = logits[:, partner]  # [images, paired texts]
    text_to_image = (paired.logsumexp(0) - paired.diagonal()).mean()
    loss = (image_to_text + text_to_image) / 2
    return _with_gradients(loss, [image, text], [images, texts], s)


def siglip_loss_float64(images: list[torch.Tensor], texts: list[torch.Tensor], scale: float, bias: float):
    """SigLIP's sigmoid loss over all ranks (partners as in clip_loss_float64, all other pairs negative).

        x = s * I @ T.T + b,  z = +1 for partners, -1 otherwise
        L = -1/B sum_ij log sigmoid(z_ij x_ij)
    """
    m, n = len(images[0]), len(texts[0])
    image, text = _leaf(images), _leaf(texts)
    s = torch.tensor(float(scale), dtype=torch.float64, requires_grad=True)
    b = torch.tensor(float(bias), dtype=torch.float64, requires_grad=True)
    logits = s * image @ text.T + b
    rows = torch.arange(len(image))
    z = -torch.ones_like(logits)
    z[rows, (rows // m) * n + rows % m] = 1.0
    loss = -torch.nn.functional.logsigmoid(z * logits).sum() / len(image)
    reference = _with_gradients(loss, [image, text], [images, texts], s)
    reference.bias_grad = b.grad.item()
    return reference


def ntxent_loss_float64(features: list[torch.Tensor], temperature: float) -> Reference:
    """SimCLR's NT-Xent over all ranks: rank r holds [2b, d] = [view 1; view 2];
    the positive of its row k is its row (k + b) mod 2b, every other row of every
    rank is a negative, the diagonal (self-similarity) is excluded.

        x = F @ F.T / t,  x_kk = -inf
        L = mean_k (lse_j x_kj - x_k,pos(k))
    """
    two_b = len(features[0])
    f = _leaf(features)
    logits = (f @ f.T / temperature).fill_diagonal_(float("-inf"))
    rows = torch.arange(len(f))
    positive = (rows // two_b) * two_b + (rows % two_b + two_b // 2) % two_b
    loss = (logits.logsumexp(1) - logits[rows, positive]).mean()
    return _with_gradients(loss, [f], [features])


def block_logits_float64(image, text, scale, row_offset=0, col_offset=0, mask_diagonal=False) -> torch.Tensor:
    """The logits of one block of the tile-primitive contract (clipscale.losses.infcl):
    x_ij = scale * <image_i, text_j>, -inf where mask_diagonal and row_offset + i == col_offset + j."""
    x = float(scale) * image.double() @ text.double().T
    if mask_diagonal:
        rows = torch.arange(len(image))[:, None] + row_offset
        cols = torch.arange(len(text))[None, :] + col_offset
        x = x.masked_fill(rows == cols, float("-inf"))
    return x
