"""Inf-CL tile primitives as fused Triton kernels.

Implements exactly the contract of `clipscale/losses/infcl/__init__.py`
(`lse_pass`, `grad_pass`); `reference.py` is the same in plain PyTorch.

Reference math (logits x_ij = s * <I_i, T_j>, i < m rows, j < n columns,
entries with mask_diagonal and row_offset + i == col_offset + j are -inf):

    row_lse_i = log sum_j exp(x_ij)          col_lse_j = log sum_i exp(x_ij)
    G_ij      = rw_i exp(x_ij - row_lse_i) + cw_j exp(x_ij - col_lse_j)
    dI       += s * G @ T                    dT       += s * G^T @ I

Inside the kernels everything is in base 2 (x * log2 e, exp2, log2): one
multiply folded into the score scale, and exp2/log2 are the native MUFU ops.

Forward, `lse_pass` (one product, both directions)
---------------------------------------------------
A persistent grid of P = RS x CS programs (P ~ #SMs) cuts the m x n plane
into RS row groups and CS column groups; program (r, c) owns the row blocks
r, r+RS, ... and the column blocks c, c+CS, ...  It walks its row blocks, and
for each one all of its column blocks, computing the score tile once
(K-loop over d) and from that one tile

  * the row statistics online (running max and sum in registers, as in
    flash-attention), written once per row block as a partial row LSE, and
  * the column statistics of the tile (max, sum of exp2) merged into the
    program's own slot of the partial column LSE (read-modify-write of
    BLOCK_N floats per tile; no other program touches that slot, so no
    atomics and no races).

A tiny second kernel merges the partials (logsumexp over RS resp. CS).
Memory: (RS * n + CS * m) float32 partials + the two outputs. With RS, CS
near sqrt(#SMs) (about 11 x 12 on an H100) that is ~ 23 * b floats, i.e.
92 MB at b = 1M, independent of d; nothing of size m x n.

Backward, `grad_pass` (one recompute + the two gradient products)
-----------------------------------------------------------------
The gradient products contract over the *other* dimension of the tile
(dI over columns, dT over rows) and produce [*, d] outputs: a [BLOCK, d]
float32 accumulator does not fit in registers for d = 512..1024, and
splitting d would repeat the score recompute (a product over d) once per
d-chunk. Instead the plane is walked in super-tiles of H x W (default at
most 8192 x 16384): one Triton kernel recomputes the score tiles of the
super-tile and writes the weight matrix G (bf16 for bf16 inputs, fp16 with
a scale for fp16, float32 for float32 inputs) into a fixed workspace; then
two large GEMMs accumulate  dI[H] += s G @ T[W]  and  dT[W] += s G^T @ I[H]
in float32 (cuBLAS with float32 output on CUDA; plain torch on CPU).
Products: exactly 3 b^2 d multiply-adds (recompute, dI, dT): the floor.
Memory: the workspace, min(m, H) * min(n, W) elements (at most 256 MiB in
bf16, 512 MiB in float32), plus one [H, d] float32 temporary: a constant,
independent of b. The extra traffic (G written once, read twice: 6 bytes
per logit in bf16) is far below what the products take at d >= 64.

Precision: bf16/fp16 products accumulate in float32, all softmax math is
float32. `exact=True` with float32 inputs uses IEEE fp32 dots in Triton
(`input_precision="ieee"`) and disables TF32 for the GEMMs; float32 inputs
without `exact` use TF32 in both.

Under TRITON_INTERPRET=1 the same kernels run on CPU tensors (one small
tile config; the GEMMs run in float32 torch). `launch_counts` counts kernel
launches so tests can check that the Triton path really ran.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import math
import os

import torch
import triton
import triton.language as tl

__all__ = ["lse_pass", "grad_pass", "positive_logits", "launch_counts"]

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")

# Triton's interpreter mis-multiplies bf16 dots (it sees the raw bits): there the
# tiles are widened to float32 first, which is the same math (bf16 x bf16 products
# are exact in float32, accumulation is float32 either way).
_UPCAST = tl.constexpr(INTERPRET)

# Kernel launches per kernel name (tests assert the Triton path ran).
launch_counts: collections.Counter = collections.Counter()

# Backward workspace: super-tile of at most MAX_H rows and WORKSPACE_ELEMS
# elements in all (module-level so tests can shrink them).
MAX_H = 8192
WORKSPACE_ELEMS = 1 << 27

# Autotune the tile configs (False: one default config per precision).
TUNE = os.environ.get("CLIPSCALE_TUNE", "1") != "0"


def _bucket(x: int) -> int:
    """Coarse size class for the autotune key (few entries, few retunes)."""
    return 0 if x <= 16384 else (1 if x <= 131072 else 2)


# ----------------------------------------------------------------------------
# Autotune configurations (beside the kernels, as in the Triton tutorials).
# bf16/fp16 and tf32: 128-row tiles, the probe's best was 128 x 256 / 8 warps /
# 3 stages at d = 512. IEEE fp32 dots run on the FMA units: smaller tiles.
# ----------------------------------------------------------------------------
def _configs_mma():
    if INTERPRET:
        return [triton.Config({"BM": 32, "BN": 16, "BK": 32, "OCC": 1}, num_warps=4, num_stages=1)]
    cfg = [
        # (BM, BN, BK, warps, stages, OCC): OCC = persistent programs per SM (forward only;
        # 2 lets one program's softmax epilogue overlap the other's MMAs when both fit).
        (128, 128, 64, 8, 3, 1),
        (128, 256, 64, 8, 3, 1),
        (128, 256, 32, 8, 4, 1),
        (128, 128, 64, 4, 4, 1),
        (64, 128, 64, 4, 4, 1),
        (64, 64, 32, 4, 2, 1),
        (32, 32, 32, 4, 2, 1),
        (128, 128, 32, 4, 4, 2),
        (128, 128, 64, 8, 2, 2),
        (128, 128, 32, 8, 4, 2),
        (64, 256, 32, 4, 4, 2),
    ]
    return [triton.Config({"BM": bm, "BN": bn, "BK": bk, "OCC": occ}, num_warps=w, num_stages=st)
            for bm, bn, bk, w, st, occ in cfg]


_MIN_TILE = (min(c.kwargs["BM"] for c in _configs_mma()), min(c.kwargs["BN"] for c in _configs_mma()))


def _prune(configs, named_args, **kwargs):
    """IEEE fp32 -> the FMA-sized tiles; MMA dtypes -> the big tiles (the small
    ones stay only for tiny problems). OCC > 1 only for the persistent forward."""
    if INTERPRET:
        return configs
    persistent = "RS2" in named_args
    configs = [c for c in configs if persistent or c.kwargs["OCC"] == 1]
    ieee = named_args.get("PREC", kwargs.get("PREC")) == "ieee" and named_args["I"].dtype == torch.float32
    if not TUNE:  # one sensible config, no autotuning (quick checks, CI-like runs)
        want = (64, 64) if ieee else (128, 128)
        return [c for c in configs if (c.kwargs["BM"], c.kwargs["BN"]) == want and c.kwargs["OCC"] == 1][:1]
    small = [c for c in configs if c.kwargs["BM"] * c.kwargs["BN"] <= 64 * 64]
    big = [c for c in configs if c.kwargs["BM"] * c.kwargs["BN"] > 64 * 64]
    if ieee:
        return small
    if named_args["d"] > 256 and named_args["I"].dtype == torch.float32:
        big = [c for c in big if c.kwargs["BN"] <= 128]  # tf32 tiles are twice the bytes
    return big


# ----------------------------------------------------------------------------
# Shared device helpers
# ----------------------------------------------------------------------------
@triton.jit
def _scores(I, T, rows, cols, m, n, d, stride_i, stride_t,
            BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
            EVEN_D: tl.constexpr, EVEN_M: tl.constexpr, EVEN_N: tl.constexpr, PREC: tl.constexpr):
    """One tile of raw dot products I[rows] @ T[cols]^T (float32 accumulation).
    K-loop over d in chunks of BK; out-of-range rows/columns load zeros."""
    offs_k = tl.arange(0, BK)
    rmask = rows < m
    cmask = cols < n
    i_ptrs = I + rows[:, None].to(tl.int64) * stride_i + offs_k[None, :]
    t_ptrs = T + cols[:, None].to(tl.int64) * stride_t + offs_k[None, :]
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for k in range(0, d, BK):
        if EVEN_D:
            if EVEN_M:
                a = tl.load(i_ptrs)
            else:
                a = tl.load(i_ptrs, mask=rmask[:, None], other=0.0)
            if EVEN_N:
                b = tl.load(t_ptrs)
            else:
                b = tl.load(t_ptrs, mask=cmask[:, None], other=0.0)
        else:
            kmask = (offs_k + k) < d
            a = tl.load(i_ptrs, mask=rmask[:, None] & kmask[None, :], other=0.0)
            b = tl.load(t_ptrs, mask=cmask[:, None] & kmask[None, :], other=0.0)
        if _UPCAST:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, tl.trans(b), acc, input_precision=PREC)
        i_ptrs += BK
        t_ptrs += BK
    return acc


@triton.jit
def _valid(rows, cols, m, n, row_off, col_off, MASK_DIAG: tl.constexpr):
    ok = (rows[:, None] < m) & (cols[None, :] < n)
    if MASK_DIAG:
        ok = ok & ((rows[:, None] + row_off) != (cols[None, :] + col_off))
    return ok


_HEURISTICS = {
    "EVEN_D": lambda a: a["d"] % a["BK"] == 0,
    "EVEN_M": lambda a: a["m"] % a["BM"] == 0,
    "EVEN_N": lambda a: a["n"] % a["BN"] == 0,
}


# ----------------------------------------------------------------------------
# Forward: row and column LSE in one pass (persistent grid, partial LSEs)
# ----------------------------------------------------------------------------
@triton.autotune(configs=_configs_mma(), key=["d", "B_BUCKET"],
                 prune_configs_by={"early_config_prune": _prune})
@triton.heuristics(_HEURISTICS)
@triton.jit
def _lse_fwd_kernel(I, T, PART_ROW, PART_COL, SC, m, n, d, stride_i, stride_t,
                    row_off, col_off, RS1, CS1, RS2, CS2, B_BUCKET,
                    MASK_DIAG: tl.constexpr, NEED_COL: tl.constexpr, PREC: tl.constexpr,
                    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, OCC: tl.constexpr,
                    EVEN_D: tl.constexpr, EVEN_M: tl.constexpr, EVEN_N: tl.constexpr):
    # PART_ROW[CS, m], PART_COL[RS, n]: base-2 LSEs of this program's share.
    # (RS, CS) = (RS1, CS1) with one program per SM, (RS2, CS2) with OCC = 2 per SM.
    if OCC == 2:
        RS = RS2
        CS = CS2
    else:
        RS = RS1
        CS = CS1
    qk_scale = tl.load(SC).to(tl.float32) * 1.4426950408889634  # s * log2(e), read on the device
    NEED_MASK: tl.constexpr = MASK_DIAG or not (EVEN_M and EVEN_N)
    pid = tl.program_id(0)
    pr = pid // CS
    pc = pid % CS
    RB = tl.cdiv(m, BM)
    CB = tl.cdiv(n, BN)
    offs_m = tl.arange(0, BM)
    offs_n = tl.arange(0, BN)
    NEG_INF: tl.constexpr = float("-inf")
    if NEED_COL:
        # A program with no row block still owns its column slots.
        if pr >= RB:
            for cb in range(pc, CB, CS):
                cols = cb * BN + offs_n
                tl.store(PART_COL + pr * n + cols, tl.full([BN], NEG_INF, tl.float32), mask=cols < n)
    for rb in range(pr, RB, RS):
        rows = rb * BM + offs_m
        m_i = tl.full([BM], NEG_INF, tl.float32)   # running row max
        l_i = tl.zeros([BM], dtype=tl.float32)      # running row sum of exp2(s - m_i)
        for cb in range(pc, CB, CS):
            cols = cb * BN + offs_n
            s = _scores(I, T, rows, cols, m, n, d, stride_i, stride_t,
                        BM, BN, BK, EVEN_D, EVEN_M, EVEN_N, PREC) * qk_scale
            if NEED_MASK:
                s = tl.where(_valid(rows, cols, m, n, row_off, col_off, MASK_DIAG), s, NEG_INF)
            # -- rows: online max / rescaled sum (flash-attention style)
            r_max = tl.max(s, 1)
            m_new = tl.maximum(m_i, r_max)
            m_safe = tl.where(m_new == NEG_INF, 0.0, m_new)
            e = tl.exp2(s - m_safe[:, None])  # <= 1; the only exp2 per logit on the fast path
            l_i = l_i * tl.exp2(m_i - m_safe) + tl.sum(e, 1)
            m_i = m_new
            if NEED_COL:
                # -- columns: this tile's LSE, merged into the program's slot.
                # Fast path reuses e: exp2(s_ij - M) = e_ij * exp2(m_new_i - M), M the
                # tile max, a weighted column sum instead of a second exp2 per logit.
                # Exact while no row's running max exceeds M by > 50 and every column's
                # sum is >= 2^-50 (then every significant term is a normal float);
                # otherwise (rare: far-apart logits, masked edges) the direct path.
                t_max = tl.max(r_max, 0)
                t_safe = tl.where(t_max == NEG_INF, 0.0, t_max)
                c_sum = tl.sum(e * tl.exp2(m_new - t_safe)[:, None], 0)
                if EVEN_N:
                    c_min = tl.min(c_sum, 0)
                else:
                    c_min = tl.min(tl.where(cols < n, c_sum, 1.0), 0)
                fast = (tl.max(m_new, 0) - t_max <= 50.0) & (c_min >= 8.881784197001252e-16)
                if fast:
                    t_lse = t_max + tl.log2(c_sum)
                else:
                    c_max = tl.max(s, 0)
                    c_safe = tl.where(c_max == NEG_INF, 0.0, c_max)
                    t_lse = c_max + tl.log2(tl.sum(tl.exp2(s - c_safe[None, :]), 0))
                p_ptrs = PART_COL + pr * n + cols
                # the first row block of the program overwrites (idempotent launches)
                old = tl.load(p_ptrs, mask=(cols < n) & (rb != pr), other=NEG_INF)
                hi = tl.maximum(old, t_lse)
                hi_safe = tl.where(hi == NEG_INF, 0.0, hi)
                new = hi + tl.log2(tl.exp2(old - hi_safe) + tl.exp2(t_lse - hi_safe))
                tl.store(p_ptrs, new, mask=cols < n)
        tl.store(PART_ROW + pc * m + rows, m_i + tl.log2(l_i), mask=rows < m)


@triton.jit(do_not_specialize=["KA", "na", "KB", "nb"])  # both branches must see i32s
def _merge_kernel(PA, OUTA, KA, na, PB, OUTB, KB, nb, BLOCK: tl.constexpr):
    """OUT[j] = ln2 * log2 sum_k exp2(P[k, j])   (P: [K, n] base-2 LSEs), for two
    (P, OUT) pairs in one launch: the first cdiv(na, BLOCK) programs do A."""
    pid = tl.program_id(0)
    nblk_a = tl.cdiv(na, BLOCK)
    if pid < nblk_a:
        P, OUT, K, n, blk = PA, OUTA, KA, na, pid
    else:
        P, OUT, K, n, blk = PB, OUTB, KB, nb, pid - nblk_a
    offs = blk * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    NEG_INF: tl.constexpr = float("-inf")
    mx = tl.full([BLOCK], NEG_INF, tl.float32)
    for k in range(0, K):
        mx = tl.maximum(mx, tl.load(P + k * n + offs, mask=mask, other=NEG_INF))
    mx_safe = tl.where(mx == NEG_INF, 0.0, mx)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for k in range(0, K):
        acc += tl.exp2(tl.load(P + k * n + offs, mask=mask, other=NEG_INF) - mx_safe)
    tl.store(OUT + offs, (mx + tl.log2(acc)) * 0.6931471805599453, mask=mask)


# ----------------------------------------------------------------------------
# Backward: recompute each score tile once, write G into the workspace
# ----------------------------------------------------------------------------
@triton.autotune(configs=_configs_mma(), key=["d", "B_BUCKET"],
                 prune_configs_by={"early_config_prune": _prune})
@triton.heuristics(_HEURISTICS)
@triton.jit
def _weights_kernel(I, T, RL, CL, RW, CW, PARTNER, PW, G, SC, GMAX, SG,
                    m, n, d, stride_i, stride_t, stride_g, row_off, col_off, pos_off, B_BUCKET,
                    MASK_DIAG: tl.constexpr, HAS_ROW: tl.constexpr, HAS_COL: tl.constexpr,
                    HAS_POS: tl.constexpr, NEED_SG: tl.constexpr, HALF: tl.constexpr,
                    PREC: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                    OCC: tl.constexpr, EVEN_D: tl.constexpr, EVEN_M: tl.constexpr, EVEN_N: tl.constexpr):
    # G'[i, j] = rw_i exp2(s_ij - rl_i) + cw_j exp2(s_ij - cl_j) - pw_i [pos_off + j == partner_i],
    # 0 where masked; stored as s * G' (s the logit scale, read on the device), and for
    # fp16 as s * G' / gmax. SG[pid] = sum over the tile of G'_ij <I_i, T_j> (float32,
    # before rounding): the tile's share of dL/ds.
    # 1-D grid, column blocks fastest: neighbouring programs share the row block
    # of I and sweep the (L2-resident) column super-block of T.
    pid = tl.program_id(0)
    CB = tl.cdiv(n, BN)
    rows = (pid // CB) * BM + tl.arange(0, BM)
    cols = (pid % CB) * BN + tl.arange(0, BN)
    sc = tl.load(SC).to(tl.float32)
    raw = _scores(I, T, rows, cols, m, n, d, stride_i, stride_t,
                  BM, BN, BK, EVEN_D, EVEN_M, EVEN_N, PREC)
    s = raw * (sc * 1.4426950408889634)
    rmask = rows < m
    cmask = cols < n
    if HAS_ROW and HAS_COL:
        rl = tl.load(RL + rows, mask=rmask, other=float("-inf")) * 1.4426950408889634
        rw = tl.load(RW + rows, mask=rmask, other=0.0)
        cl = tl.load(CL + cols, mask=cmask, other=float("inf")) * 1.4426950408889634
        cw = tl.load(CW + cols, mask=cmask, other=0.0)
        # Fast path, one exp2 per logit: exp2(s - cl_j) = exp2(s - rl_i) * 2^(rl_i - c0) * 2^(c0 - cl_j)
        # with c0 = max_i rl_i. Exact while max rl - min cl <= 80 (no overflow, and every
        # term that matters stays a normal float); else both exp2s directly.
        rl_max = tl.max(rl, 0)
        if rl_max - tl.min(cl, 0) <= 80.0:
            c0 = tl.where(rl_max == float("-inf"), 0.0, rl_max)
            e = tl.exp2(s - rl[:, None])
            cwb = cw * tl.exp2(c0 - cl)
            g = e * (rw[:, None] + cwb[None, :] * tl.exp2(rl - c0)[:, None])
        else:
            g = rw[:, None] * tl.exp2(s - rl[:, None]) + cw[None, :] * tl.exp2(s - cl[None, :])
    elif HAS_ROW:
        rl = tl.load(RL + rows, mask=rmask, other=0.0) * 1.4426950408889634
        rw = tl.load(RW + rows, mask=rmask, other=0.0)
        g = rw[:, None] * tl.exp2(s - rl[:, None])
    else:
        cl = tl.load(CL + cols, mask=cmask, other=0.0) * 1.4426950408889634
        cw = tl.load(CW + cols, mask=cmask, other=0.0)
        g = cw[None, :] * tl.exp2(s - cl[None, :])
    if HAS_POS:  # the positive logit's -(a_i + c_p(i)), folded in before any rounding
        p = tl.load(PARTNER + rows, mask=rmask, other=-1).to(tl.int64)
        pw = tl.load(PW + rows, mask=rmask, other=0.0)
        g = g - tl.where((cols[None, :] + pos_off) == p[:, None], pw[:, None], 0.0)
    if MASK_DIAG or not (EVEN_M and EVEN_N):
        g = tl.where(_valid(rows, cols, m, n, row_off, col_off, MASK_DIAG), g, 0.0)
    if NEED_SG:
        tl.store(SG + pid, tl.sum(tl.sum(g * raw, 1), 0))
    factor = sc
    if HALF:
        factor = sc / tl.load(GMAX).to(tl.float32)
    g_ptrs = G + rows[:, None].to(tl.int64) * stride_g + cols[None, :]
    if EVEN_M and EVEN_N:
        tl.store(g_ptrs, (g * factor).to(G.dtype.element_ty))
    else:
        tl.store(g_ptrs, (g * factor).to(G.dtype.element_ty), mask=rmask[:, None] & cmask[None, :])


@triton.jit
def _rowdot_kernel(I, T, P, OUT, m, d, stride_i, stride_t, BR: tl.constexpr, BD: tl.constexpr):
    """OUT[i] = <I_i, T_P[i]> with float32 accumulation (the positive logits / s)."""
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    rmask = rows < m
    p = tl.load(P + rows, mask=rmask, other=0).to(tl.int64)
    offs = tl.arange(0, BD)
    acc = tl.zeros([BR], dtype=tl.float32)
    for k in range(0, d, BD):
        msk = rmask[:, None] & ((offs + k) < d)[None, :]
        a = tl.load(I + rows[:, None].to(tl.int64) * stride_i + (offs + k)[None, :], mask=msk, other=0.0)
        b = tl.load(T + p[:, None] * stride_t + (offs + k)[None, :], mask=msk, other=0.0)
        acc += tl.sum(a.to(tl.float32) * b.to(tl.float32), 1)
    tl.store(OUT + rows, acc, mask=rmask)


# ----------------------------------------------------------------------------
# Host side
# ----------------------------------------------------------------------------
def _check(image: torch.Tensor, text: torch.Tensor):
    if image.dim() != 2 or text.dim() != 2:
        raise ValueError(f"image and text must be 2-D, got {tuple(image.shape)} and {tuple(text.shape)}")
    if image.shape[1] != text.shape[1]:
        raise ValueError(f"feature dims differ: {image.shape[1]} vs {text.shape[1]}")
    if image.dtype != text.dtype:
        raise ValueError(f"dtypes differ: {image.dtype} vs {text.dtype}")
    if image.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"unsupported dtype {image.dtype} (float32, bfloat16, float16)")
    if image.device != text.device:
        raise ValueError("image and text are on different devices")
    if image.device.type != "cuda" and not INTERPRET:
        raise RuntimeError("Triton kernels need CUDA tensors (or TRITON_INTERPRET=1 for CPU)")
    if image.stride(1) != 1:
        image = image.contiguous()
    if text.stride(1) != 1:
        text = text.contiguous()
    return image, text


def _prec(dtype: torch.dtype, exact: bool) -> str:
    return "ieee" if (dtype == torch.float32 and exact) or INTERPRET else "tf32"


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _n_programs(device: torch.device) -> int:
    if device.type != "cuda":
        return 6
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=4096)
def _split(m: int, n: int, programs: int, tile: int = 128) -> tuple[int, int]:
    """(RS, CS) with RS * CS <= programs minimising the busiest program's
    nominal tile count, ties broken by the partials' size (RS * n + CS * m)."""
    rb, cb = max(1, -(-m // tile)), max(1, -(-n // tile))
    best = None
    for rs in range(1, min(programs, rb) + 1):
        cs = max(1, min(cb, programs // rs))
        key = (-(-rb // rs) * -(-cb // cs), rs * n + cs * m)
        if best is None or key < best[0]:
            best = (key, rs, cs)
    return best[1], best[2]


def _scale_tensor(scale, dev) -> torch.Tensor:
    """The logit scale as a 1-element float32 tensor on `dev`, which the kernels read
    themselves: a tensor scale never goes through the host (no synchronisation)."""
    if isinstance(scale, torch.Tensor):
        if scale.numel() != 1:
            raise ValueError(f"scale must be a single number, got shape {tuple(scale.shape)}")
        return scale.detach().reshape(1).to(device=dev, dtype=torch.float32)
    return torch.full((1,), float(scale), dtype=torch.float32, device=dev)


def lse_pass(image, text, scale, *, row_offset=0, col_offset=0, mask_diagonal=False,
             need_col=True, exact=False, _grid=None):
    """Row and column log-sum-exp of x = scale * image @ text.T, one pass.

    Returns (row_lse [m] float32, col_lse [n] float32 or None); -inf where every
    entry of the row/column is masked. `scale` is a Python number or a 1-element
    tensor (read by the kernel on the device). Extra memory: (RS*n + CS*m) float32
    partials, RS*CS ~ #SMs (or 2 #SMs; see the module docstring). `_grid=(RS, CS)`
    overrides the split (tests).
    """
    image, text = _check(image, text)
    m, d = image.shape
    n = text.shape[0]
    dev = image.device
    if m == 0 or n == 0:
        row = torch.full((m,), float("-inf"), dtype=torch.float32, device=dev)
        col = torch.full((n,), float("-inf"), dtype=torch.float32, device=dev) if need_col else None
        return row, col
    sc = _scale_tensor(scale, dev)
    if _grid is not None:
        (rs1, cs1), (rs2, cs2) = _grid, _grid
    else:
        programs = _n_programs(dev)
        (rs1, cs1), (rs2, cs2) = _split(m, n, programs), _split(m, n, 2 * programs)
    part_row = torch.empty((max(cs1, cs2), m), dtype=torch.float32, device=dev)
    part_col = torch.empty((max(rs1, rs2), n) if need_col else (1,), dtype=torch.float32, device=dev)

    def grid(meta):
        return (rs2 * cs2 if meta["OCC"] == 2 else rs1 * cs1,)

    _lse_fwd_kernel[grid](
        image, text, part_row, part_col, sc, m, n, d, image.stride(0), text.stride(0),
        int(row_offset), int(col_offset), rs1, cs1, rs2, cs2, _bucket(max(m, n)),
        MASK_DIAG=bool(mask_diagonal), NEED_COL=bool(need_col), PREC=_prec(image.dtype, exact))
    launch_counts["lse_fwd"] += 1
    rs, cs = (rs2, cs2) if _lse_fwd_kernel.best_config.kwargs["OCC"] == 2 else (rs1, cs1)
    row_lse = torch.empty((m,), dtype=torch.float32, device=dev)
    col_lse = torch.empty((n if need_col else 0,), dtype=torch.float32, device=dev)
    BLOCK = 256 if INTERPRET else 1024
    grid = (triton.cdiv(m, BLOCK) + (triton.cdiv(n, BLOCK) if need_col else 0),)
    _merge_kernel[grid](part_row, row_lse, cs, m, part_col, col_lse, rs, n if need_col else 0, BLOCK=BLOCK)
    launch_counts["merge"] += 1
    return row_lse, (col_lse if need_col else None)


def positive_logits(image, text, partner):
    """<image_i, text_partner[i]> for every row, float32 [m] (float32 accumulation;
    multiply by the scale for the logits). One small kernel, no float32 copies."""
    image, text = _check(image, text)
    m, d = image.shape
    out = torch.empty((m,), dtype=torch.float32, device=image.device)
    if m == 0:
        return out
    partner = partner.to(device=image.device).contiguous()
    BR, BD = (16, 32) if INTERPRET else (16, 128)
    _rowdot_kernel[(triton.cdiv(m, BR),)](image, text, partner, out, m, d, image.stride(0), text.stride(0),
                                          BR=BR, BD=BD)
    launch_counts["rowdot"] += 1
    return out


def _as_weight(w, size: int, dev) -> torch.Tensor | None:
    if w is None:
        return None
    if isinstance(w, torch.Tensor) and w.dim() > 0:
        if w.shape != (size,):
            raise ValueError(f"weight has shape {tuple(w.shape)}, expected ({size},)")
        return w.to(device=dev, dtype=torch.float32).contiguous()
    if isinstance(w, torch.Tensor):
        return w.detach().reshape(1).to(device=dev, dtype=torch.float32).expand(size).contiguous()
    return torch.full((size,), float(w), dtype=torch.float32, device=dev)


@contextlib.contextmanager
def _cublas_precision(allow_tf32: bool):
    """cuBLAS GEMMs with (allow) or without TF32 for float32, and bf16/fp16 products
    reduced in float32 (no reduced-precision split-K), restored afterwards."""
    mm = torch.backends.cuda.matmul
    saved = {}
    try:
        saved["allow_tf32"] = mm.allow_tf32
        saved["allow_bf16_reduced_precision_reduction"] = mm.allow_bf16_reduced_precision_reduction
        saved["allow_fp16_reduced_precision_reduction"] = mm.allow_fp16_reduced_precision_reduction
    except Exception:  # new fp32_precision API in use: leave it alone
        yield
        return
    mm.allow_tf32 = allow_tf32
    mm.allow_bf16_reduced_precision_reduction = False
    mm.allow_fp16_reduced_precision_reduction = False
    try:
        yield
    finally:
        for k, v in saved.items():
            setattr(mm, k, v)


def _acc_mm(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, factor: torch.Tensor | None = None):
    """out (float32) += a @ b [* factor, a 1-element tensor], float32 accumulation and output."""
    if out.device.type != "cuda":
        prod = a.float() @ b.float()
    elif a.dtype == torch.float32:
        if factor is None:
            out.addmm_(a, b)
            return
        prod = a @ b
    else:
        global _ADDMM_OUT_OK
        if _ADDMM_OUT_OK and factor is None:
            try:  # cuBLAS: C(fp32) += A(bf16) @ B(bf16), in place
                torch.addmm(out, a, b, out_dtype=torch.float32, out=out)
                return
            except (RuntimeError, TypeError):
                _ADDMM_OUT_OK = False
        prod = torch.mm(a, b, out_dtype=torch.float32)
    if factor is None:
        out.add_(prod)
    else:
        out.addcmul_(prod, factor)


_ADDMM_OUT_OK = True


def _super_tile(m: int, n: int) -> tuple[int, int]:
    h = min(m, MAX_H)
    w = min(n, max(1, WORKSPACE_ELEMS // h))
    if w < n and w >= 256:
        w -= w % 256
    return h, w


def grad_pass(image, text, scale, row_lse, col_lse, row_weight, col_weight, *,
              row_offset=0, col_offset=0, mask_diagonal=False,
              grad_image=None, grad_text=None, exact=False,
              positive=None, scale_grad=None, out_dtype=None):
    """grad_image += scale * G @ text, grad_text += scale * G^T @ image with
    G_ij = rw_i exp(x_ij - row_lse_i) + cw_j exp(x_ij - col_lse_j) (0 where masked;
    a term is absent when its weight is None) - pw_i [j == partner_i] when
    positive=(partner, pw) is given; scale_grad (a 1-element float32 tensor)
    += sum_ij G_ij <I_i, T_j>. Returns (grad_image, grad_text): float32, or
    fresh tensors of `out_dtype` where None was passed.

    One recompute of every score tile (Triton) into a bounded workspace of
    min(m, MAX_H) x min(n, WORKSPACE_ELEMS / H) elements, then two float32-
    accumulating GEMMs per super-tile (see the module docstring). The scale is
    read on the device: nothing here synchronises with the host.
    """
    image, text = _check(image, text)
    m, d = image.shape
    n = text.shape[0]
    dev = image.device
    out_dtype = out_dtype or torch.float32
    fresh = grad_image is None and grad_text is None
    for acc in (grad_image, grad_text):
        if acc is not None and acc.dtype != torch.float32:
            raise ValueError("grad_image / grad_text accumulators must be float32")
    rw = _as_weight(row_weight, m, dev)
    cw = _as_weight(col_weight, n, dev)
    has_row, has_col, has_pos = rw is not None, cw is not None, positive is not None
    if has_col and col_lse is None:
        raise ValueError("col_weight given without col_lse")
    if m == 0 or n == 0 or d == 0 or not (has_row or has_col or has_pos):
        return (torch.zeros((m, d), dtype=out_dtype, device=dev) if grad_image is None else grad_image,
                torch.zeros((n, d), dtype=out_dtype, device=dev) if grad_text is None else grad_text)
    sc = _scale_tensor(scale, dev)
    rl = row_lse.to(device=dev, dtype=torch.float32).contiguous() if has_row else None
    cl = col_lse.to(device=dev, dtype=torch.float32).contiguous() if has_col else None
    if has_pos:
        partner, pw = positive
        partner = partner.to(device=dev).contiguous()
        pw = _as_weight(pw, m, dev)
    dummy = torch.empty((1,), dtype=torch.float32, device=dev)

    # Workspace dtype: bf16 -> bf16 (fp32 range) holding s G; fp16 -> fp16 holding
    # s G / gmax (G <= gmax = max rw + max cw + max pw: no overflow; the GEMMs
    # multiply by gmax afterwards, a device tensor); fp32 -> fp32.
    half = image.dtype == torch.float16
    gmax = None
    if half:
        terms = [w.abs().max() for w in (rw, cw, pw if has_pos else None) if w is not None]
        gmax = torch.stack(terms).sum().clamp_min(1e-30).reshape(1)
    ws_dtype = image.dtype
    if dev.type != "cuda":
        ws_dtype = torch.float32 if image.dtype == torch.float32 else ws_dtype
    h_max, w_max = _super_tile(m, n)
    direct = (fresh and dev.type == "cuda" and not half and out_dtype == image.dtype
              and h_max == m and w_max == n)
    if not direct:
        if grad_image is None:
            grad_image = torch.zeros((m, d), dtype=torch.float32, device=dev)
        if grad_text is None:
            grad_text = torch.zeros((n, d), dtype=torch.float32, device=dev)
    workspace = torch.empty((h_max * w_max,), dtype=ws_dtype, device=dev)
    sg_part = None
    if scale_grad is not None:
        sg_part = torch.empty((triton.cdiv(h_max, _MIN_TILE[0]) * triton.cdiv(w_max, _MIN_TILE[1]),),
                              dtype=torch.float32, device=dev)
    prec = _prec(image.dtype, exact)
    cublas = _cublas_precision(not exact) if dev.type == "cuda" else contextlib.nullcontext()
    with cublas:
        for r0 in range(0, m, h_max):
            h = min(h_max, m - r0)
            img = image[r0:r0 + h]
            for c0 in range(0, n, w_max):
                w = min(w_max, n - c0)
                txt = text[c0:c0 + w]
                g = workspace[: h * w].view(h, w)

                def grid(meta, h=h, w=w):
                    return (triton.cdiv(h, meta["BM"]) * triton.cdiv(w, meta["BN"]),)

                _weights_kernel[grid](
                    img, txt,
                    rl[r0:r0 + h] if has_row else dummy, cl[c0:c0 + w] if has_col else dummy,
                    rw[r0:r0 + h] if has_row else dummy, cw[c0:c0 + w] if has_col else dummy,
                    partner[r0:r0 + h] if has_pos else dummy, pw[r0:r0 + h] if has_pos else dummy,
                    g, sc, gmax if half else dummy, sg_part if sg_part is not None else dummy,
                    h, w, d, img.stride(0), txt.stride(0), g.stride(0),
                    int(row_offset) + r0, int(col_offset) + c0, c0, _bucket(h * w // 8192),
                    MASK_DIAG=bool(mask_diagonal), HAS_ROW=has_row, HAS_COL=has_col, HAS_POS=has_pos,
                    NEED_SG=sg_part is not None, HALF=half, PREC=prec)
                launch_counts["weights"] += 1
                if sg_part is not None:
                    meta = _weights_kernel.best_config.kwargs
                    programs = triton.cdiv(h, meta["BM"]) * triton.cdiv(w, meta["BN"])
                    scale_grad.add_(sg_part[:programs].sum())
                if direct:  # one super-tile, fresh outputs: cuBLAS writes them in the input dtype
                    grad_image = torch.mm(g, txt)
                    grad_text = torch.mm(g.t(), img)
                else:
                    _acc_mm(grad_image[r0:r0 + h], g, txt, gmax)
                    _acc_mm(grad_text[c0:c0 + w], g.t(), img, gmax)
    if fresh and not direct and out_dtype != torch.float32:
        grad_image, grad_text = grad_image.to(out_dtype), grad_text.to(out_dtype)
    return grad_image, grad_text
