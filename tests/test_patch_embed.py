"""model.patch_embed: matmul (issue 49): an open_clip ViT's patch convolution (`visual.conv1`) as one
matrix product over the unfolded patches, with the same weight under the same state_dict key.

Held to the convolution: features, every parameter's gradient and the pixels' gradient in float64
(patch 4 at 32 px and patch 32 at 224 px, batch 3, contiguous and channels-last images and
weights), the same under bf16 autocast to its rounding, the same in the compiled towers (aot_eager
on the CPU, Gradient Cache's two passes), checkpoints that open_clip loads both ways, and the
patches' order inside the product pinned down pixel by pixel.
"""

from __future__ import annotations

import copy
import os

import open_clip
import pytest
import torch
import torch.nn as nn
from open_clip.transformer import VisionTransformer
from torch._dynamo.utils import counters

from clipscale.compile import compile_enabled, compile_towers
from clipscale.config import ConfigError, ModelConfig, load_config
from clipscale.errors import UserError
from clipscale.models import OPEN_CLIP_WEIGHTS, PatchMatmul, build_model, embed_patches_by_matmul, register_custom
from clipscale.utilization import forward_flops

from tests.helpers.gradients import float64_clip_loss, gradcache_grads, make_batch, plain_grads, relative_error, tiny_clip
from tests.helpers.tiny_runs import DIGITS_YAML, tiny_run

pytestmark = pytest.mark.timeout(180)
os.environ["HF_HUB_OFFLINE"] = "1"

TEXT = {"context_length": 16, "vocab_size": 49408, "width": 32, "heads": 2, "layers": 1}


def vit(image: int, patch: int) -> dict:
    vision = {"image_size": image, "patch_size": patch, "width": 32, "layers": 2, "head_width": 16, "mlp_ratio": 2.0}
    return {"embed_dim": 16, "text_cfg": TEXT, "vision_cfg": vision}


def conv_and_matmul(custom: dict, **options) -> tuple[nn.Module, nn.Module]:
    """The same ViT (same weights) built with model.patch_embed conv and matmul."""
    conv = build_model(ModelConfig(custom=custom, **options)).model
    matmul = build_model(ModelConfig(custom=custom, patch_embed="matmul", **options)).model
    matmul.load_state_dict(conv.state_dict(), strict=True)
    assert type(conv.visual.conv1) is nn.Conv2d and type(matmul.visual.conv1) is PatchMatmul
    return conv, matmul


def image_step(model: nn.Module, images: torch.Tensor, probe: torch.Tensor):
    """Image features, and the gradients of a scalar of them: every parameter's and the pixels'."""
    model.zero_grad(set_to_none=True)
    images = images.detach().clone().requires_grad_()
    features = model.encode_image(images)
    (features.float() * probe).sum().backward()
    grads = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
    return features.detach(), grads, images.grad


@pytest.mark.parametrize("image, patch", [(32, 4), (224, 32)])
@pytest.mark.parametrize("layout", ["contiguous", "channels_last images", "channels_last model"])
def test_features_and_every_gradient_equal_the_convolutions_in_float64(image, patch, layout):
    conv, matmul = conv_and_matmul(vit(image, patch), channels_last=layout == "channels_last model")
    conv, matmul = conv.double().train(), matmul.double().train()
    torch.manual_seed(0)
    images = torch.randn(3, 3, image, image, dtype=torch.float64)
    if layout != "contiguous":
        images = images.contiguous(memory_format=torch.channels_last)
    probe = torch.randn(3, 16)
    want_features, want, want_pixels = image_step(conv, images, probe)
    got_features, got, got_pixels = image_step(matmul, images, probe)
    assert "visual.conv1.weight" in want and len(want) == len(list(conv.visual.parameters()))
    torch.testing.assert_close(got_features, want_features, rtol=1e-12, atol=1e-12)
    assert relative_error(got, want) < 1e-12
    torch.testing.assert_close(got_pixels, want_pixels, rtol=1e-12, atol=1e-14)


def test_the_patches_order_inside_the_product():
    """Output channel k of a weight that is 1 at one (channel, row, column) of the patch and 0
    elsewhere reads that pixel of each patch: a product over patches unfolded in another order
    (rows and columns, or channels, swapped) reads another pixel. A non-square grid of a
    non-square image, so a swapped grid fails too."""
    patch, (c, h, w) = 4, (3, 8, 12)
    visual = VisionTransformer(image_size=(h, w), patch_size=patch, width=c * patch * patch, layers=1, heads=2, mlp_ratio=1.0)
    with torch.no_grad():
        visual.conv1.weight.copy_(torch.eye(c * patch * patch).view(-1, c, patch, patch))
    embed_patches_by_matmul(visual)
    images = torch.arange(2 * c * h * w, dtype=torch.float32).view(2, c, h, w)
    out = visual.conv1(images)
    assert out.shape == (2, c * patch * patch, h // patch, w // patch)
    for k, (channel, row, column) in enumerate(
            (channel, row, column) for channel in range(c) for row in range(patch) for column in range(patch)):
        assert torch.equal(out[:, k], images[:, channel, row::patch, column::patch]), (channel, row, column)


def test_images_not_a_multiple_of_the_patch_drop_the_last_pixels_as_the_convolution_does():
    conv, matmul = conv_and_matmul(vit(32, 8))
    images = torch.randn(3, 3, 35, 39, dtype=torch.float64)
    want = conv.double().visual.conv1(images)
    torch.testing.assert_close(matmul.double().visual.conv1(images), want, rtol=1e-12, atol=1e-12)


def test_bf16_autocast_runs_the_product_in_bf16_and_agrees_to_its_rounding():
    conv, matmul = conv_and_matmul(vit(224, 32))
    torch.manual_seed(0)
    images, probe = torch.randn(3, 3, 224, 224), torch.randn(3, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want_embed, got_embed = conv.visual.conv1(images), matmul.visual.conv1(images)
        want_features, want, _ = image_step(conv, images, probe)
        got_features, got, _ = image_step(matmul, images, probe)
    assert got_embed.dtype == want_embed.dtype == torch.bfloat16 and got_features.dtype == want_features.dtype
    torch.testing.assert_close(got_embed.float(), want_embed.float(), rtol=2**-7, atol=2**-7 * want_embed.abs().max().item())
    torch.testing.assert_close(got_features.float(), want_features.float(), rtol=0.05, atol=0.05)
    assert relative_error(got, want) < 0.05


def test_the_product_counts_the_convolutions_flops():
    """bench_e2e's mfu counts model FLOPs with torch's counter: the same for either path."""
    conv, matmul = conv_and_matmul(vit(224, 32))
    assert forward_flops(conv, 224, 16, torch.device("cpu")) == forward_flops(matmul, 224, 16, torch.device("cpu"))


# --- checkpoints -------------------------------------------------------------------------


def test_a_run_with_the_product_loads_in_open_clip_and_open_clips_weights_in_it(digits_root, tmp_path):
    """A run trained with model.patch_embed: matmul: open_clip's `local-dir:` loader and plain
    `create_model` + strict `load_state_dict` rebuild it (with the convolution) and give its image
    features; open_clip's weights load into a matmul model as model.pretrained."""
    from clipscale.trainer import train

    cfg = load_config(DIGITS_YAML, tiny_run(digits_root, tmp_path, "run.name=matmul", "data.workers=0", "eval.zeroshot=false",
                                            "train.batch_size=16", "train.steps=2", "model.patch_embed=matmul"))
    train(cfg)
    run_dir = tmp_path / "matmul"
    state_dict = torch.load(run_dir / OPEN_CLIP_WEIGHTS, weights_only=True)
    assert "visual.conv1.weight" in state_dict

    ours = build_model(cfg.model).model.eval()
    ours.load_state_dict(state_dict, strict=True)
    assert type(ours.visual.conv1) is PatchMatmul
    from_folder = open_clip.create_model(f"local-dir:{run_dir}").eval()
    plain = open_clip.create_model(register_custom(cfg.model.custom)).eval()  # the name build_model registered
    plain.load_state_dict(state_dict, strict=True)
    torch.manual_seed(0)
    images = torch.randn(3, 3, 32, 32)
    with torch.no_grad():
        want = ours.encode_image(images)
        for theirs in (from_folder, plain):
            assert type(theirs.visual.conv1) is nn.Conv2d
            torch.testing.assert_close(theirs.encode_image(images), want, rtol=1e-5, atol=1e-6)

    torch.save(plain.state_dict(), tmp_path / "open_clip.bin")
    pretrained = build_model(ModelConfig(custom=cfg.model.custom, patch_embed="matmul",
                                         pretrained=str(tmp_path / "open_clip.bin"))).model.eval()
    with torch.no_grad():
        torch.testing.assert_close(pretrained.encode_image(images), want, rtol=0, atol=0)


# --- config ------------------------------------------------------------------------------


def test_an_unknown_value_is_a_config_error_naming_the_allowed_ones():
    with pytest.raises(ConfigError) as error:
        load_config(DIGITS_YAML, ["model.patch_embed=unfold"])
    assert "model.patch_embed" in str(error.value) and "'conv'" in str(error.value) and "'matmul'" in str(error.value)
    assert load_config(DIGITS_YAML, []).model.patch_embed == "auto"


def test_auto_is_the_product_where_the_towers_compile_and_the_convolution_where_not():
    """model.patch_embed: auto (the default) swaps the convolution only where it was measured
    faster: towers compiled for a GPU. Eager CPU towers (the digits default) keep nn.Conv2d, and a
    tower with no patch convolution is left as it is, not refused."""
    custom = vit(32, 8)
    conv1 = lambda compiled, **options: build_model(ModelConfig(custom=custom, **options), compiled).model.visual.conv1  # noqa: E731
    assert type(conv1(False)) is nn.Conv2d and isinstance(conv1(True), PatchMatmul)
    assert type(conv1(True, patch_embed="conv")) is nn.Conv2d and isinstance(conv1(False, patch_embed="matmul"), PatchMatmul)
    assert compile_enabled("auto", torch.device("cuda")) and not compile_enabled("auto", torch.device("cpu"))
    resnet = {"embed_dim": 16, "text_cfg": TEXT, "vision_cfg": {"image_size": 32, "layers": [1, 1, 1, 1], "width": 8, "head_width": 8}}
    assert not isinstance(build_model(ModelConfig(custom=resnet), True).model.visual, PatchMatmul)


def test_an_image_tower_without_a_patch_convolution_is_refused_in_one_line():
    vision = {"image_size": 32, "layers": [1, 1, 1, 1], "width": 8, "head_width": 8}  # open_clip's ModifiedResNet
    resnet = {"embed_dim": 16, "text_cfg": TEXT, "vision_cfg": vision}
    with pytest.raises(UserError, match="model.patch_embed: matmul applies to open_clip's own ViT .* ModifiedResNet"):
        build_model(ModelConfig(custom=resnet, patch_embed="matmul"))
    build_model(ModelConfig(custom=resnet, patch_embed="conv"))  # the tower as open_clip builds it


# --- compiled towers ---------------------------------------------------------------------


@pytest.fixture
def fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def test_the_compiled_towers_with_the_product_give_the_eager_convolutions_gradients(tmp_path, fresh_dynamo):
    """compile_towers compiles the patch embedding too (one graph, no break), and Gradient Cache's
    two passes through the compiled towers give the eager convolution's gradients (aot_eager:
    dynamo and AOTAutograd as with Inductor, ATen's kernels, so float32 rounding)."""
    eager = tiny_clip(0.0)
    compiled = copy.deepcopy(eager)
    embed_patches_by_matmul(compiled.visual)
    explained = torch._dynamo.explain(copy.deepcopy(compiled.visual.conv1))(torch.randn(2, 3, 32, 32))
    assert explained.graph_count == 1 and explained.graph_break_count == 0
    torch._dynamo.reset()
    compile_towers(compiled, tmp_path / "cache", backend="aot_eager")
    assert compiled.visual.conv1._compiled_call_impl is not None, "the patch embedding was not compiled"
    images, texts = make_batch(10, seed=0)
    for seed in (1, 2):
        want_loss, want = plain_grads(eager, float64_clip_loss, images, texts, chunk_size=4, seed=seed)
        got_loss, got = gradcache_grads(compiled, float64_clip_loss, images, texts, chunk_size=4, seed=seed)
        assert abs(got_loss.item() - want_loss.item()) < 1e-6
        assert relative_error(got, want) < 1e-5, f"step with seed {seed}"
