"""On the GPU: the text tower's causal hint runs a fused causal attention kernel (flash, or cuDNN's
flash-style one) with the masked tower's features to bf16 tolerance, and the compiled tower with its padding
cut gives the full-length features at every bucket."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from clipscale.caption_length import cut_padding, use_causal_kernel
from clipscale.compile import compile_towers
from tests.helpers.captions import LENGTHS, make_tokens, tiny_model

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def text_features(model, tokens):
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        return model(None, tokens)["text_features"].float()


def kernels(model, tokens) -> list[str]:
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        text_features(model, tokens)
        torch.cuda.synchronize()
    return [event.key for event in prof.key_averages()]


def test_the_causal_hint_runs_flash_attention_with_the_masked_features():
    masked = tiny_model().cuda()
    causal = copy.deepcopy(masked)
    assert use_causal_kernel(causal) is None
    tokens = make_tokens(LENGTHS, seed=0).cuda()
    # Only the causal tower is asserted: the masked one's kernel depends on the torch build (torch
    # 2.11 on an H200 runs it through cuDNN's fused attention too, with the mask read as a tensor).
    assert any("flash" in name for name in kernels(causal, tokens))
    assert torch.allclose(text_features(causal, tokens), text_features(masked, tokens), atol=2e-2, rtol=0)


def test_the_compiled_cut_tower_gives_the_full_length_features(tmp_path):
    reference = tiny_model().cuda()
    model = copy.deepcopy(reference)
    assert cut_padding(model) is None and use_causal_kernel(model) is None
    compile_towers(model, tmp_path)
    tokens = make_tokens(LENGTHS, seed=0).cuda()
    want = text_features(reference, tokens)
    for length in (16, 48, 77):
        fits = [row for row, n in enumerate(LENGTHS) if n <= length]
        assert torch.allclose(text_features(model, tokens[fits, :length]), want[fits], atol=2e-2, rtol=0), length
