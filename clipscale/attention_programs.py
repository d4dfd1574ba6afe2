"""Short-sequence attention's Triton programs: what runs on the device (`attention.py` launches them).

For sequences of at most 64 tokens (ViT-B/32's 50, captions cut to their length), one program
holds one (sample, head)'s whole problem in registers: its queries, keys and values are one
[BLOCK, head_dim] tile each, its scores one [BLOCK, BLOCK] tile, so there is no loop over key
blocks and no online softmax. FlashAttention's kernels tile for long sequences (cuDNN's chose
64 x 128 query x key tiles with a pipeline over key blocks): at 50 tokens each of their programs
ran one iteration of that machinery, and the attention took 17% of a ViT-B/32 step's kernel time
for about 1% of its FLOPs (issue 49). The inputs are read in place from the packed projection
(open_clip's `in_proj`, [b, s, 3 * width]: queries, keys, values side by side, head h at columns
h * head_dim), and the gradient is written the same way, so neither direction copies a head out.

Reference math (one sample, one head, s tokens, scale c = 1 / sqrt(head_dim)):

    S = c Q K^T                 (causal: S_ij = -inf for j > i)
    lse_i = log sum_j exp(S_ij),  P = exp(S - lse),  O = P V
    backward, given dO:  dV = P^T dO,  dP = dO V^T,  delta_i = sum_d dO_id O_id,
                         dS = P * (dP - delta),  dQ = c dS K,  dK = c dS^T Q

Base 2 inside (log2 e folded into the scale), as in `losses/infcl/triton_programs.py`. The
products take bf16 (or the inputs') operands with float32 accumulation, P and dS cast to the
inputs' dtype before their products, as FlashAttention does; the softmax is float32. Rows past
the sequence (BLOCK > s) are loaded as zeros, never stored, and contribute nothing to dK, dV.
"""

import triton
import triton.language as tl

from clipscale.triton_modes import interpreting

INTERPRET = interpreting()  # the mode these programs were decorated for (clipscale.triton_modes)


@triton.jit
def _scores(q, k, rows, seq_len, scale_log2, CAUSAL: tl.constexpr, PREC: tl.constexpr):
    """The [BLOCK, BLOCK] scores in base 2, -inf where a key is past the sequence (or the future)."""
    scores = tl.dot(q, tl.trans(k), input_precision=PREC) * scale_log2
    keep = rows[None, :] < seq_len
    if CAUSAL:
        keep = keep & (rows[None, :] <= rows[:, None])
    return tl.where(keep, scores, float("-inf"))


@triton.jit
def attention_fwd_kernel(QKV, O, LSE, seq_len, heads, head_dim, stride_qkv_b, stride_qkv_s, stride_o_b, stride_o_s,
                         scale_log2, CAUSAL: tl.constexpr, BLOCK: tl.constexpr, HEAD_BLOCK: tl.constexpr,
                         PREC: tl.constexpr):
    """One (sample, head) a program: O [b, s, heads * head_dim] and LSE [b * heads, BLOCK] (base 2)."""
    program = tl.program_id(0)
    sample, head = program // heads, program % heads
    width = heads * head_dim
    rows, dims = tl.arange(0, BLOCK), tl.arange(0, HEAD_BLOCK)
    tile_mask = (rows[:, None] < seq_len) & (dims[None, :] < head_dim)
    at = QKV + sample * stride_qkv_b + rows[:, None] * stride_qkv_s + head * head_dim + dims[None, :]
    q = tl.load(at, mask=tile_mask, other=0.0)
    k = tl.load(at + width, mask=tile_mask, other=0.0)
    v = tl.load(at + 2 * width, mask=tile_mask, other=0.0)

    scores = _scores(q, k, rows, seq_len, scale_log2, CAUSAL, PREC)
    row_max = tl.max(scores, 1)
    p = tl.exp2(scores - row_max[:, None])
    row_sum = tl.sum(p, 1)
    out = tl.dot(p.to(v.dtype), v, input_precision=PREC) / row_sum[:, None]

    out_at = O + sample * stride_o_b + rows[:, None] * stride_o_s + head * head_dim + dims[None, :]
    tl.store(out_at, out.to(O.dtype.element_ty), mask=tile_mask)
    tl.store(LSE + program * BLOCK + rows, row_max + tl.log2(row_sum))


@triton.jit
def attention_bwd_kernel(QKV, O, dO, LSE, dQKV, seq_len, heads, head_dim, stride_qkv_b, stride_qkv_s, stride_o_b,
                         stride_o_s, stride_do_b, stride_do_s, scale, scale_log2, CAUSAL: tl.constexpr,
                         BLOCK: tl.constexpr, HEAD_BLOCK: tl.constexpr, PREC: tl.constexpr):
    """One (sample, head) a program: its dQ, dK, dV into dQKV, laid out as QKV (contiguous)."""
    program = tl.program_id(0)
    sample, head = program // heads, program % heads
    width = heads * head_dim
    rows, dims = tl.arange(0, BLOCK), tl.arange(0, HEAD_BLOCK)
    tile_mask = (rows[:, None] < seq_len) & (dims[None, :] < head_dim)
    columns = rows[:, None] * stride_qkv_s + head * head_dim + dims[None, :]
    at = QKV + sample * stride_qkv_b + columns
    q = tl.load(at, mask=tile_mask, other=0.0)
    k = tl.load(at + width, mask=tile_mask, other=0.0)
    v = tl.load(at + 2 * width, mask=tile_mask, other=0.0)
    head_columns = head * head_dim + dims[None, :]
    o = tl.load(O + sample * stride_o_b + rows[:, None] * stride_o_s + head_columns, mask=tile_mask, other=0.0)
    do = tl.load(dO + sample * stride_do_b + rows[:, None] * stride_do_s + head_columns, mask=tile_mask, other=0.0)
    lse = tl.load(LSE + program * BLOCK + rows)

    p = tl.exp2(_scores(q, k, rows, seq_len, scale_log2, CAUSAL, PREC) - lse[:, None])
    dv = tl.dot(tl.trans(p).to(do.dtype), do, input_precision=PREC)
    dp = tl.dot(do, tl.trans(v), input_precision=PREC)
    delta = tl.sum(do.to(dp.dtype) * o.to(dp.dtype), 1)  # float32 (float64 for float64 inputs)
    ds = (p * (dp - delta[:, None])).to(q.dtype)
    dq = tl.dot(ds, k, input_precision=PREC) * scale
    dk = tl.dot(tl.trans(ds), q, input_precision=PREC) * scale

    grad_at = dQKV + sample * (3 * width * seq_len) + rows[:, None] * (3 * width) + head * head_dim + dims[None, :]
    tl.store(grad_at, dq.to(dQKV.dtype.element_ty), mask=tile_mask)
    tl.store(grad_at + width, dk.to(dQKV.dtype.element_ty), mask=tile_mask)
    tl.store(grad_at + 2 * width, dv.to(dQKV.dtype.element_ty), mask=tile_mask)
