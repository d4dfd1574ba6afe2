#!/usr/bin/env python3
"""Symmetric CLIP loss, forward + backward, on one GPU: our Inf-CL Triton
kernels against the plain PyTorch loss and the PyPI `inf_cl` package.

    python scripts/bench_loss.py --b 8192,65536,262144,1048576 --out results/bench_loss_h100.json

Methods (--methods, comma separated):
  ours_bf16    Triton kernels, bf16 features, fp32 accumulation
  ours_exact   Triton kernels, fp32 features, IEEE fp32 dots (no TF32)
  torch_bf16   logits = s * I @ T.T in bf16, F.cross_entropy both ways
  torch_fp32   the same in fp32 (PyTorch's default matmul precision)
  inf_cl       inf_cl.cal_inf_loss(I, T) and (T, I), averaged (fp32 inputs)

"ours" runs the tile primitives of clipscale.losses.infcl.kernels through a
small autograd harness in this file (the symmetric loss: lse_pass once,
grad_pass once, positive logits and -T_i/-I_i terms in O(b d)), or through
clipscale.losses.infcl.infcl_loss with --via-loss.

Per (method, b): median ms of forward+backward (CUDA events, warm-up first),
extra peak memory (max_memory_allocated minus the inputs), TFLOP/s for ours
(8 b^2 d), ratios of each peer to ours_bf16; "oom" where it does not fit and
"skipped" where the projected time exceeds --cap-s. Accuracy against float64
at b = --acc-b: relative error of the loss and of the feature gradients.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from clipscale.losses.infcl import infcl_loss
from clipscale.losses.infcl import kernels as K
from clipscale.losses.infcl.precision import tf32_allowed
from clipscale.provenance import provenance

GiB = 1024**3


# ------------------------------------------------------------------ the losses
class _OursSymmetric(torch.autograd.Function):
    """L = 1/2 [mean_i lse_row_i + mean_j lse_col_j] - s mean_i <I_i, T_i>."""

    @staticmethod
    def forward(ctx, image, text, scale: float, exact: bool):
        b = image.shape[0]
        row, col = K.lse_pass(image, text, scale, exact=exact)
        pos = torch.empty(b, dtype=torch.float32, device=image.device)
        for i in range(0, b, 65536):  # O(b d) in chunks: no fp32 copy of the inputs
            pos[i:i + 65536] = (image[i:i + 65536].float() * text[i:i + 65536].float()).sum(1)
        ctx.save_for_backward(image, text, row, col)
        ctx.scale, ctx.exact = scale, exact
        return 0.5 * (row.mean() + col.mean()) - scale * pos.mean()

    @staticmethod
    def backward(ctx, go):
        image, text, row, col = ctx.saved_tensors
        b, s = image.shape[0], ctx.scale
        w = torch.full((b,), 0.5 / b, dtype=torch.float32, device=image.device)
        gi, gt = K.grad_pass(image, text, s, row, col, w, w, exact=ctx.exact)
        gi.add_(text, alpha=-s / b)
        gt.add_(image, alpha=-s / b)
        gi.mul_(go)
        gt.mul_(go)
        return gi.to(image.dtype), gt.to(text.dtype), None, None


_SCALES: dict = {}


def scale_tensor(s: float, device) -> torch.Tensor:
    """The logit scale as a device tensor made once (in training it is a parameter
    already on the GPU), so the timed call includes no host-to-device copy."""
    key = (s, str(device))
    if key not in _SCALES:
        _SCALES[key] = torch.full((), s, dtype=torch.float32, device=device)
    return _SCALES[key]


def ours(exact: bool, via_loss: bool):
    if via_loss:
        return lambda I, T, s: infcl_loss(I, T, scale_tensor(s, I.device), exact=exact)
    return lambda I, T, s: _OursSymmetric.apply(I, T, s, exact)


def torch_loss(I, T, s):
    logits = s * I @ T.T
    labels = torch.arange(I.shape[0], device=I.device)
    return 0.5 * (F.cross_entropy(logits, labels) + F.cross_entropy(logits.T, labels))


def infcl_pkg(I, T, s):
    from inf_cl import cal_inf_loss

    sc = torch.tensor(s, device=I.device)
    return 0.5 * (cal_inf_loss(I, T, scale=sc) + cal_inf_loss(T, I, scale=sc))


METHODS = {
    "ours_bf16": (torch.bfloat16, lambda a: ours(False, a.via_loss)),
    "ours_exact": (torch.float32, lambda a: ours(True, a.via_loss)),
    "harness_bf16": (torch.bfloat16, lambda a: ours(False, False)),  # always this file's harness
    "torch_bf16": (torch.bfloat16, lambda a: torch_loss),
    "torch_fp32": (torch.float32, lambda a: torch_loss),
    "inf_cl": (torch.float32, lambda a: infcl_pkg),
}


# ------------------------------------------------------------------- helpers
def features(b, d, dtype, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(b, d, device="cuda", generator=g)
    return F.normalize(x, dim=1).to(dtype)


def run_once(fn, I, T, s):
    I.grad = T.grad = None
    loss = fn(I, T, s)
    loss.backward()
    return loss


def time_method(fn, b, d, dtype, budget_ms):
    I = features(b, d, dtype, 1).requires_grad_()
    T = features(b, d, dtype, 2).requires_grad_()
    s = 100.0
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    run_once(fn, I, T, s)  # warm-up (compile / autotune happens here)
    torch.cuda.synchronize()
    first_s = time.perf_counter() - t0
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    run_once(fn, I, T, s)  # second warm-up, timed: sets the repeat count
    end.record()
    torch.cuda.synchronize()
    est = start.elapsed_time(end)
    reps = max(1, min(10, int(budget_ms / max(est, 1e-3))))
    times = []
    for _ in range(reps):
        start.record()
        run_once(fn, I, T, s)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    peak = torch.cuda.max_memory_allocated() - base
    # Back to back: `reps` steps between two events, no synchronisation in between
    # except the loss's own (host launch gaps overlap the previous step's kernels).
    start.record()
    for _ in range(reps):
        run_once(fn, I, T, s)
    end.record()
    torch.cuda.synchronize()
    back_to_back = start.elapsed_time(end) / reps
    del I, T
    return dict(ms=statistics.median(times), reps=reps, first_call_s=round(first_s, 2),
                extra_gib=peak / GiB, all_ms=[round(t, 3) for t in times], ms_back_to_back=back_to_back)


def accuracy(methods, args, b, s):
    """Relative error vs float64 autograd on the same fp32 features."""
    d = args.d
    I32, T32 = features(b, d, torch.float32, 3), features(b, d, torch.float32, 4)
    I64, T64 = I32.double().requires_grad_(), T32.double().requires_grad_()
    ref = torch_loss(I64, T64, s)
    ref.backward()
    out = {}
    for name in methods:
        dtype, make = METHODS[name]
        try:
            I = I32.to(dtype).detach().clone().requires_grad_()
            T = T32.to(dtype).detach().clone().requires_grad_()
            loss = run_once(make(args), I, T, s)
            gerr = math.sqrt(((I.grad.double() - I64.grad).norm() ** 2 + (T.grad.double() - T64.grad).norm() ** 2).item())
            gref = math.sqrt((I64.grad.norm() ** 2 + T64.grad.norm() ** 2).item())
            out[name] = dict(loss_rel=abs(loss.item() - ref.item()) / abs(ref.item()), grad_rel=gerr / gref)
        except Exception as e:  # noqa: BLE001
            out[name] = dict(error=f"{type(e).__name__}: {e}"[:300])
        print(f"acc b={b} s={s} {name}: {out[name]}", flush=True)
    return dict(b=b, d=d, scale=s, reference="float64 autograd over the full matrix, same fp32 features",
                results=out)


def breakdown(b, d):
    """ms of the forward primitive and of the backward primitive alone (bf16)."""
    I, T = features(b, d, torch.bfloat16, 5), features(b, d, torch.bfloat16, 6)
    s = 100.0
    w = torch.full((b,), 0.5 / b, device="cuda")
    row, col = K.lse_pass(I, T, s)

    def med(fn, n=5):
        fn()
        st, en = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        ts = []
        for _ in range(n):
            st.record()
            fn()
            en.record()
            torch.cuda.synchronize()
            ts.append(st.elapsed_time(en))
        return statistics.median(ts)

    f = med(lambda: K.lse_pass(I, T, s))
    g = med(lambda: K.grad_pass(I, T, s, row, col, w, w))
    flop = 2 * b * b * d
    r = dict(b=b, lse_pass_ms=f, lse_pass_tflops=flop / f / 1e9, grad_pass_ms=g, grad_pass_tflops=3 * flop / g / 1e9,
             fwd_config=str(K.current_programs().device.lse_fwd_kernel.best_config),
             weights_config=str(K.current_programs().device.weights_kernel.best_config))
    print("breakdown", r, flush=True)
    return r


def profile(b, d, steps=5):
    """Kernel-level breakdown of infcl_loss forward+backward (bf16) from torch.profiler:
    per kernel name, total device us per step and launches per step."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    fn = ours(False, True)
    I = features(b, d, torch.bfloat16, 7).requires_grad_()
    T = features(b, d, torch.bfloat16, 8).requires_grad_()
    for _ in range(3):
        run_once(fn, I, T, 100.0)
    torch.cuda.synchronize()
    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            run_once(fn, I, T, 100.0)
        torch.cuda.synchronize()
    rows = []
    for e in prof.key_averages():
        dev_us = getattr(e, "self_device_time_total", None)
        if dev_us is None:
            dev_us = getattr(e, "self_cuda_time_total", 0)
        if dev_us > 0:
            rows.append(dict(name=e.key[:120], us_per_step=dev_us / steps, calls_per_step=e.count / steps))
    rows.sort(key=lambda r: -r["us_per_step"])
    total = sum(r["us_per_step"] for r in rows)
    print(f"profile b={b}: device time per step {total:.1f} us over {sum(r['calls_per_step'] for r in rows):.0f} launches",
          flush=True)
    for r in rows[:25]:
        print(f"  {r['us_per_step']:9.1f} us  x{r['calls_per_step']:4.1f}  {r['name']}", flush=True)
    return dict(b=b, d=d, device_us_per_step=total, kernels=rows)


def sync_check(b, d):
    """Host synchronisations in one infcl_loss forward+backward (CUDA's sync debug
    mode warns once per synchronising call), after a warm-up step."""
    import warnings

    fn = ours(False, True)
    I = features(b, d, torch.bfloat16, 9).requires_grad_()
    T = features(b, d, torch.bfloat16, 10).requires_grad_()
    run_once(fn, I, T, 100.0)
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            run_once(fn, I, T, 100.0)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    syncs = [str(w.message).splitlines()[0][:160] for w in caught if "synchroniz" in str(w.message).lower()]
    print(f"sync check b={b}: {len(syncs)} synchronising call(s): {syncs}", flush=True)
    return dict(b=b, syncs=len(syncs), messages=syncs)


def gpu_selfcheck():
    """The interpreter tests' cases on CUDA (masks, offsets, odd/rectangular
    sizes, dtypes, several super-tiles) against float64; returns max errors."""
    res = {}
    cases = [(37, 53, 24, False, 0, 0), (300, 200, 64, False, 0, 0), (257, 257, 512, True, 0, 0),
             (130, 390, 1024, True, 100, 7), (5, 7, 1000, False, 0, 0), (1000, 1000, 96, False, 0, 0)]
    P = K.current_programs().device
    old = (K.MAX_H, K.WORKSPACE_ELEMS, P.TUNE)
    K.MAX_H, K.WORKSPACE_ELEMS, P.TUNE = 128, 128 * 256, False  # several super-tiles, no tuning
    try:
        for dtype, exact in [(torch.float32, True), (torch.float32, False), (torch.bfloat16, False), (torch.float16, False)]:
            worst = dict(lse=0.0, grad=0.0)
            for (m, n, d, mask, ro, co) in cases:
                I, T = features(m, d, dtype, m), features(n, d, dtype, n + 1)
                s = 30.0
                x = s * I.double() @ T.double().T
                if mask:
                    r = torch.arange(m, device="cuda")[:, None] + ro
                    c = torch.arange(n, device="cuda")[None, :] + co
                    x = x.masked_fill(r == c, float("-inf"))
                rl, cl = x.logsumexp(1), x.logsumexp(0)
                row, col = K.lse_pass(I, T, s, row_offset=ro, col_offset=co, mask_diagonal=mask, exact=exact)
                e = max((row.double() - rl).abs().max().item(), (col.double() - cl).abs().max().item())
                rw = torch.rand(m, device="cuda") + 0.5
                cw = torch.rand(n, device="cuda") + 0.5
                g = (rw.double()[:, None] * (x - rl[:, None]).exp() + cw.double()[None, :] * (x - cl[None, :]).exp())
                gi, gt = K.grad_pass(I, T, s, rl.float(), cl.float(), rw, cw, row_offset=ro, col_offset=co,
                                     mask_diagonal=mask, exact=exact)
                ri, rt = s * g @ T.double(), s * g.T @ I.double()
                eg = max(((gi.double() - ri).norm() / ri.norm()).item(), ((gt.double() - rt).norm() / rt.norm()).item())
                worst["lse"] = max(worst["lse"], e)
                worst["grad"] = max(worst["grad"], eg)
            res[f"{dtype}".replace("torch.", "") + ("_exact" if exact else "")] = worst
            print("selfcheck", dtype, exact, worst, flush=True)
    finally:
        K.MAX_H, K.WORKSPACE_ELEMS, P.TUNE = old
        for kern in (P.lse_fwd_kernel, P.weights_kernel):
            kern.cache.clear()  # forget the untuned choices
    return res


# ------------------------------------------------- float32 with TF32 off and on
def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want).norm() / want.norm()).item()


def _infcl_float32_errors(image64, text64, scale: float) -> dict:
    """infcl_loss on float32 copies of the float64 features, against the float64 loss
    (torch_loss, autograd over the full matrix): relative error of the loss and of the
    gradients of both features and the scale."""
    def loss_and_grads(image, text, dtype):
        leaves = [image.to(dtype).requires_grad_(), text.to(dtype).requires_grad_(),
                  torch.tensor(scale, dtype=dtype, device=image.device, requires_grad=True)]
        loss = (torch_loss if dtype == torch.float64 else infcl_loss)(*leaves)
        return [loss.detach(), *torch.autograd.grad(loss, leaves)]

    want = loss_and_grads(image64, text64, torch.float64)
    got = loss_and_grads(image64, text64, torch.float32)
    names = ("loss", "grad_image", "grad_text", "grad_scale")
    return {f"{name}_rel": _relative_error(g, w) for name, g, w in zip(names, got, want)}


def _time_infcl_float32(b: int, d: int, device, repeats: int) -> float:
    """Median ms of infcl_loss forward + backward on float32 features (scale 100)."""
    image, text = (F.normalize(torch.randn(b, d, device=device), dim=1).requires_grad_() for _ in range(2))
    scale = torch.tensor(100.0, device=device)
    times = []
    for _ in range(repeats + 1):  # the first call compiles and autotunes
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        infcl_loss(image, text, scale).backward()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times[1:])


def fp32_precision_check(acc_b: int, acc_d: int, speed_b: int, speed_d: int, repeats: int, device) -> dict:
    """infcl_loss on float32 features with PyTorch's TF32 not allowed and allowed: errors
    against float64 at (acc_b, acc_d) and forward + backward time at (speed_b, speed_d).
    `dots` is what the kernels used (the interpreter has no TF32: "ieee" both times)."""
    generator = torch.Generator().manual_seed(0)
    image64, text64 = (F.normalize(torch.randn(acc_b, acc_d, dtype=torch.float64, generator=generator), dim=1).to(device)
                       for _ in range(2))
    rows = []
    for allowed in (False, True):
        with tf32_allowed(allowed):
            row = dict(tf32_allowed=allowed, dots=K.dot_precision(torch.float32, exact=False), b=acc_b, d=acc_d, scale=100.0,
                       **_infcl_float32_errors(image64, text64, 100.0))
            if speed_b:
                row.update(speed_b=speed_b, speed_d=speed_d, ms=_time_infcl_float32(speed_b, speed_d, device, repeats))
        print(json.dumps(row), flush=True)
        rows.append(row)
    if speed_b:
        rows[1]["speedup_vs_tf32_off"] = rows[0]["ms"] / rows[1]["ms"]
    return dict(what="infcl_loss, float32 features: errors against float64 and speed, TF32 not allowed vs allowed",
                **provenance(), results=rows, kernel_launches=dict(K.current_programs().launches))


# ---------------------------------------------------------------------- main
def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--b", default="8192,16384,32768,65536,131072,262144,524288,1048576")
    p.add_argument("--d", type=int, default=512)
    p.add_argument("--methods", default="ours_bf16,ours_exact,harness_bf16,torch_bf16,torch_fp32,inf_cl")
    p.add_argument("--out", default="results/bench_loss.json")
    p.add_argument("--acc-b", type=int, default=4096)
    p.add_argument("--acc-scales", default="14.2857,100")
    p.add_argument("--cap-s", type=float, default=6.0, help="skip a size whose projected time exceeds this (peers)")
    p.add_argument("--cap-ours-s", type=float, default=15.0)
    p.add_argument("--cap-exact-s", type=float, default=4.0)
    p.add_argument("--cap-harness-s", type=float, default=1.0)
    p.add_argument("--breakdown", default="8192,65536", help="b list: time lse_pass and grad_pass alone (bf16)")
    p.add_argument("--budget-ms", type=float, default=1500.0, help="timed repeats per point ~ budget / time")
    p.add_argument("--selfcheck", action="store_true")
    p.add_argument("--via-loss", action="store_true", help="time clipscale.losses.infcl.infcl_loss instead")
    p.add_argument("--profile", default="", help="b list: torch.profiler kernel breakdown of infcl_loss (bf16)")
    p.add_argument("--sync-check", type=int, default=0, help="b: count host synchronisations of infcl_loss")
    p.add_argument("--fp32-precision-check", action="store_true",
                   help="only this: infcl_loss on float32 features, TF32 off vs on (errors against float64 at "
                        "--fp32-acc-b x --fp32-acc-d, speed at --fp32-speed-b x --d); writes --out and stops")
    p.add_argument("--fp32-acc-b", type=int, default=4099)
    p.add_argument("--fp32-acc-d", type=int, default=768)
    p.add_argument("--fp32-speed-b", type=int, default=32768, help="0: no timing")
    p.add_argument("--smoke", action="store_true",
                   help="with --fp32-precision-check: tiny sizes on the CPU under TRITON_INTERPRET=1 (that it runs)")
    args = p.parse_args()
    if args.fp32_precision_check:
        if args.smoke:
            if not K.current_programs().device.INTERPRET:  # read at each call
                sys.exit("--smoke runs the kernels in Triton's interpreter: set TRITON_INTERPRET=1")
            record = fp32_precision_check(37, 16, 48, 16, 1, torch.device("cpu"))
        else:
            record = fp32_precision_check(args.fp32_acc_b, args.fp32_acc_d, args.fp32_speed_b, args.d, 3, torch.device("cuda"))
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(record, f, indent=1)
        return
    methods = [m for m in args.methods.split(",") if m]
    sizes = [int(x) for x in args.b.split(",") if x]

    result = dict(
        **provenance(), sm_count=torch.cuda.get_device_properties(0).multi_processor_count, d=args.d,
        harness="clipscale.losses.infcl.infcl_loss" if args.via_loss else "scripts/bench_loss.py _OursSymmetric over kernels.lse_pass/grad_pass",
        flops_per_step="8*b^2*d", scale=100.0, timing=[], accuracy=[], selfcheck=None)

    def save():
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)

    if args.selfcheck:
        result["selfcheck"] = gpu_selfcheck()
        save()
    if args.sync_check:
        result["sync_check"] = sync_check(args.sync_check, args.d)
        save()
    result["breakdown"] = [breakdown(int(b), args.d) for b in args.breakdown.split(",") if b]
    save()
    if args.profile:
        result["profile"] = [profile(int(b), args.d) for b in args.profile.split(",") if b]
        save()
    for s in [float(x) for x in args.acc_scales.split(",") if x]:
        if args.acc_b:
            result["accuracy"].append(accuracy(methods, args, args.acc_b, s))
            save()

    for name in methods:
        dtype, make = METHODS[name]
        fn = make(args)
        last = None
        cap = dict(ours_bf16=args.cap_ours_s, ours_exact=args.cap_exact_s, harness_bf16=args.cap_harness_s).get(name, args.cap_s)
        dead = None
        for b in sizes:
            entry = dict(method=name, b=b)
            if dead:
                entry["status"] = dead
            elif last and last[1] * (b / last[0]) ** 2 > cap * 1000:
                entry["status"] = f"skipped (projected {last[1] * (b / last[0]) ** 2 / 1000:.0f} s > cap {cap:.0f} s)"
                dead = "skipped (time cap)"
            else:
                try:
                    r = time_method(fn, b, args.d, dtype, args.budget_ms)
                    entry.update(status="ok", **r, tflops=8 * b * b * args.d / (r["ms"] * 1e-3) / 1e12)
                    last = (b, r["ms"])
                except torch.OutOfMemoryError:
                    entry["status"] = "oom"
                    dead = "oom"
                except Exception as e:  # noqa: BLE001
                    entry["status"] = f"error: {type(e).__name__}: {e}"[:400]
                    dead = "error"
                torch.cuda.empty_cache()
            result["timing"].append(entry)
            print(json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in entry.items()
                              if k != "all_ms"}), flush=True)
            save()

    # ratios (peer time / ours_bf16 time) and a summary table
    ok = {(e["method"], e["b"]): e for e in result["timing"] if e.get("status") == "ok"}
    for e in result["timing"]:
        mine = ok.get(("ours_bf16", e["b"]))
        if e.get("status") == "ok" and mine:
            e["ratio_to_ours_bf16"] = e["ms"] / mine["ms"]
    save()
    print("\n| b | " + " | ".join(methods) + " |")
    print("|---|" + "---|" * len(methods))
    for b in sizes:
        cells = []
        for m in methods:
            e = next((x for x in result["timing"] if x["method"] == m and x["b"] == b), None)
            if e is None:
                cells.append("")
            elif e.get("status") == "ok":
                cells.append(f"{e['ms']:.1f} ms / {e['extra_gib']:.2f} GiB / {e['tflops']:.0f} TF")
            else:
                cells.append(e["status"][:20])
        print(f"| {b} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
