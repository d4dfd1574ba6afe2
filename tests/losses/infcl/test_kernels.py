"""The Inf-CL Triton tile kernels under TRITON_INTERPRET=1, against float64.

The kernels run in Triton's interpreter on CPU tensors: each test sets
TRITON_INTERPRET=1, which the kernels read at each call (no reload, whatever
imported them first); every test checks the launch counts so the Triton path,
not a PyTorch fallback, produced the numbers.

Tolerances (all relative to the float64 result on the same, already-rounded
inputs):
  * float32 exact (IEEE dots): LSE abs error <= 2e-5 * max(1, |lse|),
    gradients ||err|| / ||ref|| <= 2e-5.
  * bf16 / fp16 inputs: scores accumulate in float32 (LSE <= 2e-5 as above);
    the backward weight matrix G is stored in bf16 (fp16) for the GEMMs, so
    gradients ||err|| / ||ref|| <= 4e-3 (bf16) and 1e-3 (fp16).
"""

from __future__ import annotations

import pytest
import torch

from clipscale.losses.infcl import kernels as K
from clipscale.losses.infcl import reference
from clipscale.losses.infcl.precision import tf32_allowed, torch_allows_tf32


# ---------------------------------------------------------------- float64 math
def _logits64(image, text, scale, ro, co, mask):
    x = float(scale) * image.double() @ text.double().T
    if mask:
        r = torch.arange(x.shape[0])[:, None] + ro
        c = torch.arange(x.shape[1])[None, :] + co
        x = x.masked_fill(r == c, float("-inf"))
    return x


def ref_lse(image, text, scale, ro=0, co=0, mask=False):
    x = _logits64(image, text, scale, ro, co, mask)
    return x.logsumexp(1), x.logsumexp(0)


def ref_grad(image, text, scale, rl, cl, rw, cw, ro=0, co=0, mask=False):
    x = _logits64(image, text, scale, ro, co, mask)
    g = torch.zeros_like(x)
    if rw is not None:
        g = g + rw.double()[:, None] * torch.exp(x - rl.double()[:, None])
    if cw is not None:
        g = g + cw.double()[None, :] * torch.exp(x - cl.double()[None, :])
    g = torch.nan_to_num(g, nan=0.0)  # fully masked rows: exp(-inf - -inf)
    if mask:
        g = g.masked_fill(torch.isinf(x), 0.0)
    return float(scale) * g @ text.double(), float(scale) * g.T @ image.double()


def feats(n, d, dtype=torch.float32, seed=0, normalize=True):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g, dtype=torch.float64)
    if normalize:
        x = x / x.norm(dim=1, keepdim=True)
    return x.to(dtype)


def assert_lse(got, ref, tol=2e-5):
    assert got.dtype == torch.float32 and got.shape == ref.shape
    inf = torch.isinf(ref)
    assert torch.equal(torch.isinf(got), inf), "masked rows/cols must be -inf exactly"
    assert not torch.isnan(got).any()
    err = (got.double() - ref)[~inf].abs()
    bound = tol * ref[~inf].abs().clamp(min=1.0)
    assert (err <= bound).all(), f"max lse err {err.max().item():.3g}"


def rel(a, b):
    return ((a.double() - b).norm() / b.norm().clamp(min=1e-300)).item()


def launches():
    """Kernel launches per program name of the programs in use (the interpreter's)."""
    return K.current_programs().launches


@pytest.fixture(autouse=True)
def _count(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert K.current_programs().device.INTERPRET
    launches().clear()
    yield


# ----------------------------------------------------------------------- tests
@pytest.mark.parametrize(
    "m,n,d,scale",
    [
        (1, 1, 8, 10.0),
        (37, 53, 24, 20.0),  # odd sizes, d not a multiple of the K-block
        (100, 64, 64, 100.0),  # rectangular, CLIP's largest logit scale
        (64, 100, 64, 14.3),
        (5, 7, 1000, 50.0),  # large d, tiny b
    ],
)
def test_lse_fp32_exact(m, n, d, scale):
    image, text = feats(m, d, seed=1), feats(n, d, seed=2)
    row, col = K.lse_pass(image, text, scale, exact=True)
    r64, c64 = ref_lse(image, text, scale)
    assert_lse(row, r64)
    assert_lse(col, c64)
    assert launches()["lse_fwd"] == 1 and launches()["merge"] == 1


def test_the_interpreter_is_chosen_at_each_call_not_at_import(monkeypatch):
    """TRITON_INTERPRET is read at each call: the same imported module runs its programs in the
    interpreter, refuses CPU tensors once the variable is gone (the compiled programs need CUDA),
    and runs them again when it is back, with the launches of each mode counted apart."""
    image, text = feats(9, 16, seed=1), feats(7, 16, seed=2)
    interpreted = K.current_programs()
    K.lse_pass(image, text, 10.0)
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(RuntimeError, match="need CUDA tensors"):
        K.lse_pass(image, text, 10.0)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    row, col = K.lse_pass(image, text, 10.0)
    assert_lse(row, ref_lse(image, text, 10.0)[0])
    assert K.current_programs() is interpreted and interpreted.launches["lse_fwd"] == 2


def test_the_first_call_of_the_largest_size_class_tunes_on_its_leading_rows(monkeypatch):
    """The autotuner times every tile config on the call it is first given (minutes at 1M rows).
    A call larger than TUNE_ROWS in the largest size class first runs the forward on its leading
    TUNE_ROWS rows, once per class; its own result is unchanged. Scaled down: classes split at 32."""
    monkeypatch.setattr(K, "TUNE_ROWS", 40)
    monkeypatch.setattr(K.current_programs().device, "bucket", lambda rows: 0 if rows <= 32 else 1)
    monkeypatch.setattr(K.current_programs(), "tuned_on_leading_rows", set())
    shapes, lse_pass = [], K.lse_pass

    def recorded(image, text, *args, **kwargs):
        shapes.append((len(image), len(text)))
        return lse_pass(image, text, *args, **kwargs)

    monkeypatch.setattr(K, "lse_pass", recorded)
    image, text = feats(70, 24, seed=1), feats(50, 24, seed=2)
    for _ in range(2):
        row, col = K.lse_pass(image, text, 20.0, exact=True)
        r64, c64 = ref_lse(image, text, 20.0)
        assert_lse(row, r64)
        assert_lse(col, c64)
    K.lse_pass(feats(30, 24), feats(20, 24), 20.0, exact=True)  # the small class tunes on itself
    assert shapes == [(70, 50), (40, 40), (70, 50), (30, 20)]
    assert launches()["lse_fwd"] == 4


def test_the_tuning_of_both_tuned_programs_is_kept_for_the_next_process():
    """The compiled programs' autotuners keep their timings in Triton's cache (Triton 3.4 on), so a
    resumed job's first step does not compile and time every tile config again. Their own
    process: in the interpreter (this module's other tests) there is one config and nothing kept."""
    import inspect
    import os
    import subprocess
    import sys

    import triton

    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    shown = subprocess.run([sys.executable, "-c", "import clipscale.losses.infcl.triton_programs as P; "
                            "print(P.lse_fwd_kernel.cache_results, P.weights_kernel.cache_results)"],
                           env=env, capture_output=True, text=True, timeout=120)
    assert shown.returncode == 0, shown.stderr[-2000:]
    kept = "cache_results" in inspect.signature(triton.autotune).parameters
    assert shown.stdout.split() == [str(kept)] * 2


@pytest.mark.parametrize("grid", [(1, 1), (3, 2), (2, 7), (9, 9)])  # (9, 9): programs with no blocks
def test_lse_partial_merge(grid):
    image, text = feats(70, 32, seed=3), feats(45, 32, seed=4)
    row, col = K.lse_pass(image, text, 30.0, exact=True, _grid=grid)
    r64, c64 = ref_lse(image, text, 30.0)
    assert_lse(row, r64)
    assert_lse(col, c64)


@pytest.mark.parametrize(
    "m,n,ro,co",
    [
        (40, 40, 0, 0),  # self-similarity: the whole diagonal masked
        (30, 50, 17, 5),  # off-centre block: the global diagonal crosses it
        (1, 1, 3, 3),  # the single entry masked: -inf both ways
        (20, 20, 0, 40),  # diagonal outside the block: nothing masked
    ],
)
def test_lse_mask_offsets(m, n, ro, co):
    image, text = feats(m, 16, seed=5), feats(n, 16, seed=6)
    row, col = K.lse_pass(image, text, 12.0, row_offset=ro, col_offset=co, mask_diagonal=True, exact=True)
    r64, c64 = ref_lse(image, text, 12.0, ro, co, True)
    assert_lse(row, r64)
    assert_lse(col, c64)


def test_lse_need_col_false_and_tensor_scale():
    image, text = feats(33, 16, seed=7), feats(21, 16, seed=8)
    row, col = K.lse_pass(image, text, torch.tensor(7.0), need_col=False, exact=True)
    assert col is None
    assert_lse(row, ref_lse(image, text, 7.0)[0])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_lse_half_inputs(dtype):
    image, text = feats(90, 64, dtype, seed=9), feats(75, 64, dtype, seed=10)
    row, col = K.lse_pass(image, text, 100.0)
    r64, c64 = ref_lse(image, text, 100.0)  # on the rounded inputs: fp32 accumulation only
    assert_lse(row, r64)
    assert_lse(col, c64)


def test_empty():
    image, text = feats(0, 8), feats(5, 8)
    row, col = K.lse_pass(image, text, 1.0)
    assert row.shape == (0,) and torch.isinf(col).all()
    gi, gt = K.grad_pass(image, text, 1.0, row, col, torch.ones(0), torch.ones(5))
    assert gi.shape == (0, 8) and torch.equal(gt, torch.zeros(5, 8))


def _weights(m, n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.rand(m, generator=g) + 0.5, torch.rand(n, generator=g) + 0.5


@pytest.mark.parametrize(
    "m,n,d,mask,ro,co",
    [
        (37, 53, 24, False, 0, 0),
        (100, 64, 64, False, 0, 0),
        (48, 48, 32, True, 0, 0),
        (30, 50, 20, True, 17, 5),
        (5, 7, 1000, False, 0, 0),
    ],
)
def test_grad_fp32_exact(m, n, d, mask, ro, co):
    image, text = feats(m, d, seed=11), feats(n, d, seed=12)
    s = 25.0
    rl, cl = ref_lse(image, text, s, ro, co, mask)
    rw, cw = _weights(m, n, 13)
    gi, gt = K.grad_pass(image, text, s, rl.float(), cl.float(), rw, cw,
                         row_offset=ro, col_offset=co, mask_diagonal=mask, exact=True)
    ri, rt = ref_grad(image, text, s, rl.float(), cl.float(), rw, cw, ro, co, mask)
    assert gi.dtype == gt.dtype == torch.float32
    assert rel(gi, ri) <= 2e-5 and rel(gt, rt) <= 2e-5, (rel(gi, ri), rel(gt, rt))
    assert launches()["weights"] >= 1


def test_grad_fully_masked_row():
    image = feats(1, 8, seed=14)
    row, col = K.lse_pass(image, image, 5.0, mask_diagonal=True, exact=True)
    gi, gt = K.grad_pass(image, image, 5.0, row, col, torch.ones(1), torch.ones(1), mask_diagonal=True, exact=True)
    assert torch.equal(gi, torch.zeros(1, 8)) and torch.equal(gt, torch.zeros(1, 8))


def test_grad_row_only_accumulates_and_super_tiles(monkeypatch):
    # Several super-tiles (workspace 24 x 40) and accumulation into given tensors.
    monkeypatch.setattr(K, "MAX_H", 24)
    monkeypatch.setattr(K, "WORKSPACE_ELEMS", 24 * 40)
    m, n, d, s = 61, 97, 40, 9.0
    image, text = feats(m, d, seed=15), feats(n, d, seed=16)
    rl, _ = ref_lse(image, text, s)
    rw = torch.full((m,), 1.0 / m)
    gi0, gt0 = torch.randn(m, d), torch.randn(n, d)
    gi, gt = K.grad_pass(image, text, s, rl.float(), None, rw, None,
                         grad_image=gi0.clone(), grad_text=gt0.clone(), exact=True)
    ri, rt = ref_grad(image, text, s, rl.float(), None, rw, None)
    assert rel(gi - gi0, ri) <= 2e-5 and rel(gt - gt0, rt) <= 2e-5
    assert launches()["weights"] == 3 * 3


def test_end_to_end_symmetric_loss_gradient():
    """Contract -> CLIP loss: both LSEs from one pass, gradients from one grad_pass
    plus the O(bd) positive terms, equal to float64 autograd."""
    b, d, s = 50, 32, 30.0
    image, text = feats(b, d, seed=17), feats(b, d, seed=18)
    row, col = K.lse_pass(image, text, s, exact=True)
    w = torch.full((b,), 0.5 / b)
    gi, gt = K.grad_pass(image, text, s, row, col, w, w, exact=True)
    gi -= s / b * text  # d/dI of -(1/2b) sum 2 x_ii
    gt -= s / b * image
    loss = 0.5 * (row.mean() + col.mean()) - s * (image * text).sum(1).mean()
    I64, T64 = image.double().requires_grad_(), text.double().requires_grad_()
    x = s * I64 @ T64.T
    ref = 0.5 * (torch.nn.functional.cross_entropy(x, torch.arange(b)) +
                 torch.nn.functional.cross_entropy(x.T, torch.arange(b)))
    ref.backward()
    assert abs(loss.item() - ref.item()) <= 2e-5 * abs(ref.item())
    assert rel(gi, I64.grad) <= 2e-5 and rel(gt, T64.grad) <= 2e-5


@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 4e-3), (torch.float16, 1e-3)])
def test_grad_half_inputs(dtype, tol):
    m, n, d, s = 70, 45, 64, 50.0
    image, text = feats(m, d, dtype, seed=19), feats(n, d, dtype, seed=20)
    row, col = K.lse_pass(image, text, s)
    r64, c64 = ref_lse(image, text, s)
    assert_lse(row, r64)
    rw, cw = _weights(m, n, 21)
    gi, gt = K.grad_pass(image, text, s, row, col, rw / m, cw / n)
    ri, rt = ref_grad(image, text, s, r64, c64, rw / m, cw / n)
    assert rel(gi, ri) <= tol and rel(gt, rt) <= tol, (rel(gi, ri), rel(gt, rt))


def test_bad_inputs():
    with pytest.raises(ValueError):
        K.lse_pass(feats(3, 4), feats(3, 5), 1.0)
    with pytest.raises(ValueError):
        K.lse_pass(feats(3, 4), feats(3, 4, torch.bfloat16), 1.0)


@pytest.mark.parametrize("mask", [False, True])
def test_far_apart_logits(mask):
    """Logits spread over hundreds of units (unnormalised features of very different
    norms): the kernels' one-exp fast paths must fall back to the direct path.
    Logits reach ~10^3 here, so float32 evaluation itself costs |x| * 2^-24 ~ 1e-4
    relative in exp(x - lse): the gradient tolerance is 2e-4 for this case."""
    m, n, d, s = 45, 38, 16, 40.0
    g = torch.Generator().manual_seed(22)
    image = feats(m, d, seed=23) * (torch.rand(m, 1, generator=g) * 12 + 0.1)
    text = feats(n, d, seed=24) * (torch.rand(n, 1, generator=g) * 12 + 0.1)
    if mask:
        text = image[:n].clone()
    row, col = K.lse_pass(image, text, s, mask_diagonal=mask, exact=True)
    r64, c64 = ref_lse(image, text, s, mask=mask)
    assert (r64.max() - r64.min()) > 300  # really far apart
    assert_lse(row, r64)
    assert_lse(col, c64)
    rw, cw = _weights(m, n, 25)
    gi, gt = K.grad_pass(image, text, s, r64.float(), c64.float(), rw, cw, mask_diagonal=mask, exact=True)
    ri, rt = ref_grad(image, text, s, r64.float(), c64.float(), rw, cw, mask=mask)
    assert rel(gi, ri) <= 2e-4 and rel(gt, rt) <= 2e-4, (rel(gi, ri), rel(gt, rt))


# ------------------------------------------------- scale as a tensor, positive, dL/ds
def test_scale_tensor_is_read_on_the_device():
    """A tensor scale goes to the kernels as a pointer (no .item()): same results as the
    Python number, for both primitives, with any shape of one element and dtype."""
    m, n, d, s = 37, 29, 24, 17.0
    image, text = feats(m, d, seed=30), feats(n, d, seed=31)
    rw, cw = _weights(m, n, 32)
    row_f, col_f = K.lse_pass(image, text, s, exact=True)
    gi_f, gt_f = K.grad_pass(image, text, s, row_f, col_f, rw, cw, exact=True)
    for scale in (torch.tensor(s), torch.tensor([s], dtype=torch.float64), torch.tensor([[s]])):
        row, col = K.lse_pass(image, text, scale, exact=True)
        assert torch.equal(row, row_f) and torch.equal(col, col_f)
        gi, gt = K.grad_pass(image, text, scale, row, col, rw, cw, exact=True)
        assert rel(gi, gi_f.double()) <= 1e-6 and rel(gt, gt_f.double()) <= 1e-6


def _ref_positive_and_scale_grad(image, text, s, rl, cl, rw, cw, partner, pw, ro=0, co=0, mask=False):
    """float64: G with the positive folded in, the gradients and sum G_ij <I_i, T_j>."""
    x = _logits64(image, text, s, ro, co, mask)
    g = rw.double()[:, None] * torch.exp(x - rl.double()[:, None]) + cw.double()[None, :] * torch.exp(x - cl.double()[None, :])
    if mask:
        g = g.masked_fill(torch.isinf(x), 0.0)
    g[torch.arange(len(image)), partner] -= pw.double()
    dots = image.double() @ text.double().T
    return s * g @ text.double(), s * g.T @ image.double(), (g * dots).sum()


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-5), (torch.bfloat16, 4e-3), (torch.float16, 1e-3)])
@pytest.mark.parametrize("mask", [False, True])
def test_grad_positive_and_scale_grad(dtype, tol, mask, monkeypatch):
    """positive=(partner, pw) folds -pw_i at (i, partner_i) into G before rounding, and
    scale_grad sums G_ij <I_i, T_j> in float32 from the unrounded G: accurate to
    float32 rounding for every input dtype. Several super-tiles (the partner column of
    a row may sit in another one), odd sizes, a rectangular block."""
    monkeypatch.setattr(K, "MAX_H", 24)
    monkeypatch.setattr(K, "WORKSPACE_ELEMS", 24 * 40)
    m, n, d, s = 50, 61, 32, 20.0
    image, text = feats(m, d, dtype, seed=33), feats(n, d, dtype, seed=34)
    if mask:  # NT-Xent-like: the same rows on both sides, partner = the other half
        n, text = m, image
    rl, cl = ref_lse(image, text, s, mask=mask)
    rw, cw = _weights(m, n, 35)
    rw, cw = rw / m, cw / n
    partner = (torch.arange(m) + m // 2) % n if mask else torch.randperm(n, generator=torch.Generator().manual_seed(36))[:m]
    pw = rw + cw[partner]
    sg = torch.zeros(1)
    gi, gt = K.grad_pass(image, text, torch.tensor(s), rl.float(), cl.float(), rw, cw, mask_diagonal=mask,
                         positive=(partner, pw), scale_grad=sg, exact=True)
    ri, rt, rsg = _ref_positive_and_scale_grad(image, text, s, rl, cl, rw, cw, partner, pw, mask=mask)
    assert rel(gi, ri) <= tol and rel(gt, rt) <= tol, (rel(gi, ri), rel(gt, rt))
    assert abs(sg.item() - rsg.item()) <= 1e-5 * abs(rsg.item()), (sg.item(), rsg.item())
    # the reference primitives meet the same contract
    sg_ref = torch.zeros(1)
    gi2, gt2 = reference.grad_pass(image, text, torch.tensor(s), rl.float(), cl.float(), rw, cw, mask_diagonal=mask,
                                   positive=(partner, pw), scale_grad=sg_ref, tile_size=16)
    assert rel(gi2, ri) <= tol and rel(gt2, rt) <= tol
    assert abs(sg_ref.item() - rsg.item()) <= 1e-5 * abs(rsg.item())


def test_grad_out_dtype_and_positive_logits():
    m, n, d, s = 33, 40, 48, 12.0
    image, text = feats(m, d, torch.bfloat16, seed=37), feats(n, d, torch.bfloat16, seed=38)
    rl, cl = ref_lse(image, text, s)
    rw, cw = _weights(m, n, 39)
    gi32, gt32 = K.grad_pass(image, text, s, rl.float(), cl.float(), rw, cw)
    gi, gt = K.grad_pass(image, text, s, rl.float(), cl.float(), rw, cw, out_dtype=torch.bfloat16)
    assert gi.dtype == gt.dtype == torch.bfloat16
    assert torch.equal(gi, gi32.to(torch.bfloat16)) and torch.equal(gt, gt32.to(torch.bfloat16))
    partner = torch.arange(m).flip(0)
    pos = K.positive_logits(image, text, partner)
    expected = (image.double() * text.double()[partner]).sum(1)
    assert pos.dtype == torch.float32 and (pos.double() - expected).abs().max() <= 1e-6
    assert launches()["rowdot"] == 1


def test_the_cublas_settings_hold_inside_the_backward_only():
    """The backward's GEMMs reduce bf16/fp16 products in float32 and, for IEEE float32 dots, run
    without TF32: PyTorch's process-wide flags set for the GEMMs and the user's restored after,
    an exception included."""
    matmul = torch.backends.cuda.matmul
    flags = ("allow_bf16_reduced_precision_reduction", "allow_fp16_reduced_precision_reduction")
    users = {flag: getattr(matmul, flag) for flag in flags}
    with tf32_allowed(True):
        with pytest.raises(ZeroDivisionError):
            with K.cublas_settings(force_ieee=True):
                assert not any(getattr(matmul, flag) for flag in flags) and not torch_allows_tf32()
                1 / 0
        assert torch_allows_tf32() and {flag: getattr(matmul, flag) for flag in flags} == users
        with K.cublas_settings(force_ieee=False):
            assert torch_allows_tf32()
