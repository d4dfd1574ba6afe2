"""The losses written plainly over the full global matrix, in float64.

Every clipscale loss must match these: the value, each rank's feature gradient
(world * dL/dfeatures_r, DDP's convention) and dL/dscale (the rank-mean of the
scale gradients). Inputs are given per rank, as the ranks hold them.

    from tests.helpers.reference_math import clip_loss_float64, ntxent_loss_float64
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


# --- the same losses in float64 blocks, for batches whose b x b matrix does not fit --------------

@dataclass
class TiledReference:
    loss: float
    loss_terms: float  # mean |LSE| + mean |positive logit|: the size of what the loss is the difference of
    grads: list[torch.Tensor]  # dL/d(each input), float64, on the inputs' device
    scale_grad: float  # dL/ds (0.0 where the scale is not an input)
    scale_grad_terms: float  # sum_ij |dL/dx_ij * x_ij| / s: the size of the terms dL/ds adds up


def _blocks(count: int, block: int) -> list[slice]:
    return [slice(start, min(start + block, count)) for start in range(0, count, block)]


def clip_loss_float64_tiled(image: torch.Tensor, text: torch.Tensor, scale: float, block: int = 8192) -> TiledReference:
    """clip_loss_float64 for one process (image i's partner is text i; texts from len(image) on
    are extra negatives), in float64 blocks of `block` x `block` logits on the inputs' device:
    O((m + n) * d + block^2) memory. Row and column log-sum-exps first, then per block

        G_ij = dL/dx_ij = (exp(x_ij - r_i) + [j < m] exp(x_ij - c_j)) / 2m    (- [i == j] / m, added after)
        dL/dI = s G T,  dL/dT = s G^T I,  dL/ds = sum_ij G_ij x_ij / s
    """
    m, n, s = len(image), len(text), float(scale)
    image, text = image.double(), text.double()
    rows, cols = _blocks(m, block), _blocks(n, block)
    row_lse = torch.full((m,), float("-inf"), dtype=torch.float64, device=image.device)
    col_lse = torch.full((n,), float("-inf"), dtype=torch.float64, device=image.device)
    for r in rows:
        for c in cols:
            x = s * image[r] @ text[c].T
            row_lse[r] = torch.logaddexp(row_lse[r], x.logsumexp(1))
            col_lse[c] = torch.logaddexp(col_lse[c], x.logsumexp(0))
    positive = s * (image * text[:m]).sum(1)
    loss = ((row_lse - positive).mean() + (col_lse[:m] - positive).mean()) / 2

    grad_image, grad_text = torch.zeros_like(image), torch.zeros_like(text)
    scale_grad = terms = torch.zeros((), dtype=torch.float64, device=image.device)
    for r in rows:
        for c in cols:
            x = s * image[r] @ text[c].T
            g = torch.exp(x - row_lse[r, None])
            paired = max(0, min(c.stop, m) - c.start)  # the block's columns with a partner image
            g[:, :paired] += torch.exp(x[:, :paired] - col_lse[None, c.start:c.start + paired])
            g /= 2 * m
            grad_image[r] += s * g @ text[c]
            grad_text[c] += s * g.T @ image[r]
            scale_grad = scale_grad + (g * x).sum() / s
            terms = terms + (g * x).abs().sum() / s
    grad_image -= s / m * text[:m]  # the positive logits' -1/m
    grad_text[:m] -= s / m * image
    scale_grad = scale_grad - positive.sum() / (m * s)
    terms = terms + positive.abs().sum() / (m * s)
    loss_terms = (row_lse.abs().mean() + col_lse[:m].abs().mean()) / 2 + positive.abs().mean()
    return TiledReference(loss.item(), loss_terms.item(), [grad_image, grad_text], scale_grad.item(), terms.item())


def ntxent_loss_float64_tiled(features: torch.Tensor, temperature: float, block: int = 8192) -> TiledReference:
    """ntxent_loss_float64 for one process ([2b, d], row k's positive is row (k + b) mod 2b, the
    diagonal excluded), in float64 blocks on the inputs' device. With x = F F^T / t and N = 2b:

        G_kj = exp(x_kj - l_k) / N  (0 on the diagonal; - [j == pos(k)] / N added after)
        dL/dF = (G + G^T) F / t
    """
    count, s = len(features), 1.0 / temperature
    f = features.double()
    blocks = _blocks(count, block)
    lse = torch.full((count,), float("-inf"), dtype=torch.float64, device=f.device)

    def logits(r: slice, c: slice) -> torch.Tensor:
        x = s * f[r] @ f[c].T
        first = max(r.start, c.start)
        diagonal = torch.arange(first, max(first, min(r.stop, c.stop)), device=f.device)
        x[diagonal - r.start, diagonal - c.start] = float("-inf")
        return x

    for r in blocks:
        for c in blocks:
            lse[r] = torch.logaddexp(lse[r], logits(r, c).logsumexp(1))
    partner = f.roll(-(count // 2), 0)  # row k: the features of row pos(k)
    positive = s * (f * partner).sum(1)
    loss = (lse - positive).mean()

    grad = torch.zeros_like(f)
    for r in blocks:
        for c in blocks:
            g = torch.exp(logits(r, c) - lse[r, None]) / count
            grad[r] += s * g @ f[c]
            grad[c] += s * g.T @ f[r]
    grad -= 2 * s / count * partner  # pos is an involution: -1/N at (k, pos(k)) reaches row k twice
    return TiledReference(loss.item(), (lse.abs().mean() + positive.abs().mean()).item(), [grad], 0.0, 0.0)
