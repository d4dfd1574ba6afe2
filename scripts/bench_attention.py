"""The towers' self-attention alone on the GPU: open_clip's nn.MultiheadAttention (F.scaled_dot_product_attention,
torch's kernel choice) against `model.attention: short` (clipscale/attention.py), at the shapes of a
ViT-B/32 chunk (50 tokens, width 768, 12 heads), a ViT-B/16 chunk (197 tokens) and of text chunks cut to their length (width 512,
8 heads, causal), compiled as the towers are and replayed as CUDA graphs as the trainer's towers
are (`mode="reduce-overhead"`: without them the host's launches entered the timings, and two H100s
disagreed by 1.5x on the same kernel, docs/benchmarks.md's seventeenth session), under bf16
autocast: the forward without autograd (Gradient Cache's pass 1) and forward plus backward (pass
2), milliseconds per call by CUDA events, and how far short's outputs and gradients lie from
sdpa's (both against a float32 reference). The projections are in both; the difference between
the two is the attention's.

    python scripts/bench_attention.py --out results/bench_attention.json
"""

from __future__ import annotations

import argparse
import copy
import json

import torch
from torch import nn

from clipscale.attention import ShortAttention
from clipscale.provenance import provenance

SHAPES = {  # name: (samples, tokens, width, heads, causal)
    "ViT-B/32 image chunk": (512, 50, 768, 12, False),
    "ViT-B/16 image chunk": (256, 197, 768, 12, False),
    "text chunk, 28 positions": (512, 28, 512, 8, True),
    "text chunk, 64 positions": (512, 64, 512, 8, True),
}


def timed_ms(fn, repeats: int) -> float:
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeats


def attend(module: nn.Module, x: torch.Tensor, causal: bool) -> torch.Tensor:
    mask = nn.Transformer.generate_square_subsequent_mask(x.shape[1], device=x.device) if causal else None
    return module(x, x, x, need_weights=False, attn_mask=mask, is_causal=causal)[0]


def measure(name: str, samples: int, tokens: int, width: int, heads: int, causal: bool, repeats: int) -> dict:
    torch._dynamo.reset()  # each shape's four graphs (two modules, two grad modes) within dynamo's recompile limit
    torch.manual_seed(0)
    sdpa = nn.MultiheadAttention(width, heads, batch_first=True).cuda()
    short = copy.deepcopy(sdpa)
    short.__class__ = ShortAttention
    x = torch.randn(samples, tokens, width, device="cuda")
    grad = torch.randn_like(x)
    row = {"shape": name, "samples": samples, "tokens": tokens, "width": width, "heads": heads, "causal": causal}
    outputs = {}
    for label, module in (("sdpa", sdpa), ("short", short)):
        compiled = torch.compile(lambda y, m=module: attend(m, y, causal), dynamic=False, mode="reduce-overhead")

        def forward():
            torch.compiler.cudagraph_mark_step_begin()  # the last call's outputs may be written over
            with torch.no_grad(), torch.autocast("cuda", torch.bfloat16):
                return compiled(x)

        def forward_backward():
            torch.compiler.cudagraph_mark_step_begin()
            # A gradient left from the last call lies in graph memory this call's replay writes over:
            # accumulating into it fails ("accessing tensor output of CUDAGraphs that has been overwritten").
            module.zero_grad(set_to_none=True)
            y = x.detach().requires_grad_()
            with torch.autocast("cuda", torch.bfloat16):
                out = compiled(y)
            out.backward(grad)
            return out, y.grad

        row[f"{label}_forward_ms"] = timed_ms(forward, repeats)
        row[f"{label}_forward_backward_ms"] = timed_ms(forward_backward, repeats)
        out, x_grad = forward_backward()
        outputs[label] = (out.float().clone(), x_grad.float().clone(), module.in_proj_weight.grad.float().clone())
    y = x.detach().requires_grad_()
    reference = attend(sdpa, y, causal)  # float32, torch's kernels
    reference_grad, = torch.autograd.grad(reference, y, grad)
    for label, (out, x_grad, _) in outputs.items():
        row[f"{label}_output_error"] = (out - reference).abs().max().item()
        row[f"{label}_input_grad_error"] = (x_grad - reference_grad).abs().max().item()
    row["weight_grad_difference"] = (outputs["short"][2] - outputs["sdpa"][2]).abs().max().item()
    row["forward_speedup"] = row["sdpa_forward_ms"] / row["short_forward_ms"]
    row["forward_backward_speedup"] = row["sdpa_forward_backward_ms"] / row["short_forward_backward_ms"]
    print(json.dumps(row), flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--repeats", type=int, default=50)
    args = parser.parse_args()
    rows = [measure(name, *shape, repeats=args.repeats) for name, shape in SHAPES.items()]
    with open(args.out, "w") as f:
        json.dump({**provenance(), "results": rows}, f, indent=1)


if __name__ == "__main__":
    main()
