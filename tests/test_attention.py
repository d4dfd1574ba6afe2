"""model.attention: short (issue 49): the towers' self-attention of short sequences in clipscale's own
Triton programs (clipscale/attention.py), run here in Triton's interpreter on CPU tensors.

Held to F.scaled_dot_product_attention in float64: the output and the packed projection's gradient
at awkward sizes (1, 5, 7, 33, 50 and 64 tokens in one tile; 65, 100, 197 and 256 through the key
loop; head widths 8 to 64 and one not a power of two, causal and not, a strided input); a whole
open_clip CLIP with every block changed gives the same features and every parameter's gradient as
open_clip's own, eager and compiled (aot_eager), with the same state_dict; what the kernels do not
cover falls back to nn.MultiheadAttention.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from clipscale.attention import MAX_TOKENS, ShortAttention, reference_attention, short_attention, use_short_attention
from clipscale.config import ModelConfig
from clipscale.errors import UserError
from clipscale.models import build_model

from tests.helpers.gradients import relative_error, tiny_clip

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(autouse=True)
def interpreted(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


@pytest.mark.parametrize("samples, tokens, heads, head_dim, causal", [
    (3, 50, 3, 64, False), (2, 7, 2, 32, True), (2, 1, 1, 16, False), (1, 64, 2, 64, True), (2, 33, 3, 24, False),
    (2, 17, 2, 16, True), (2, 5, 2, 8, True),
    (2, 65, 2, 16, False), (2, 197, 2, 32, False), (2, 100, 2, 24, True), (1, 256, 1, 16, True)])  # key loop
def test_output_and_gradient_equal_sdpa_in_float64(samples, tokens, heads, head_dim, causal):
    torch.manual_seed(tokens)
    qkv = torch.randn(samples, tokens, 3 * heads * head_dim, dtype=torch.float64, requires_grad=True)
    probe = torch.randn(samples, tokens, heads * head_dim, dtype=torch.float64)
    got = short_attention(qkv, heads, causal)
    want = reference_attention(qkv, heads, causal)
    got_grad, = torch.autograd.grad(got, qkv, probe)
    want_grad, = torch.autograd.grad(want, qkv, probe)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-13)
    torch.testing.assert_close(got_grad, want_grad, rtol=1e-12, atol=1e-13)


@pytest.mark.parametrize("tokens", [25, 70])  # one tile; the key loop
def test_a_strided_projection_is_read_in_place(tokens):
    """A view whose samples lie apart (a slice of a longer sequence) gives the contiguous copy's results."""
    torch.manual_seed(0)
    longer = torch.randn(2, tokens + 15, 3 * 2 * 16, dtype=torch.float64)
    qkv = longer[:, 5:5 + tokens].requires_grad_()
    assert not qkv.is_contiguous()
    probe = torch.randn(2, tokens, 32, dtype=torch.float64)
    got_grad, = torch.autograd.grad(short_attention(qkv, 2), qkv, probe)
    want_grad, = torch.autograd.grad(reference_attention(qkv, 2), qkv, probe)
    torch.testing.assert_close(short_attention(qkv, 2), reference_attention(qkv, 2), rtol=1e-12, atol=1e-13)
    torch.testing.assert_close(got_grad, want_grad, rtol=1e-12, atol=1e-13)


def image_and_text_step(model: nn.Module, images: torch.Tensor, texts: torch.Tensor):
    model.zero_grad(set_to_none=True)
    image, text = model.encode_image(images), model.encode_text(texts)
    (image.sum() + (text * torch.arange(text.shape[1], dtype=text.dtype)).sum()).backward()
    return image.detach(), text.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("compiled", [False, True])
def test_a_clip_gives_open_clips_features_and_gradients(compiled):
    """Both towers changed, the text tower's causal mask with the causal hint, as caption_length sets
    it (a mask without the hint: test_the_kernels_run_for_what_they_cover)."""
    from clipscale.caption_length import use_causal_kernel

    want_model = tiny_clip(dropout=0.0).double()
    got_model = copy.deepcopy(want_model)
    assert use_short_attention(got_model) == 4
    assert use_causal_kernel(got_model) is None
    assert all(type(b.attn) is ShortAttention for b in got_model.transformer.resblocks)
    assert list(got_model.state_dict()) == list(want_model.state_dict())
    if compiled:
        got_model.encode_image = torch.compile(got_model.encode_image, backend="aot_eager", dynamic=False)
        got_model.encode_text = torch.compile(got_model.encode_text, backend="aot_eager", dynamic=False)
    torch.manual_seed(1)
    images = torch.randn(3, 3, 32, 32, dtype=torch.float64)
    texts = torch.randint(1, 1000, (3, 16))
    want_image, want_text, want = image_and_text_step(want_model, images, texts)
    got_image, got_text, got = image_and_text_step(got_model, images, texts)
    torch.testing.assert_close(got_image, want_image, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got_text, want_text, rtol=1e-12, atol=1e-12)
    assert got.keys() == want.keys() and relative_error(got, want) < 1e-11


def test_the_kernels_run_for_what_they_cover(monkeypatch):
    """A forward of ViT-like self-attention runs the program; each case outside falls back to
    nn.MultiheadAttention (their own computation, the same result)."""
    from clipscale import attention

    torch.manual_seed(0)
    module = nn.MultiheadAttention(32, 2, batch_first=True).double()
    short = copy.deepcopy(module)
    short.__class__ = ShortAttention
    x = torch.randn(2, 9, 32, dtype=torch.float64)
    calls = []
    real = attention.short_attention
    monkeypatch.setattr(attention, "short_attention", lambda *a, **k: calls.append(a[0].shape) or real(*a, **k))
    covered = short(x, x, x, need_weights=False)[0]
    assert calls == [torch.Size([2, 9, 96])]
    torch.testing.assert_close(covered, module(x, x, x, need_weights=False)[0], rtol=1e-12, atol=1e-13)
    long_x = torch.randn(2, MAX_TOKENS + 1, 32, dtype=torch.float64)
    additive = torch.zeros(9, 9, dtype=torch.float64)
    for args, kwargs in [((x, x, x), {"need_weights": True}),
                         ((x, x, x), {"need_weights": False, "attn_mask": additive}),
                         ((x, x, x), {"need_weights": False, "key_padding_mask": torch.zeros(2, 9, dtype=torch.bool)}),
                         ((x, x.clone(), x), {"need_weights": False}),
                         ((long_x, long_x, long_x), {"need_weights": False})]:
        torch.testing.assert_close(short(*args, **kwargs)[0], module(*args, **kwargs)[0], rtol=1e-12, atol=1e-13)
    assert len(calls) == 1


def test_the_config_key_and_auto_build_it_and_a_model_without_blocks_is_refused():
    custom = {"embed_dim": 16, "vision_cfg": {"image_size": 32, "patch_size": 8, "width": 32, "layers": 1, "head_width": 16},
              "text_cfg": {"context_length": 16, "vocab_size": 49408, "width": 32, "heads": 2, "layers": 1}}
    model = build_model(ModelConfig(custom=custom, attention="short")).model
    assert type(model.visual.transformer.resblocks[0].attn) is ShortAttention
    def attention_of(**where):
        return type(build_model(ModelConfig(custom=custom), **where).model.visual.transformer.resblocks[0].attn)

    assert attention_of(compiled=True, gpu=True) is ShortAttention  # auto: compiled on a GPU
    assert attention_of(compiled=True) is attention_of(gpu=True) is attention_of() is nn.MultiheadAttention
    with pytest.raises(UserError, match="model.attention: short applies to open_clip's transformer towers"):
        use_short_attention(nn.Sequential(nn.Linear(2, 2)))
    assert use_short_attention(nn.Sequential(nn.Linear(2, 2)), where_possible=True) == 0  # auto leaves it as it is
