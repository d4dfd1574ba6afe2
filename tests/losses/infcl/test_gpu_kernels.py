"""The Inf-CL kernels (`infcl_loss`, `ntxent_loss`) against float64 at the sizes they are built
for: the loss, both feature gradients and the scale's, from b = 1 to 300,000, odd sizes,
d from 64 to 1,024, rectangular batches, NT-Xent, and the ring across two GPUs.

The float64 reference (reference_math.clip_loss_float64_tiled) runs on the GPU in blocks,
so nothing of size b x b exists on either side. It takes the inputs as the kernels see them
(already rounded to bf16 / fp16), so what is measured is the kernels' own arithmetic.

Tolerances, and why (relative; gradients as ||error|| / ||reference||, the loss against the
size of the log-sum-exps and positive logits it is the difference of, dL/ds against the sum of
the magnitudes of the terms it adds up: each of these carries float32 rounding of its own size):
  * fp32 exact (IEEE dots) and fp32 by default (PyTorch's default allows no TF32): float32
    accumulation over b terms in blocked order, about eps32 * log2(b) = 1e-6 at 300k:
    loss 2e-5, gradients 5e-5 (the target docs/kernels.md holds them to; 1.4e-6 measured
    at b = 4,096).
  * fp32 with TF32 allowed: the dots round their inputs to 10 mantissa bits (2^-11 =
    4.9e-4 each): loss 2e-3, gradients 5e-3 (5.3e-4 measured at b = 4,096, s = 100).
  * bf16 / fp16 inputs: the products are exact in float32 and accumulate there, so the
    LSEs and the loss keep float32's 2e-5; the backward stores G in the input dtype for
    its GEMMs and returns gradients in it (unit roundoff 2^-8 bf16, 2^-11 fp16, twice):
    gradients 8e-3 (bf16) and 2e-3 (fp16).

On a CPU the same bodies run at small sizes through Triton's interpreter (the CI check that
the tests themselves are right); the tiled reference is held to the full-matrix one there.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

from clipscale.losses.infcl import infcl_loss, ntxent_loss
from tests.helpers.gloo_world import run_in_gloo_world
from tests.helpers.reference_math import (TiledReference, clip_loss_float64, clip_loss_float64_tiled, ntxent_loss_float64,
                            ntxent_loss_float64_tiled)

pytestmark = pytest.mark.timeout(600)


@dataclass(frozen=True)
class Mode:
    dtype: torch.dtype
    exact: bool = False
    tf32: bool = False  # torch.backends.cuda.matmul.allow_tf32 during the call
    loss_tol: float = 2e-5
    grad_tol: float = 5e-5


MODES = {
    "fp32-exact": Mode(torch.float32, exact=True),
    "fp32": Mode(torch.float32),
    "fp32-tf32": Mode(torch.float32, tf32=True, loss_tol=2e-3, grad_tol=5e-3),
    "bf16": Mode(torch.bfloat16, grad_tol=8e-3),
    "fp16": Mode(torch.float16, grad_tol=2e-3),
}


@dataclass(frozen=True)
class Case:
    images: int
    texts: int
    dim: int
    mode: str
    scale: float = 14.3
    paired: bool = False  # texts close to their images (a trained model: the softmax peaks on the partner)

    @property
    def id(self) -> str:
        shape = f"{self.images}x{self.texts}" if self.texts != self.images else f"b{self.images}"
        return f"{shape}-d{self.dim}-{self.mode}-s{self.scale:g}{'-paired' if self.paired else ''}"


GPU_CASES = [
    *(Case(1, 1, 64, mode) for mode in ("fp32-exact", "bf16")),
    *(Case(3, 3, 1024, mode) for mode in ("fp32", "fp16")),
    *(Case(1000, 1000, 512, mode) for mode in MODES),
    Case(1000, 1000, 512, "bf16", scale=100.0, paired=True),
    *(Case(4099, 4099, 768, mode, scale=100.0) for mode in ("fp32-exact", "fp32-tf32", "bf16")),
    *(Case(65537, 65537, 128, mode) for mode in ("fp32-exact", "bf16", "fp16")),
    Case(65537, 65537, 128, "bf16", scale=100.0, paired=True),
    *(Case(300000, 300000, 64, mode) for mode in ("fp32-exact", "bf16")),
    # Rectangular: the texts past the images are extra negatives.
    *(Case(1000, 1537, 256, mode) for mode in ("fp32-exact", "bf16")),
    *(Case(4099, 8192, 512, mode) for mode in ("fp32-exact", "fp16")),
]
CPU_CASES = [Case(1, 1, 64, "fp32-exact"), Case(37, 37, 64, "fp32-exact"), Case(37, 37, 64, "bf16"), Case(20, 29, 64, "fp16", paired=True)]


def params(gpu: list, cpu: list) -> list:
    return [*(pytest.param(case, "cuda", id=f"cuda-{case.id}", marks=pytest.mark.gpu) for case in gpu),
            *(pytest.param(case, "cpu", id=f"cpu-{case.id}") for case in cpu)]


@pytest.fixture
def kernels(request, monkeypatch):
    """The kernels module for the test's device: compiled on CUDA, interpreted on a CPU. Its
    launch counts say afterwards that the Triton programs, not a fallback, gave the numbers."""
    import clipscale.losses.infcl.kernels as module

    device = request.node.callspec.params["device"]
    if device == "cpu":
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert module.current_programs().device.INTERPRET == (device == "cpu"), "TRITON_INTERPRET is set: the GPU suite compiles"
    module.current_programs().launches.clear()
    return module


def features(count: int, dim: int, dtype: torch.dtype, device: str, seed: int, like: torch.Tensor | None = None):
    """Unit rows in `dtype`; `like`: the leading rows close to its rows (cosine about 0.7)."""
    generator = torch.Generator(device).manual_seed(seed)
    rows = torch.randn(count, dim, generator=generator, device=device)
    if like is not None:
        paired = min(count, len(like))
        rows[:paired] = like[:paired].float() + rows[:paired] / math.sqrt(dim)
    return F.normalize(rows, dim=-1).to(dtype)


@contextlib.contextmanager
def tf32_matmuls(allowed: bool):
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = allowed
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before


def gradient_error(got: torch.Tensor, want: torch.Tensor, terms: float) -> float:
    """||got - want|| relative to ||want||, or to the norm of the terms it sums where the
    gradient itself vanishes (b = 1: exp(x - lse) = 1 against the positive's -1)."""
    return ((got.double() - want).norm() / max(want.norm().item(), terms)).item()


def assert_matches(name: str, mode: Mode, loss: torch.Tensor, grads: list, scale_grad, ref: TiledReference,
                   positive_terms: list[float]) -> None:
    assert torch.isfinite(loss), name
    loss_error = abs(loss.item() - ref.loss) / ref.loss_terms
    assert loss_error <= mode.loss_tol, f"{name}: loss {loss.item()} against {ref.loss} (relative {loss_error:.2e})"
    for which, got, want, terms in zip(("first", "second"), grads, ref.grads, positive_terms):
        assert got.dtype == mode.dtype and got.shape == want.shape
        error = gradient_error(got, want, terms)
        assert error <= mode.grad_tol, f"{name}: {which} input's gradient off by {error:.2e} (tolerance {mode.grad_tol:.0e})"
    if scale_grad is not None:
        error = abs(scale_grad.item() - ref.scale_grad) / ref.scale_grad_terms
        assert error <= mode.grad_tol, f"{name}: dL/ds {scale_grad.item()} against {ref.scale_grad} ({error:.2e})"


@pytest.mark.parametrize("case, device", params(GPU_CASES, CPU_CASES))
def test_infcl_loss_and_its_gradients_match_float64(case, device, kernels):
    mode = MODES[case.mode]
    image = features(case.images, case.dim, mode.dtype, device, seed=1).requires_grad_()
    text = features(case.texts, case.dim, mode.dtype, device, seed=2, like=image.detach() if case.paired else None)
    text.requires_grad_()
    scale = torch.tensor(case.scale, device=device, requires_grad=True)
    with tf32_matmuls(mode.tf32):
        loss = infcl_loss(image, text, scale, backend="triton", exact=mode.exact)
        loss.backward()
    assert kernels.current_programs().launches["lse_fwd"] >= 1
    ref = clip_loss_float64_tiled(image.detach(), text.detach(), case.scale)
    positive_terms = [case.scale / math.sqrt(case.images)] * 2  # || (s/m) T[:m] ||, || (s/m) I ||: unit rows
    assert_matches(case.id, mode, loss, [image.grad, text.grad], scale.grad, ref, positive_terms)


NTXENT_GPU = [Case(2 * 1000, 2 * 1000, 256, mode) for mode in ("fp32-exact", "bf16")] + \
             [Case(2 * 32769, 2 * 32769, 128, mode) for mode in ("fp32-exact", "bf16", "fp16")]
NTXENT_CPU = [Case(2 * 13, 2 * 13, 64, "bf16")]
TEMPERATURE = 0.1


@pytest.mark.parametrize("case, device", params(NTXENT_GPU, NTXENT_CPU))
def test_ntxent_loss_and_its_gradient_match_float64(case, device, kernels):
    mode = MODES[case.mode]
    half = features(case.images // 2, case.dim, torch.float32, device, seed=3)
    views = torch.cat([half, features(case.images // 2, case.dim, torch.float32, device, seed=4, like=half)])
    views = views.to(mode.dtype).requires_grad_()
    loss = ntxent_loss(views, TEMPERATURE, backend="triton", exact=mode.exact)
    loss.backward()
    assert kernels.current_programs().launches["lse_fwd"] >= 1
    ref = ntxent_loss_float64_tiled(views.detach(), TEMPERATURE)
    positive_terms = [2 / TEMPERATURE / math.sqrt(case.images)]
    assert_matches(case.id, mode, loss, [views.grad], None, ref, positive_terms)


# --- the ring: two ranks (GPUs; gloo processes on a CPU), each with its rows: the global loss, DDP-style gradients

RING_GPU = [Case(32769, 32769, 256, "fp32-exact"), Case(32769, 32769, 256, "bf16"), Case(4099, 6000, 512, "bf16")]
RING_CPU = [Case(7, 7, 64, "fp32-exact"), Case(5, 9, 64, "bf16")]


def ring_worker(rank: int, world: int, case: Case, device_type: str) -> dict:
    """This rank's rows of one global batch (every rank draws the whole batch from one seed):
    its errors against the float64 reference of the whole batch."""
    device = f"cuda:{rank}" if device_type == "cuda" else "cpu"
    mode = MODES[case.mode]
    images = features(world * case.images, case.dim, mode.dtype, device, seed=1)
    texts = features(world * case.texts, case.dim, mode.dtype, device, seed=2)
    mine = slice(rank * case.images, (rank + 1) * case.images), slice(rank * case.texts, (rank + 1) * case.texts)
    image, text = images[mine[0]].clone().requires_grad_(), texts[mine[1]].clone().requires_grad_()
    scale = torch.tensor(case.scale, device=device, requires_grad=True)
    loss = infcl_loss(image, text, scale, backend="triton", exact=mode.exact)
    loss.backward()
    from clipscale.losses.infcl.kernels import current_programs  # imported by the call above
    # The reference pairs image i with text i: the ranks' paired texts first, then their extra ones.
    paired = torch.cat([texts[r * case.texts:r * case.texts + case.images] for r in range(world)])
    extra = torch.cat([texts[r * case.texts + case.images:(r + 1) * case.texts] for r in range(world)])
    ref = clip_loss_float64_tiled(images, torch.cat([paired, extra]), case.scale)
    extras = case.texts - case.images
    want_text = torch.cat([ref.grads[1][rank * case.images:(rank + 1) * case.images],
                           ref.grads[1][world * case.images + rank * extras:world * case.images + (rank + 1) * extras]])
    terms = case.scale / math.sqrt(world * case.images)
    return {
        "launches": current_programs().launches["lse_fwd"],
        "loss": loss.item(), "want_loss": ref.loss, "loss_terms": ref.loss_terms,
        # DDP's convention: rank r's gradient is world * dL/dfeatures_r.
        "image": gradient_error(image.grad / world, ref.grads[0][mine[0]], terms / math.sqrt(world)),
        "text": gradient_error(text.grad / world, want_text, terms / math.sqrt(world)),
        "scale_grad": scale.grad.item(), "want_scale_grad": ref.scale_grad, "scale_terms": ref.scale_grad_terms,
    }


@pytest.mark.parametrize("case, device", [
    *(pytest.param(case, "cuda", id=f"cuda-world2-{case.id}", marks=pytest.mark.gpu) for case in RING_GPU),
    # Two gloo processes with the interpreted kernels (slow to start: spawned, they import everything).
    *(pytest.param(case, "cpu", id=f"cpu-world2-{case.id}", marks=pytest.mark.slow) for case in RING_CPU),
])
def test_the_ring_on_two_ranks_matches_float64(case, device, monkeypatch):
    if device == "cuda" and torch.cuda.device_count() < 2:
        pytest.skip(f"the ring needs two GPUs; this machine has {torch.cuda.device_count()}")
    if device == "cpu":
        monkeypatch.setenv("TRITON_INTERPRET", "1")  # the spawned ranks import the kernels for the interpreter
    mode = MODES[case.mode]
    results = run_in_gloo_world(ring_worker, 2, args=(case, device), timeout=300,
                                backend="nccl" if device == "cuda" else "gloo")
    for rank, result in enumerate(results):
        assert result["launches"] >= 1, "the Triton programs, not the PyTorch reference, computed the loss"
        assert result["loss"] == results[0]["loss"], "every rank returns the same global loss"
        assert abs(result["loss"] - result["want_loss"]) / result["loss_terms"] <= mode.loss_tol, result
        assert result["image"] <= mode.grad_tol and result["text"] <= mode.grad_tol, (rank, result)
    mean_scale_grad = sum(r["scale_grad"] for r in results) / len(results)  # what DDP's average gives
    want = results[0]
    assert abs(mean_scale_grad - want["want_scale_grad"]) / want["scale_terms"] <= mode.grad_tol, results


TUNED_IN_A_PROCESS = """
import json, sys, torch
from clipscale.losses.infcl import infcl_loss
import clipscale.losses.infcl.kernels as kernels
image = torch.randn(4096, 512, device="cuda", dtype=torch.bfloat16).requires_grad_()
text = torch.randn(4096, 512, device="cuda", dtype=torch.bfloat16).requires_grad_()
loss = infcl_loss(image, text, torch.tensor(14.3, device="cuda"), backend="triton")
loss.backward()
programs = kernels.current_programs().device
print(json.dumps({name: str(getattr(programs, name).best_config) for name in ("lse_fwd_kernel", "weights_kernel")}))
"""


@pytest.mark.gpu
def test_a_second_process_takes_the_tuned_tiles_from_the_disk_instead_of_tuning_again(tmp_path):
    """The first process compiles and times every tile config of both tuned programs and keeps the
    timings in Triton's cache; the second, with the same cache, launches the same best configs
    without timing again: its cache files are not written anew."""
    import json
    import os
    import subprocess
    import sys

    env = {**os.environ, "TRITON_CACHE_DIR": str(tmp_path / "triton"), "CLIPSCALE_TUNE": "1"}
    env.pop("TRITON_INTERPRET", None)

    def run() -> dict:
        done = subprocess.run([sys.executable, "-c", TUNED_IN_A_PROCESS], env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        return json.loads(done.stdout.strip().splitlines()[-1])

    first = run()
    kept = {path: path.stat().st_mtime_ns for path in (tmp_path / "triton").rglob("*.autotune.json")}
    assert {path.name for path in kept} == {"lse_fwd_kernel.autotune.json", "weights_kernel.autotune.json"}, kept
    assert run() == first
    assert {path: path.stat().st_mtime_ns for path in (tmp_path / "triton").rglob("*.autotune.json")} == kept


# --- the reference itself, on the CPU: the tiled float64 loss is the full-matrix one ----------------

@pytest.mark.gpu
def test_under_cuda_autocast_normalised_features_are_float32_and_the_loss_takes_them_in_bf16():
    """The trainer's case: open_clip normalises its features under CUDA autocast, whose norm runs
    in float32, so they reach the loss float32; the loss takes them in bf16 (tensor cores), as
    autocast would a matmul's inputs."""
    generator = torch.Generator(device="cuda").manual_seed(5)
    projection = torch.nn.Linear(512, 512, device="cuda")
    base = torch.randn(4099, 512, device="cuda", generator=generator)
    inputs = [base, base + 0.5 * torch.randn(4099, 512, device="cuda", generator=generator)]  # pairs: bf16 moves the loss by ~3e-5
    with torch.autocast("cuda", dtype=torch.bfloat16):
        image, text = (F.normalize(projection(x), dim=-1) for x in inputs)
        assert image.dtype == torch.float32, "the premise: CUDA autocast normalises in float32"
        loss = infcl_loss(image, text, 14.3)
    in_bf16 = infcl_loss(image.bfloat16(), text.bfloat16(), 14.3)
    in_float32 = infcl_loss(image, text, 14.3, exact=True)
    torch.testing.assert_close(loss, in_bf16, rtol=1e-6, atol=0)  # the kernels may merge tiles in another order
    assert not torch.allclose(loss, in_float32, rtol=1e-6, atol=0), "bf16 gave the float32 loss: the test sees nothing"


@pytest.mark.parametrize("images, texts, block", [(1, 1, 4), (7, 11, 3), (9, 9, 4), (6, 10, 100)])
def test_the_tiled_reference_is_the_full_matrix_reference(images, texts, block):
    image, text = (features(n, 5, torch.float64, "cpu", seed) for n, seed in ((images, 1), (texts, 2)))
    full, tiled = clip_loss_float64([image], [text], 14.0), clip_loss_float64_tiled(image, text, 14.0, block)
    assert tiled.loss == pytest.approx(full.loss, abs=1e-12) and tiled.scale_grad == pytest.approx(full.scale_grad, abs=1e-12)
    for got, want in zip(tiled.grads, full.grads):
        assert torch.allclose(got, want[0], atol=1e-12)
    views = features(10, 4, torch.float64, "cpu", seed=3)
    full, tiled = ntxent_loss_float64([views], TEMPERATURE), ntxent_loss_float64_tiled(views, TEMPERATURE, block)
    assert tiled.loss == pytest.approx(full.loss, abs=1e-12) and torch.allclose(tiled.grads[0], full.grads[0][0], atol=1e-12)
