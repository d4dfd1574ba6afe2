"""model.attention: short on the GPU (issue 49): the compiled programs at the towers' real sizes.

Float32 inputs (IEEE products) against float64 at ViT-B/32's 50 tokens, ViT-B/16's 197 and caption
lengths, causal and not (one tile up to 64 tokens, the key loop beyond); bf16 inputs no further from
float64 than torch's own bf16 attention (twice its error and a rounding step); a ViT-B/32 CLIP
compiled with Inductor and CUDA graphs as train.py compiles it, short against sdpa, text cut to
several lengths (dynamic shapes; the full 77 through the key loop), features and gradients to bf16's
rounding.
"""

from __future__ import annotations

import copy

import open_clip
import pytest
import torch
import torch.nn.functional as F

from clipscale.attention import reference_attention, short_attention, use_short_attention
from clipscale.caption_length import cut_padding, use_causal_kernel
from clipscale.compile import begin_graph_step, compile_towers

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
              pytest.mark.timeout(600)]

SIZES = [(512, 50, 12, 64, False), (512, 28, 8, 64, True), (256, 64, 8, 64, True), (256, 197, 12, 64, False),
         (64, 77, 8, 64, True), (7, 33, 3, 64, False), (5, 17, 2, 32, True), (3, 130, 2, 64, False)]


@pytest.mark.parametrize("samples, tokens, heads, head_dim, causal", SIZES)
def test_float32_against_float64(samples, tokens, heads, head_dim, causal):
    torch.manual_seed(tokens)
    qkv = torch.randn(samples, tokens, 3 * heads * head_dim, device="cuda", dtype=torch.float64, requires_grad=True)
    probe = torch.randn(samples, tokens, heads * head_dim, device="cuda", dtype=torch.float64)
    want = reference_attention(qkv, heads, causal)
    want_grad, = torch.autograd.grad(want, qkv, probe)
    single = qkv.detach().float().requires_grad_()
    got = short_attention(single, heads, causal)
    got_grad, = torch.autograd.grad(got, single, probe.float())
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=2e-5)
    torch.testing.assert_close(got_grad.double(), want_grad, rtol=1e-4, atol=2e-5)


@pytest.mark.parametrize("samples, tokens, heads, head_dim, causal", SIZES[:5])
def test_bf16_no_further_from_float64_than_torchs_bf16_attention(samples, tokens, heads, head_dim, causal):
    torch.manual_seed(tokens)
    qkv = torch.randn(samples, tokens, 3 * heads * head_dim, device="cuda", dtype=torch.float64)
    probe = torch.randn(samples, tokens, heads * head_dim, device="cuda", dtype=torch.bfloat16)
    errors = {}
    for name, attend in (("short", short_attention), ("sdpa", reference_attention)):
        x = qkv.bfloat16().requires_grad_()
        out = attend(x, heads, causal)
        grad, = torch.autograd.grad(out, x, probe)
        exact = qkv.detach().requires_grad_()
        want = reference_attention(exact, heads, causal)
        want_grad, = torch.autograd.grad(want, exact, probe.double())
        errors[name] = ((out.double() - want).abs().max().item(), (grad.double() - want_grad).abs().max().item())
    for got, sdpa in zip(errors["short"], errors["sdpa"]):
        assert got <= 2 * sdpa + 2**-8, errors


def test_compiled_clip_with_cuda_graphs_matches_sdpa(tmp_path):
    torch.manual_seed(0)
    sdpa = open_clip.create_model("ViT-B-32").cuda().train()
    short = copy.deepcopy(sdpa)
    use_short_attention(short)
    for model, name in ((sdpa, "sdpa"), (short, "short")):
        assert cut_padding(model) is None and use_causal_kernel(model) is None
        compile_towers(model, tmp_path / name, cuda_graphs=True)
    images = torch.randn(64, 3, 224, 224, device="cuda")
    tokens = torch.randint(1, 49000, (64, 77), device="cuda")
    results = {}
    for name, model in (("sdpa", sdpa), ("short", short)):
        rows = []
        for length in (20, 28, 41, 64, 77):  # cut lengths (the text blocks' dynamic shapes); 77: the loop programs
            text = tokens[:, :length].clone()
            text[:, -1] = 49407  # the end-of-text token (open_clip pools at the largest id)
            model.zero_grad(set_to_none=True)
            begin_graph_step()
            with torch.autocast("cuda", torch.bfloat16):
                image, words = model.encode_image(images), model.encode_text(text)
                loss = (F.normalize(image.float(), dim=-1) @ F.normalize(words.float(), dim=-1).T).logsumexp(1).mean()
            loss.backward()
            rows.append([t.float().clone() for t in (image, words, model.visual.conv1.weight.grad,
                                                     model.transformer.resblocks[0].attn.in_proj_weight.grad)])
        results[name] = rows
    for got, want in zip(results["short"], results["sdpa"]):
        for g, w in zip(got, want):
            scale = w.abs().max().item()
            assert (g - w).abs().max().item() <= 0.03 * scale, (g - w).abs().max().item() / scale
