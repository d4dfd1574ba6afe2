"""Inf-CL: the CLIP loss without the b x b matrix.

Loss (symmetric, as open_clip computes it), logits x_ij = s * <I_i, T_j>:

    L = 1/2 * [ 1/b sum_i (lse_j x_ij - x_ii)  +  1/b sum_j (lse_i x_ij - x_jj) ]

Only the row and column log-sum-exp vectors are kept; every tile of x is
recomputed in the backward. Across ranks the text block travels around a ring
(with its partial column LSE in the forward, its partial gradient in the
backward) while the local tile computes.

Layers, top to bottom:

- `loss.py`            the autograd Functions `infcl_loss` / `ntxent_loss` and the
                       registered `build_loss("infcl" | "ntxent")` modules: argument
                       checks, the weights of each row and column, ring orchestration.
- `ring.py`            moving text blocks around the ranks with batch_isend_irecv.
- `reference.py`       the tile primitives in plain PyTorch (any device, chunked so
                       nothing of size b x b is ever allocated).
- `kernels.py`         the same tile primitives on the GPU, host side: checks,
                       grids, workspace planning, precision of the products.
- `triton_programs.py` the Triton programs that kernels.py launches (CUDA, or
                       CPU tensors under TRITON_INTERPRET=1).
- `precision.py`       float32 products that follow PyTorch's TF32 setting.

Tile primitive contract (reference.py and kernels.py implement exactly this;
`image` is [m, d], `text` is [n, d], same dtype, `scale` a Python float or
1-element tensor; masked entries are those with `mask_diagonal` and
row_offset + i == col_offset + j, i.e. the global diagonal of a self-similarity):

    lse_pass(image, text, scale, *, row_offset=0, col_offset=0,
             mask_diagonal=False, need_col=True, exact=False)
        -> (row_lse [m] float32, col_lse [n] float32 | None)
        row_lse_i = log sum_j exp(x_ij) over this block's columns,
        col_lse_j = log sum_i exp(x_ij) over this block's rows
        (-inf where every entry is masked).

    grad_pass(image, text, scale, row_lse, col_lse, row_weight, col_weight, *,
              row_offset=0, col_offset=0, mask_diagonal=False,
              grad_image=None, grad_text=None, exact=False,
              positive=None, scale_grad=None, out_dtype=None)
        -> (grad_image [m, d], grad_text [n, d])
        G_ij = row_weight_i * exp(x_ij - row_lse_i)
             + col_weight_j * exp(x_ij - col_lse_j)     (0 where masked;
               the column term is absent when col_weight is None)
             - positive_weight_i * [j == partner_i]
               (with positive=(partner, positive_weight): the positive logit's
               term, folded in before any rounding)
        grad_image += scale * G @ text ;  grad_text += scale * G^T @ image
        scale_grad += sum_ij G_ij <I_i, T_j>   (a 1-element float32 tensor,
               when given: dL/ds needs no pass of its own)
        Accumulators passed in are float32 and returned; where None is
        passed, fresh tensors of `out_dtype` (float32 when None) are returned.
        row_lse / col_lse are the global (fully merged) values.

    positive_logits(image, text, partner) -> [m] float32: <I_i, T_partner_i>.

Precision: bf16/fp16 inputs always accumulate in float32. Float32 inputs follow
PyTorch's own float32 matmul setting: IEEE float32 by default, TF32 only where
the user allowed it (`torch.backends.cuda.matmul.allow_tf32`,
`torch.set_float32_matmul_precision("high")`); `exact=True` forces IEEE float32.
"""

from .loss import infcl_loss, ntxent_loss  # noqa: E402  (the contract above comes first)

__all__ = ["infcl_loss", "ntxent_loss"]
