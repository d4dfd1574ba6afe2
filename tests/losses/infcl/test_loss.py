"""Inf-CL beyond equality with the reference: memory, the tile primitives, the backend switch.

- The reference never allocates anything of size b x b: at b = 8192 the largest
  tensor any op produces (measured with a TorchDispatchMode) is one float32 tile.
- The primitives meet the contract at its edges (fully masked rows, offsets).
- `backend="auto"` picks the reference on CPU, the Triton kernels under
  TRITON_INTERPRET=1, and falls back when the kernels cannot be imported.
- The Triton kernels (run by Triton's interpreter) give the same losses and
  gradients inside the 2-rank ring.
- Float32 means float32: the kernels use TF32 only where PyTorch's own setting
  allows it; `scripts/bench_loss.py --fp32-precision-check` measures it (on a
  GPU at b = 4,099, d = 768 against float64; here its --smoke run on CPU).
- Under autocast float32 features are taken in autocast's dtype, as a matmul's
  inputs are (the trainer's features come out of CUDA autocast float32), unless
  `exact` asks for float32.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from clipscale.losses import build_loss
from clipscale.losses.infcl import infcl_loss, ntxent_loss, reference
from clipscale.losses.infcl.precision import tf32_allowed, torch_allows_tf32
from clipscale.losses.infcl.loss import select_backend
from tests.helpers.gloo_world import run_in_gloo_world
from tests.helpers.loss_cases import Case, assert_matches_reference, relative_error, worker
from tests.helpers.reference_math import block_logits_float64, clip_loss_float64
from tests.helpers.tiny_runs import REPO


class LargestTensor(TorchDispatchMode):
    """Records the size in bytes of the largest tensor any op produces."""

    def __init__(self):
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.bytes = max(self.bytes, t.numel() * t.element_size())
        return out


def _forward_backward(loss_name: str, b: int, d: int, **options) -> int:
    generator = torch.Generator().manual_seed(0)
    image = F.normalize(torch.randn(b, d, generator=generator), dim=1).requires_grad_()
    text = F.normalize(torch.randn(b, d, generator=generator), dim=1).requires_grad_()
    scale = torch.tensor(10.0, requires_grad=True)
    with LargestTensor() as probe:
        build_loss(loss_name, **options)(image, text, scale).backward()
    return probe.bytes


@pytest.mark.timeout(120)
def test_reference_never_allocates_a_b_by_b_tensor():
    b, d, tile = 8192, 64, reference.TILE_SIZE  # features [b, d] are 2 MiB, below one tile
    largest = _forward_backward("infcl", b, d, backend="reference")
    assert largest <= tile * tile * 4, f"largest tensor {largest / 2**20:.1f} MiB exceeds one float32 tile"
    assert b * b * 4 >= 64 * largest  # the b x b logits would be 256 MiB


def test_the_probe_sees_the_vanilla_matrix():
    b = 1024
    assert _forward_backward("vanilla", b, 64) >= b * b * 4


def test_autocast_rounds_the_features_not_the_tiles():
    """Under autocast (as in the trainer) the features are rounded to bf16, as a matmul's inputs
    are, but the tiles' products accumulate and their softmax runs in float32: the loss is the
    float64 reference's on the rounded features, not one with bf16 logits."""
    generator = torch.Generator().manual_seed(0)
    image = F.normalize(torch.randn(64, 32, generator=generator), dim=1).requires_grad_()
    text = F.normalize(image.detach() + 3 * torch.randn(64, 32, generator=generator), dim=1).requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = infcl_loss(image, text, 10.0, backend="reference", tile_size=16)
    loss.backward()
    rounded = [image.detach().bfloat16().double(), text.detach().bfloat16().double()]
    expected = clip_loss_float64([rounded[0]], [rounded[1]], 10.0)
    assert relative_error(loss.item(), expected.loss) <= 1e-5
    assert relative_error(image.grad, expected.grads[0][0]) <= 1e-2  # returned in bf16, as the products' inputs


def test_fully_masked_rows_give_minus_inf_and_zero_gradient():
    generator = torch.Generator().manual_seed(0)
    image, text = torch.randn(5, 8, generator=generator), torch.randn(3, 8, generator=generator)
    # Rows 2..4 meet columns 0..2 on the global diagonal (row_offset 0, col_offset 2).
    options = dict(row_offset=0, col_offset=2, mask_diagonal=True, tile_size=2)
    row_lse, col_lse = reference.lse_pass(image, text, 2.0, **options)
    logits = block_logits_float64(image, text, 2.0, 0, 2, True)
    torch.testing.assert_close(row_lse.double(), logits.logsumexp(1), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(col_lse.double(), logits.logsumexp(0), rtol=1e-6, atol=1e-6)
    # A 1 x 1 block on the diagonal: its only entry is masked.
    diagonal = dict(row_offset=4, col_offset=4, mask_diagonal=True)
    one, _ = reference.lse_pass(image[:1], text[:1], 2.0, **diagonal)
    assert one.item() == float("-inf")
    weights = torch.ones(1)
    grad_image, grad_text = reference.grad_pass(image[:1], text[:1], 2.0, one, None, weights, None, **diagonal)
    assert grad_image.abs().sum() == 0 and grad_text.abs().sum() == 0


def test_auto_backend_is_the_reference_on_cpu(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert select_backend("auto", "cpu") is reference
    assert select_backend("reference", "cpu", tile_size=7).lse_pass.keywords == {"tile_size": 7}


def test_auto_backend_falls_back_when_the_kernels_are_missing(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setitem(sys.modules, "clipscale.losses.infcl.kernels", None)  # import raises
    with pytest.warns(UserWarning, match="using the PyTorch reference"):
        assert select_backend("auto", "cpu") is reference
    with pytest.raises(ModuleNotFoundError):
        select_backend("triton", "cpu")


TRITON_CASES = [
    Case("infcl", 7, 9, 64, options={"backend": "triton", "exact": True}),  # rectangular, odd
    Case("infcl", 6, 6, 32, torch.bfloat16, options={"backend": "triton"}),
    Case("ntxent", 10, 10, 32, options={"backend": "triton", "exact": True}),
]


@pytest.mark.timeout(240)
def test_triton_kernels_in_the_ring(monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # inherited by the spawned ranks
    per_rank = run_in_gloo_world(worker, 2, (TRITON_CASES,), timeout=200)
    for i, case in enumerate(TRITON_CASES):
        # dL/ds is summed in float32 from the unrounded weights G inside the
        # recompute (not from the cancelling sum <dI, I> over bf16-rounded G, which
        # was off by a few %), so bf16 inputs meet the float32 tolerance there too.
        scale_grad_tol = 1e-5 if case.dtype == torch.bfloat16 else None
        assert_matches_reference(case, 2, [results[i] for results in per_rank], scale_grad_tol)


class HostReads(TorchDispatchMode):
    """Counts the reads of tensor values by the host: scalar reads (`.item()`, float(),
    bool(), int(): aten._local_scalar_dense) and `.tolist()` (which reads the data
    without dispatching). On CUDA each is a synchronisation with the device."""

    def __init__(self, monkeypatch):
        super().__init__()
        self.reads = []
        tolist = torch.Tensor.tolist

        def counted_tolist(tensor):
            self.reads.append("tolist")
            return tolist(tensor)

        monkeypatch.setattr(torch.Tensor, "tolist", counted_tolist)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.reads.append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_host_read_per_step(backend, dtype, monkeypatch):
    """Forward + backward with fine inputs read device values on the host once (the
    input check's one small tensor): the scale, the weights and dL/ds stay on the device."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    generator = torch.Generator().manual_seed(0)
    image = F.normalize(torch.randn(24, 16, generator=generator), dim=1).to(dtype).requires_grad_()
    text = F.normalize(torch.randn(30, 16, generator=generator), dim=1).to(dtype).requires_grad_()
    scale = torch.tensor(10.0, requires_grad=True)
    infcl_loss(image, text, scale, backend=backend).backward()  # first call: compile / caches
    image.grad = text.grad = scale.grad = None
    probe = HostReads(monkeypatch)
    with probe:
        loss = infcl_loss(image, text, scale, backend=backend)
        loss.backward()
    assert probe.reads == ["tolist"], probe.reads
    assert image.grad is not None and text.grad is not None and scale.grad is not None


# --- float32 that means float32 ------------------------------------------------------

BENCH_LOSS = str(REPO / "scripts" / "bench_loss.py")


def test_tf32_follows_pytorch_and_is_restored():
    matmul = torch.backends.cuda.matmul
    assert not torch_allows_tf32()  # PyTorch's default
    with tf32_allowed(True):
        assert torch_allows_tf32() and matmul.allow_tf32
        with tf32_allowed(False):
            assert not torch_allows_tf32() and not matmul.allow_tf32
        assert matmul.allow_tf32
    assert not torch_allows_tf32() and not matmul.allow_tf32


def fp32_precision_check(tmp_path, *options, env=None) -> dict:
    out = tmp_path / "fp32.json"
    subprocess.run([sys.executable, BENCH_LOSS, "--fp32-precision-check", "--out", str(out), *options],
                   check=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})
    return json.loads(out.read_text())


def test_fp32_precision_check_runs_on_cpu(tmp_path):
    record = fp32_precision_check(tmp_path, "--smoke", env={"TRITON_INTERPRET": "1"})
    off, on = record["results"]
    assert (off["tf32_allowed"], on["tf32_allowed"]) == (False, True)
    assert off["dots"] == on["dots"] == "ieee"  # the interpreter has no TF32
    assert record["kernel_launches"]["lse_fwd"] >= 2 and record["kernel_launches"]["weights"] >= 2
    for key in ("loss_rel", "grad_image_rel", "grad_text_rel", "grad_scale_rel"):
        assert off[key] < 1e-5
    assert on["ms"] > 0 and on["speedup_vs_tf32_off"] > 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: TF32 and the compiled kernels")
def test_float32_without_tf32_matches_float64_on_the_gpu(tmp_path):
    """infcl_loss on float32 features, TF32 not allowed: within 1e-5 of float64 (relative)
    on the loss and on the gradients of both features and the scale, b = 4,099, d = 768."""
    off, on = fp32_precision_check(tmp_path, "--fp32-speed-b", "0")["results"]
    assert off["dots"] == "ieee" and on["dots"] == "tf32"
    for key in ("loss_rel", "grad_image_rel", "grad_text_rel", "grad_scale_rel"):
        assert off[key] < 1e-5, (key, off[key])


def _loss_of(name: str, image: torch.Tensor, text: torch.Tensor, exact: bool = False) -> torch.Tensor:
    if name == "infcl":
        return infcl_loss(image, text, 14.3, exact=exact)
    return ntxent_loss(torch.cat([image, text]), 0.07, exact=exact)


@pytest.mark.parametrize("name", ["infcl", "ntxent"])
def test_float32_features_under_autocast_are_taken_in_its_dtype(name):
    """As autocast hands a matmul bf16 inputs: the loss and the features' gradients (float32, as
    the features) are those of the features rounded to bf16 outside autocast, not the float32
    loss's (on CUDA the trainer's features come out of autocast float32, and Inf-CL ran its IEEE
    float32 dots, 20x slower than bf16, in every training step)."""
    generator = torch.Generator().manual_seed(3)
    image, text = (F.normalize(torch.randn(37, 64, generator=generator), dim=-1).requires_grad_() for _ in range(2))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        under_autocast = _loss_of(name, image, text)
    under_autocast.backward()
    rounded = [t.detach().bfloat16().requires_grad_() for t in (image, text)]
    expected = _loss_of(name, *rounded)
    expected.backward()
    assert torch.equal(under_autocast, expected)
    assert image.grad.dtype == torch.float32
    assert torch.equal(image.grad, rounded[0].grad.float()) and torch.equal(text.grad, rounded[1].grad.float())
    in_float32 = _loss_of(name, image.detach(), text.detach())
    assert not torch.equal(under_autocast, in_float32), "bf16 products gave the float32 loss: the test sees nothing"


@pytest.mark.parametrize("name", ["infcl", "ntxent"])
def test_exact_keeps_float32_under_autocast(name):
    generator = torch.Generator().manual_seed(4)
    image, text = (F.normalize(torch.randn(37, 64, generator=generator), dim=-1) for _ in range(2))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        under_autocast = _loss_of(name, image, text, exact=True)
    assert torch.equal(under_autocast, _loss_of(name, image, text, exact=True))
