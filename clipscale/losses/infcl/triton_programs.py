"""The Inf-CL tile primitives' Triton programs: what runs on the device.

`kernels.py` launches them (grid, workspace, precision); this file holds the
programs themselves, their autotune configurations beside them, as in the
Triton tutorials. kernels.py takes it from `clipscale.triton_modes.programs`,
decorated for each call's mode (compiled, or Triton's interpreter).

Reference math (logits x_ij = s * <I_i, T_j>, i < m rows, j < n columns,
entries with mask_diagonal and row_offset + i == col_offset + j are -inf):

    row_lse_i = log sum_j exp(x_ij)          col_lse_j = log sum_i exp(x_ij)
    G_ij      = rw_i exp(x_ij - row_lse_i) + cw_j exp(x_ij - col_lse_j)

Inside the programs everything is in base 2 (x * log2 e, exp2, log2): one
multiply folded into the score scale, and exp2/log2 are the native MUFU ops.

`lse_fwd_kernel` (one product, both directions): a persistent grid of
P = RS x CS programs (P ~ #SMs) cuts the m x n plane into RS row groups and CS
column groups; program (r, c) owns the row blocks r, r+RS, ... and the column
blocks c, c+CS, ...  It walks its row blocks, and for each one all of its
column blocks, computing the score tile once (K-loop over d) and from that one
tile

  * the row statistics online (running max and sum in registers, as in
    flash-attention), written once per row block as a partial row LSE, and
  * the column statistics of the tile (max, sum of exp2) merged into the
    program's own slot of the partial column LSE (read-modify-write of
    BLOCK_N floats per tile; no other program touches that slot, so no
    atomics and no races).

`merge_kernel` then merges the partials (logsumexp over RS resp. CS).

`weights_kernel` (backward): recomputes one score tile and writes its weights
s * G (the positive logit's -pw_i folded in) into the workspace, plus the
tile's share of dL/ds; the two gradient products are GEMMs on the host side.

`rowdot_kernel`: the positive logits <I_i, T_p(i)>.

`PREC` is `tl.dot`'s input_precision for float32 inputs: "ieee" (full float32
on the FMA units) or "tf32"; bf16/fp16 inputs always accumulate in float32.
"""

from __future__ import annotations

import os
from types import MappingProxyType

import torch
import triton
import triton.language as tl

from clipscale.triton_modes import KEEP_TUNING, interpreting

LOG2E = tl.constexpr(1.4426950408889634)  # log2(e): natural-log scores to base 2
LN2 = tl.constexpr(0.6931471805599453)  # ln(2): base-2 LSEs back to natural log
NEG_INF = tl.constexpr(float("-inf"))
# The column fast path's smallest column sum (2^-50): above it every term that matters is normal.
MIN_FAST_COLUMN_SUM = tl.constexpr(2.0**-50)

# The mode @triton.jit decorates these programs in, read as it reads it: kernels.py asks
# `clipscale.triton_modes` for this module as decorated for each call's mode.
INTERPRET = interpreting()

# Triton's interpreter mis-multiplies bf16 dots (it sees the raw bits): there the
# tiles are widened to float32 first, which is the same math (bf16 x bf16 products
# are exact in float32, accumulation is float32 either way).
_UPCAST = tl.constexpr(INTERPRET)

# Autotune the tile configs (False: one default config per precision).
TUNE = os.environ.get("CLIPSCALE_TUNE", "1") != "0"


def bucket(x: int) -> int:
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


MIN_TILE = (min(c.kwargs["BM"] for c in _configs_mma()), min(c.kwargs["BN"] for c in _configs_mma()))


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


_HEURISTICS = MappingProxyType({
    "EVEN_D": lambda a: a["d"] % a["BK"] == 0,
    "EVEN_M": lambda a: a["m"] % a["BM"] == 0,
    "EVEN_N": lambda a: a["n"] % a["BN"] == 0,
})


# ----------------------------------------------------------------------------
# Forward: row and column LSE in one pass (persistent grid, partial LSEs)
# ----------------------------------------------------------------------------
@triton.jit
def _finite_shift(x):
    """x, or 0 where x is -inf: subtracting it keeps exp2(-inf - shift) = 0 instead of NaN."""
    return tl.where(x == NEG_INF, 0.0, x)


@triton.jit
def _logaddexp2(a, b):
    """log2(2^a + 2^b); -inf when both are."""
    hi = tl.maximum(a, b)
    shift = _finite_shift(hi)
    return hi + tl.log2(tl.exp2(a - shift) + tl.exp2(b - shift))


@triton.jit
def _tile_column_lse(s, e, m_new, r_max, cols, n, EVEN_N: tl.constexpr):
    """Base-2 LSE of every column of the score tile `s`, given the row pass's
    e = exp2(s - m_new) (m_new the rows' running max after this tile, r_max this
    tile's row max).

    Fast path reuses e: exp2(s_ij - M) = e_ij * exp2(m_new_i - M), M the tile max,
    a weighted column sum instead of a second exp2 per logit. Exact while no row's
    running max exceeds M by > 50 and every column's sum is >= 2^-50 (then every
    significant term is a normal float); otherwise (rare: far-apart logits, masked
    edges) the direct path.
    """
    t_max = tl.max(r_max, 0)
    c_sum = tl.sum(e * tl.exp2(m_new - _finite_shift(t_max))[:, None], 0)
    if EVEN_N:
        c_min = tl.min(c_sum, 0)
    else:
        c_min = tl.min(tl.where(cols < n, c_sum, 1.0), 0)
    if (tl.max(m_new, 0) - t_max <= 50.0) & (c_min >= MIN_FAST_COLUMN_SUM):
        t_lse = t_max + tl.log2(c_sum)
    else:
        c_max = tl.max(s, 0)
        t_lse = c_max + tl.log2(tl.sum(tl.exp2(s - _finite_shift(c_max)[None, :]), 0))
    return t_lse


@triton.jit
def _merge_column_lse(PART_COL, pr, rb, cols, n, t_lse):
    """Merge a tile's column LSEs into program row `pr`'s slot of the partials;
    the program's first row block (rb == pr) overwrites (idempotent launches)."""
    p_ptrs = PART_COL + pr * n + cols
    old = tl.load(p_ptrs, mask=(cols < n) & (rb != pr), other=NEG_INF)
    tl.store(p_ptrs, _logaddexp2(old, t_lse), mask=cols < n)


@triton.autotune(configs=_configs_mma(), key=["d", "B_BUCKET"],
                 prune_configs_by={"early_config_prune": _prune}, **KEEP_TUNING)
@triton.heuristics(_HEURISTICS)
@triton.jit
def lse_fwd_kernel(I, T, PART_ROW, PART_COL, SC, m, n, d, stride_i, stride_t,
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
    qk_scale = tl.load(SC).to(tl.float32) * LOG2E  # s * log2(e), read on the device
    NEED_MASK: tl.constexpr = MASK_DIAG or not (EVEN_M and EVEN_N)
    pid = tl.program_id(0)
    pr = pid // CS
    pc = pid % CS
    RB = tl.cdiv(m, BM)
    CB = tl.cdiv(n, BN)
    offs_m = tl.arange(0, BM)
    offs_n = tl.arange(0, BN)
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
            m_safe = _finite_shift(m_new)
            e = tl.exp2(s - m_safe[:, None])  # <= 1; the only exp2 per logit on the fast path
            l_i = l_i * tl.exp2(m_i - m_safe) + tl.sum(e, 1)
            m_i = m_new
            if NEED_COL:  # -- columns: this tile's LSE, merged into the program's slot
                _merge_column_lse(PART_COL, pr, rb, cols, n, _tile_column_lse(s, e, m_new, r_max, cols, n, EVEN_N))
        tl.store(PART_ROW + pc * m + rows, m_i + tl.log2(l_i), mask=rows < m)


@triton.jit(do_not_specialize=["KA", "na", "KB", "nb"])  # both branches must see i32s
def merge_kernel(PA, OUTA, KA, na, PB, OUTB, KB, nb, BLOCK: tl.constexpr):
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
    mx = tl.full([BLOCK], NEG_INF, tl.float32)
    for k in range(0, K):
        mx = tl.maximum(mx, tl.load(P + k * n + offs, mask=mask, other=NEG_INF))
    shift = _finite_shift(mx)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for k in range(0, K):
        acc += tl.exp2(tl.load(P + k * n + offs, mask=mask, other=NEG_INF) - shift)
    tl.store(OUT + offs, (mx + tl.log2(acc)) * LN2, mask=mask)


# ----------------------------------------------------------------------------
# Backward: recompute each score tile once, write G into the workspace
# ----------------------------------------------------------------------------
@triton.autotune(configs=_configs_mma(), key=["d", "B_BUCKET"],
                 prune_configs_by={"early_config_prune": _prune}, **KEEP_TUNING)
@triton.heuristics(_HEURISTICS)
@triton.jit
def weights_kernel(I, T, RL, CL, RW, CW, PARTNER, PW, G, SC, GMAX, SG,
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
    s = raw * (sc * LOG2E)
    rmask = rows < m
    cmask = cols < n
    if HAS_ROW and HAS_COL:
        rl = tl.load(RL + rows, mask=rmask, other=NEG_INF) * LOG2E
        rw = tl.load(RW + rows, mask=rmask, other=0.0)
        cl = tl.load(CL + cols, mask=cmask, other=float("inf")) * LOG2E
        cw = tl.load(CW + cols, mask=cmask, other=0.0)
        # Fast path, one exp2 per logit: exp2(s - cl_j) = exp2(s - rl_i) * 2^(rl_i - c0) * 2^(c0 - cl_j)
        # with c0 = max_i rl_i. Exact while max rl - min cl <= 80 (no overflow, and every
        # term that matters stays a normal float); else both exp2s directly.
        rl_max = tl.max(rl, 0)
        if rl_max - tl.min(cl, 0) <= 80.0:
            c0 = _finite_shift(rl_max)
            e = tl.exp2(s - rl[:, None])
            cwb = cw * tl.exp2(c0 - cl)
            g = e * (rw[:, None] + cwb[None, :] * tl.exp2(rl - c0)[:, None])
        else:
            g = rw[:, None] * tl.exp2(s - rl[:, None]) + cw[None, :] * tl.exp2(s - cl[None, :])
    elif HAS_ROW:
        rl = tl.load(RL + rows, mask=rmask, other=0.0) * LOG2E
        rw = tl.load(RW + rows, mask=rmask, other=0.0)
        g = rw[:, None] * tl.exp2(s - rl[:, None])
    else:
        cl = tl.load(CL + cols, mask=cmask, other=0.0) * LOG2E
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
def rowdot_kernel(I, T, P, OUT, m, d, stride_i, stride_t, BR: tl.constexpr, BD: tl.constexpr):
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
