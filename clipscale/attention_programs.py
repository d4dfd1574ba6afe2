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
From 65 to 256 tokens (ViT-B/16's 197) the same math runs with a loop over key blocks (the loop
programs below), which took ViT-B/16's step 1.08x sdpa's on an H100.

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

from clipscale.triton_modes import KEEP_TUNING, interpreting

INTERPRET = interpreting()  # the mode these programs were decorated for (clipscale.triton_modes)


@triton.jit
def _scores(q, k, rows, cols, seq_len, scale_log2, CAUSAL: tl.constexpr, PREC: tl.constexpr):
    """The [BLOCK, BLOCK] scores of queries `rows` and keys `cols` in base 2, -inf where a key is
    past the sequence (or in a query's future)."""
    scores = tl.dot(q, tl.trans(k), input_precision=PREC) * scale_log2
    keep = cols[None, :] < seq_len
    if CAUSAL:
        keep = keep & (cols[None, :] <= rows[:, None])
    return tl.where(keep, scores, float("-inf"))


@triton.jit
def _tile(X, sample_offset, stride_s, rows, column, dims, seq_len, head_dim):
    """The [BLOCK, HEAD_BLOCK] tile of rows `rows` at columns `column + dims` of one sample, zeros past
    the sequence and the head."""
    mask = (rows[:, None] < seq_len) & (dims[None, :] < head_dim)
    return tl.load(X + sample_offset + rows[:, None] * stride_s + column + dims[None, :], mask=mask, other=0.0)


@triton.jit
def _query_block(QKV, O, dO, LSE, program, sample, rows, dims, seq_len, padded, head, head_dim, stride_qkv_b,
                 stride_qkv_s, stride_o_b, stride_o_s, stride_do_b, stride_do_s):
    """A query block's Q, dO, LSE and delta = rowsum(dO * O) (float32, float64 for float64 inputs)."""
    column = head * head_dim
    q = _tile(QKV, sample * stride_qkv_b, stride_qkv_s, rows, column, dims, seq_len, head_dim)
    o = _tile(O, sample * stride_o_b, stride_o_s, rows, column, dims, seq_len, head_dim)
    do = _tile(dO, sample * stride_do_b, stride_do_s, rows, column, dims, seq_len, head_dim)
    lse = tl.load(LSE + program * padded + rows)
    delta = tl.sum(do.to(lse.dtype) * o.to(lse.dtype), 1)
    return q, do, lse, delta


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
    qkv_at = sample * stride_qkv_b
    q = _tile(QKV, qkv_at, stride_qkv_s, rows, head * head_dim, dims, seq_len, head_dim)
    k = _tile(QKV, qkv_at, stride_qkv_s, rows, width + head * head_dim, dims, seq_len, head_dim)
    v = _tile(QKV, qkv_at, stride_qkv_s, rows, 2 * width + head * head_dim, dims, seq_len, head_dim)

    scores = _scores(q, k, rows, rows, seq_len, scale_log2, CAUSAL, PREC)
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
    k = _tile(QKV, sample * stride_qkv_b, stride_qkv_s, rows, width + head * head_dim, dims, seq_len, head_dim)
    v = _tile(QKV, sample * stride_qkv_b, stride_qkv_s, rows, 2 * width + head * head_dim, dims, seq_len, head_dim)
    q, do, lse, delta = _query_block(QKV, O, dO, LSE, program, sample, rows, dims, seq_len, BLOCK, head, head_dim,
                                     stride_qkv_b, stride_qkv_s, stride_o_b, stride_o_s, stride_do_b, stride_do_s)

    p = tl.exp2(_scores(q, k, rows, rows, seq_len, scale_log2, CAUSAL, PREC) - lse[:, None])
    dv = tl.dot(tl.trans(p).to(do.dtype), do, input_precision=PREC)
    ds = (p * (tl.dot(do, tl.trans(v), input_precision=PREC) - delta[:, None])).to(q.dtype)
    dq = tl.dot(ds, k, input_precision=PREC) * scale
    dk = tl.dot(tl.trans(ds), q, input_precision=PREC) * scale

    grad_at = dQKV + sample * (3 * width * seq_len) + rows[:, None] * (3 * width) + head * head_dim + dims[None, :]
    tl.store(grad_at, dq.to(dQKV.dtype.element_ty), mask=tile_mask)
    tl.store(grad_at + width, dk.to(dQKV.dtype.element_ty), mask=tile_mask)
    tl.store(grad_at + 2 * width, dv.to(dQKV.dtype.element_ty), mask=tile_mask)


# Sequences of 65 to 256 tokens (attention.MAX_TOKENS; ViT-B/16's 197): a [BLOCK, BLOCK] scores tile no longer
# holds a whole (sample, head), so each program takes one block of BLOCK queries and loops over the
# key blocks, as FlashAttention does: an online softmax forward (a running row maximum, the sum and
# the output rescaled when it grows), and a backward whose program n finds block n's dK, dV (looping
# over the query blocks) and then its dQ (looping over the key blocks), recomputing P each time, so
# that no two programs write the same gradient and no atomics are needed. Causal programs stop at the
# diagonal block. delta_i = sum_d dO_id O_id is recomputed wherever a query block is loaded.
# BLOCK is 64 (the LSE rows are padded to it); the warps and the loads' pipeline depth are tuned, once
# per head width and `length_class` (the length's next power of two), not per length: the text
# tower's chunks come in many lengths, and each new one would tune again in the middle of training.


def _loop_configs():
    if INTERPRET:
        return [triton.Config({}, num_warps=4, num_stages=1)]
    return [triton.Config({}, num_warps=warps, num_stages=stages) for warps in (4, 8) for stages in (1, 2, 3)]


@triton.autotune(configs=_loop_configs(), key=["length_class", "head_dim"], **KEEP_TUNING)
@triton.jit
def attention_fwd_loop_kernel(QKV, O, LSE, seq_len, heads, head_dim, stride_qkv_b, stride_qkv_s, stride_o_b,
                              stride_o_s, scale_log2, length_class, CAUSAL: tl.constexpr, BLOCK: tl.constexpr,
                              HEAD_BLOCK: tl.constexpr, PREC: tl.constexpr):
    """Program (sample * heads + head, query block): that block's rows of O and of LSE [b * heads, padded]."""
    program, block = tl.program_id(0), tl.program_id(1)
    sample, head = program // heads, program % heads
    width = heads * head_dim
    rows, dims = block * BLOCK + tl.arange(0, BLOCK), tl.arange(0, HEAD_BLOCK)
    qkv_at = sample * stride_qkv_b
    q = _tile(QKV, qkv_at, stride_qkv_s, rows, head * head_dim, dims, seq_len, head_dim)
    row_max = tl.full([BLOCK], float("-inf"), LSE.dtype.element_ty)
    row_sum = tl.zeros([BLOCK], LSE.dtype.element_ty)
    out = tl.zeros([BLOCK, HEAD_BLOCK], LSE.dtype.element_ty)
    end = tl.minimum(seq_len, (block + 1) * BLOCK) if CAUSAL else seq_len
    for start in range(0, end, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        k = _tile(QKV, qkv_at, stride_qkv_s, cols, width + head * head_dim, dims, seq_len, head_dim)
        v = _tile(QKV, qkv_at, stride_qkv_s, cols, 2 * width + head * head_dim, dims, seq_len, head_dim)
        scores = _scores(q, k, rows, cols, seq_len, scale_log2, CAUSAL, PREC)
        new_max = tl.maximum(row_max, tl.max(scores, 1))  # finite: every row sees a key in its first block
        rescale = tl.exp2(row_max - new_max)
        p = tl.exp2(scores - new_max[:, None])
        row_sum = row_sum * rescale + tl.sum(p, 1)
        out = out * rescale[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC)
        row_max = new_max
    out = out / row_sum[:, None]
    out_at = O + sample * stride_o_b + rows[:, None] * stride_o_s + head * head_dim + dims[None, :]
    tl.store(out_at, out.to(O.dtype.element_ty), mask=(rows[:, None] < seq_len) & (dims[None, :] < head_dim))
    tl.store(LSE + program * tl.num_programs(1) * BLOCK + rows, row_max + tl.log2(row_sum))


@triton.autotune(configs=_loop_configs(), key=["length_class", "head_dim"], **KEEP_TUNING)
@triton.jit
def attention_bwd_loop_kernel(QKV, O, dO, LSE, dQKV, seq_len, heads, head_dim, stride_qkv_b, stride_qkv_s, stride_o_b,
                              stride_o_s, stride_do_b, stride_do_s, scale, scale_log2, length_class,
                              CAUSAL: tl.constexpr, BLOCK: tl.constexpr, HEAD_BLOCK: tl.constexpr,
                              PREC: tl.constexpr):
    """Program (sample * heads + head, block n): block n's dK, dV and dQ into dQKV, laid out as QKV (contiguous)."""
    program, block = tl.program_id(0), tl.program_id(1)
    sample, head = program // heads, program % heads
    width = heads * head_dim
    padded = tl.num_programs(1) * BLOCK
    own, dims = block * BLOCK + tl.arange(0, BLOCK), tl.arange(0, HEAD_BLOCK)
    qkv_at = sample * stride_qkv_b
    k = _tile(QKV, qkv_at, stride_qkv_s, own, width + head * head_dim, dims, seq_len, head_dim)
    v = _tile(QKV, qkv_at, stride_qkv_s, own, 2 * width + head * head_dim, dims, seq_len, head_dim)
    dk = tl.zeros([BLOCK, HEAD_BLOCK], LSE.dtype.element_ty)
    dv = tl.zeros([BLOCK, HEAD_BLOCK], LSE.dtype.element_ty)
    for start in range(block * BLOCK if CAUSAL else 0, seq_len, BLOCK):  # the query blocks that see block n's keys
        rows = start + tl.arange(0, BLOCK)
        q, do, lse, delta = _query_block(QKV, O, dO, LSE, program, sample, rows, dims, seq_len, padded, head, head_dim,
                                         stride_qkv_b, stride_qkv_s, stride_o_b, stride_o_s, stride_do_b, stride_do_s)
        p = tl.exp2(_scores(q, k, rows, own, seq_len, scale_log2, CAUSAL, PREC) - lse[:, None])
        dv += tl.dot(tl.trans(p).to(do.dtype), do, input_precision=PREC)
        ds = (p * (tl.dot(do, tl.trans(v), input_precision=PREC) - delta[:, None])).to(q.dtype)
        dk += tl.dot(tl.trans(ds), q, input_precision=PREC)

    q, do, lse, delta = _query_block(QKV, O, dO, LSE, program, sample, own, dims, seq_len, padded, head, head_dim,
                                     stride_qkv_b, stride_qkv_s, stride_o_b, stride_o_s, stride_do_b, stride_do_s)
    dq = tl.zeros([BLOCK, HEAD_BLOCK], LSE.dtype.element_ty)
    end = tl.minimum(seq_len, (block + 1) * BLOCK) if CAUSAL else seq_len
    for start in range(0, end, BLOCK):  # the key blocks block n's queries see
        cols = start + tl.arange(0, BLOCK)
        k_j = _tile(QKV, qkv_at, stride_qkv_s, cols, width + head * head_dim, dims, seq_len, head_dim)
        v_j = _tile(QKV, qkv_at, stride_qkv_s, cols, 2 * width + head * head_dim, dims, seq_len, head_dim)
        p = tl.exp2(_scores(q, k_j, own, cols, seq_len, scale_log2, CAUSAL, PREC) - lse[:, None])
        ds = (p * (tl.dot(do, tl.trans(v_j), input_precision=PREC) - delta[:, None])).to(q.dtype)
        dq += tl.dot(ds, k_j, input_precision=PREC)

    grad_at = dQKV + sample * (3 * width * seq_len) + own[:, None] * (3 * width) + head * head_dim + dims[None, :]
    mask = (own[:, None] < seq_len) & (dims[None, :] < head_dim)
    tl.store(grad_at, (dq * scale).to(dQKV.dtype.element_ty), mask=mask)
    tl.store(grad_at + width, (dk * scale).to(dQKV.dtype.element_ty), mask=mask)
    tl.store(grad_at + 2 * width, dv.to(dQKV.dtype.element_ty), mask=mask)
