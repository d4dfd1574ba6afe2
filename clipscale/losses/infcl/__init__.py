"""Inf-CL: the CLIP loss without the b x b matrix.

Loss (symmetric, as open_clip computes it), logits x_ij = s * <I_i, T_j>:

    L = 1/2 * [ 1/b sum_i (lse_j x_ij - x_ii)  +  1/b sum_j (lse_i x_ij - x_jj) ]

Only the row and column log-sum-exp vectors are kept; every tile of x is
recomputed in the backward. Across ranks the text block travels around a ring
(with its partial column LSE in the forward, its partial gradient in the
backward) while the local tile computes.

Layers, top to bottom:

- `loss.py`      the autograd Functions `infcl_loss` / `ntxent_loss` and the
                 registered `build_loss("infcl" | "ntxent")` modules: argument
                 checks, positive logits, scale gradient, ring orchestration.
- `ring.py`      moving text blocks around the ranks with batch_isend_irecv.
- `reference.py` the tile primitives in plain PyTorch (any device, chunked so
                 nothing of size b x b is ever allocated).
- `kernels.py`   the same tile primitives as fused Triton kernels (CUDA, or CPU
                 tensors under TRITON_INTERPRET=1).

Tile primitive contract (reference.py and kernels.py implement exactly this;
`image` is [m, d], `text` is [n, d], same dtype, `scale` a Python float or
0-dim tensor; masked entries are those with `mask_diagonal` and
row_offset + i == col_offset + j, i.e. the global diagonal of a self-similarity):

    lse_pass(image, text, scale, *, row_offset=0, col_offset=0,
             mask_diagonal=False, need_col=True, exact=False)
        -> (row_lse [m] float32, col_lse [n] float32 | None)
        row_lse_i = log sum_j exp(x_ij) over this block's columns,
        col_lse_j = log sum_i exp(x_ij) over this block's rows
        (-inf where every entry is masked).

    grad_pass(image, text, scale, row_lse, col_lse, row_weight, col_weight, *,
              row_offset=0, col_offset=0, mask_diagonal=False,
              grad_image=None, grad_text=None, exact=False)
        -> (grad_image [m, d] float32, grad_text [n, d] float32)
        G_ij = row_weight_i * exp(x_ij - row_lse_i)
             + col_weight_j * exp(x_ij - col_lse_j)     (0 where masked;
               the column term is absent when col_weight is None)
        grad_image += scale * G @ text ;  grad_text += scale * G^T @ image
        (fresh float32 zeros where None is passed; returned either way).
        row_lse / col_lse are the global (fully merged) values.

`exact=True` with float32 inputs disables TF32 so the products are full fp32;
bf16/fp16 inputs always accumulate in float32. The positive logits, the
-T_i / -I_i terms of the gradient and the scale gradient
(s * dL/ds = sum_i <dI_i, I_i>) are O(b d) and live in loss.py.
"""

from .loss import infcl_loss, ntxent_loss  # noqa: E402  (the contract above comes first)

__all__ = ["infcl_loss", "ntxent_loss"]
