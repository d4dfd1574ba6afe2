"""Inf-CL tile primitives on the GPU: the host side of the Triton programs.

Implements exactly the contract of `clipscale/losses/infcl/__init__.py`
(`lse_pass`, `grad_pass`, `positive_logits`); `reference.py` is the same in
plain PyTorch, `triton_programs.py` holds the device code and its math. Here:
checks, grids, workspace planning and the precision of the products.

Forward, `lse_pass`: one persistent launch of RS x CS programs (~ #SMs, or
2 x #SMs when two fit on an SM) and one merge launch. Memory: (RS * n + CS * m)
float32 partials + the two outputs; with RS, CS near sqrt(#SMs) (about
11 x 12 on an H100) that is ~ 23 * b floats, i.e. 92 MB at b = 1M,
independent of d; nothing of size m x n.

Backward, `grad_pass` (one recompute + the two gradient products): the
gradient products contract over the *other* dimension of the tile (dI over
columns, dT over rows) and produce [*, d] outputs: a [BLOCK, d] float32
accumulator does not fit in registers for d = 512..1024, and splitting d
would repeat the score recompute (a product over d) once per d-chunk.
Instead the plane is walked in super-tiles of H x W (default at most
8192 x 16384): one Triton launch recomputes the score tiles of the
super-tile and writes the weight matrix G (bf16 for bf16 inputs, fp16 with a
scale for fp16, float32 for float32 inputs) into a fixed workspace; then two
large GEMMs accumulate  dI[H] += s G @ T[W]  and  dT[W] += s G^T @ I[H]  in
float32 (cuBLAS with float32 output on CUDA; plain torch on CPU). Products:
exactly 3 b^2 d multiply-adds (recompute, dI, dT): the floor. Memory: the
workspace, min(m, H) * min(n, W) elements (at most 256 MiB in bf16, 512 MiB
in float32), plus one [H, d] float32 temporary: a constant, independent of b.
The extra traffic (G written once, read twice: 6 bytes per logit in bf16) is
far below what the products take at d >= 64.

Precision: bf16/fp16 products accumulate in float32, all softmax math is
float32. Float32 inputs follow PyTorch's own float32 matmul setting: IEEE
float32 dots (Triton) and GEMMs (cuBLAS) by default, TF32 in both only where
the user allowed TF32 for PyTorch's matmuls (`torch.backends.cuda.matmul.
allow_tf32 = True`, `torch.set_float32_matmul_precision("high")`, ...).
`exact=True` forces IEEE float32 either way.

Under TRITON_INTERPRET=1 the same programs run on CPU tensors (one small tile
config; the GEMMs run in float32 torch). The mode is read at each call, and each
mode's programs come with the host state that belongs to them (`current_programs()`):
the size classes already tuned and the launch counts, which tell tests and
benchmarks that the Triton path really ran.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
from types import ModuleType

import torch
import triton

from clipscale.losses.infcl.precision import tf32_allowed, torch_allows_tf32
from clipscale.triton_modes import interpreting
from clipscale.triton_modes import programs as decorated_programs

__all__ = ["lse_pass", "grad_pass", "positive_logits", "current_programs", "dot_precision"]

# Backward workspace: super-tile of at most MAX_H rows and WORKSPACE_ELEMS
# elements in all (module-level so tests can shrink them).
MAX_H = 8192
WORKSPACE_ELEMS = 1 << 27

# The forward's autotuner times every tile config on the call it is first given, about eight
# launches each: seconds at 131k rows, minutes at 1M, on every process start. The first call
# of a size class with more rows than this tunes on its leading TUNE_ROWS rows instead, the
# smallest problem of the largest class (`triton_programs.bucket`). None: tune on the call.
TUNE_ROWS = 131_072 + 1_024


@dataclasses.dataclass
class Programs:
    """The Triton programs of one mode (compiled, or run in Triton's interpreter) and the host
    state that belongs to them. One per mode for the process (`current_programs()`), as
    long-lived as the compiled programs and the autotuner's choices that `device` holds."""

    device: ModuleType  # triton_programs, decorated for this mode
    # (d, size class, dtype, device, dot precision) whose first call tuned on its leading rows
    tuned_on_leading_rows: set = dataclasses.field(default_factory=set)
    # launches per program name in this mode (tests, benchmarks: the Triton path ran)
    launches: collections.Counter = dataclasses.field(default_factory=collections.Counter)


def current_programs() -> Programs:
    """The programs for the mode Triton is in now (TRITON_INTERPRET, read at each call)."""
    return _programs_of_mode(interpreting())


@functools.cache
def _programs_of_mode(interpret: bool) -> Programs:
    """One `Programs` per mode, cached for the process (see `Programs`)."""
    return Programs(decorated_programs("clipscale.losses.infcl.triton_programs", interpret))


def _check(image: torch.Tensor, text: torch.Tensor, interpret: bool):
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
    if image.device.type != "cuda" and not interpret:
        raise RuntimeError("Triton kernels need CUDA tensors (or TRITON_INTERPRET=1 for CPU)")
    if image.stride(1) != 1:
        image = image.contiguous()
    if text.stride(1) != 1:
        text = text.contiguous()
    return image, text


def dot_precision(dtype: torch.dtype, exact: bool, interpret: bool | None = None) -> str:
    """`tl.dot`'s input_precision. Float32 inputs: TF32 only where PyTorch allows it for
    its own matmuls and `exact` is off, IEEE float32 otherwise (and always in the
    interpreter, which has no TF32). bf16/fp16 inputs: "tf32", as the kernels were always
    compiled for them (Triton's precision choice is about float32 operands).
    `interpret`: the programs' mode (None: the mode Triton is in now)."""
    interpret = interpreting() if interpret is None else interpret
    if dtype != torch.float32:
        return "ieee" if interpret else "tf32"
    return "tf32" if torch_allows_tf32() and not exact and not interpret else "ieee"


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    """The device's SM count; cached for the process (a property of the hardware)."""
    return torch.cuda.get_device_properties(index).multi_processor_count


def _n_programs(device: torch.device) -> int:
    if device.type != "cuda":
        return 6
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=4096)
def _split(m: int, n: int, programs: int, tile: int = 128) -> tuple[int, int]:
    """(RS, CS) with RS * CS <= programs minimising the busiest program's
    nominal tile count, ties broken by the partials' size (RS * n + CS * m).
    A function of its arguments; cached for the process (host time at small b)."""
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
    mode = current_programs()
    P = mode.device
    image, text = _check(image, text, P.INTERPRET)
    m, d = image.shape
    n = text.shape[0]
    dev = image.device
    if m == 0 or n == 0:
        row = torch.full((m,), float("-inf"), dtype=torch.float32, device=dev)
        col = torch.full((n,), float("-inf"), dtype=torch.float32, device=dev) if need_col else None
        return row, col
    sc = _scale_tensor(scale, dev)
    size_class = P.bucket(max(m, n))
    if P.TUNE and TUNE_ROWS is not None and max(m, n) > TUNE_ROWS and P.bucket(TUNE_ROWS) == size_class:
        key = (d, size_class, image.dtype, dev, dot_precision(image.dtype, exact, P.INTERPRET))
        if key not in mode.tuned_on_leading_rows:
            mode.tuned_on_leading_rows.add(key)
            lse_pass(image[:TUNE_ROWS], text[:TUNE_ROWS], sc, row_offset=row_offset, col_offset=col_offset,
                     mask_diagonal=mask_diagonal, need_col=need_col, exact=exact)
    if _grid is not None:
        (rs1, cs1), (rs2, cs2) = _grid, _grid
    else:
        programs = _n_programs(dev)
        (rs1, cs1), (rs2, cs2) = _split(m, n, programs), _split(m, n, 2 * programs)
    part_row = torch.empty((max(cs1, cs2), m), dtype=torch.float32, device=dev)
    part_col = torch.empty((max(rs1, rs2), n) if need_col else (1,), dtype=torch.float32, device=dev)

    def grid(meta):
        return (rs2 * cs2 if meta["OCC"] == 2 else rs1 * cs1,)

    P.lse_fwd_kernel[grid](
        image, text, part_row, part_col, sc, m, n, d, image.stride(0), text.stride(0),
        int(row_offset), int(col_offset), rs1, cs1, rs2, cs2, size_class,
        MASK_DIAG=bool(mask_diagonal), NEED_COL=bool(need_col), PREC=dot_precision(image.dtype, exact, P.INTERPRET))
    mode.launches["lse_fwd"] += 1
    rs, cs = (rs2, cs2) if P.lse_fwd_kernel.best_config.kwargs["OCC"] == 2 else (rs1, cs1)
    row_lse = torch.empty((m,), dtype=torch.float32, device=dev)
    col_lse = torch.empty((n if need_col else 0,), dtype=torch.float32, device=dev)
    BLOCK = 256 if P.INTERPRET else 1024
    grid = (triton.cdiv(m, BLOCK) + (triton.cdiv(n, BLOCK) if need_col else 0),)
    P.merge_kernel[grid](part_row, row_lse, cs, m, part_col, col_lse, rs, n if need_col else 0, BLOCK=BLOCK)
    mode.launches["merge"] += 1
    return row_lse, (col_lse if need_col else None)


def positive_logits(image, text, partner):
    """<image_i, text_partner[i]> for every row, float32 [m] (float32 accumulation;
    multiply by the scale for the logits). One small kernel, no float32 copies."""
    mode = current_programs()
    P = mode.device
    image, text = _check(image, text, P.INTERPRET)
    m, d = image.shape
    out = torch.empty((m,), dtype=torch.float32, device=image.device)
    if m == 0:
        return out
    partner = partner.to(device=image.device).contiguous()
    BR, BD = (16, 32) if P.INTERPRET else (16, 128)
    P.rowdot_kernel[(triton.cdiv(m, BR),)](image, text, partner, out, m, d, image.stride(0), text.stride(0),
                                          BR=BR, BD=BD)
    mode.launches["rowdot"] += 1
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
def cublas_settings(force_ieee: bool):
    """bf16/fp16 products reduced in float32 (no reduced-precision split-K) and, with
    `force_ieee`, float32 GEMMs without TF32 whatever the user allowed; restored afterwards."""
    matmul = torch.backends.cuda.matmul
    saved = {key: getattr(matmul, key) for key in
             ("allow_bf16_reduced_precision_reduction", "allow_fp16_reduced_precision_reduction")}
    for key in saved:
        setattr(matmul, key, False)
    try:
        with tf32_allowed(False) if force_ieee else contextlib.nullcontext():
            yield
    finally:
        for key, value in saved.items():
            setattr(matmul, key, value)


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
        if factor is None and _addmm_adds_into_float32(out.device, a.dtype):
            torch.addmm(out, a, b, out_dtype=torch.float32, out=out)  # cuBLAS: C(fp32) += A @ B, in place
            return
        prod = torch.mm(a, b, out_dtype=torch.float32)
    if factor is None:
        out.add_(prod)
    else:
        out.addcmul_(prod, factor)


@functools.cache
def _addmm_adds_into_float32(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether this torch adds a `dtype` product into a float32 `out` in place (`addmm` with
    `out_dtype`); tried once on 1 x 1 tensors and cached per device and dtype for the process
    (a property of the torch build)."""
    out = torch.zeros((1, 1), dtype=torch.float32, device=device)
    one = torch.ones((1, 1), dtype=dtype, device=device)
    try:
        torch.addmm(out, one, one, out_dtype=torch.float32, out=out)
    except (RuntimeError, TypeError):
        return False
    return True


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
    mode = current_programs()
    P = mode.device
    image, text = _check(image, text, P.INTERPRET)
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
        sg_part = torch.empty((triton.cdiv(h_max, P.MIN_TILE[0]) * triton.cdiv(w_max, P.MIN_TILE[1]),),
                              dtype=torch.float32, device=dev)
    prec = dot_precision(image.dtype, exact, P.INTERPRET)
    cublas = cublas_settings(force_ieee=prec == "ieee") if dev.type == "cuda" else contextlib.nullcontext()
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

                P.weights_kernel[grid](
                    img, txt,
                    rl[r0:r0 + h] if has_row else dummy, cl[c0:c0 + w] if has_col else dummy,
                    rw[r0:r0 + h] if has_row else dummy, cw[c0:c0 + w] if has_col else dummy,
                    partner[r0:r0 + h] if has_pos else dummy, pw[r0:r0 + h] if has_pos else dummy,
                    g, sc, gmax if half else dummy, sg_part if sg_part is not None else dummy,
                    h, w, d, img.stride(0), txt.stride(0), g.stride(0),
                    int(row_offset) + r0, int(col_offset) + c0, c0, P.bucket(h * w // 8192),
                    MASK_DIAG=bool(mask_diagonal), HAS_ROW=has_row, HAS_COL=has_col, HAS_POS=has_pos,
                    NEED_SG=sg_part is not None, HALF=half, PREC=prec)
                mode.launches["weights"] += 1
                if sg_part is not None:
                    meta = P.weights_kernel.best_config.kwargs
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
