"""Compiled towers (Inductor) in Gradient Cache on a GPU, against references (`-m gpu`).

A small open_clip ViT in bf16 autocast. Without dropout the compiled Gradient Cache step's
gradients equal the eager step's to bf16 rounding. With dropout, Inductor draws its own masks
(not eager's), so the reference is the same compiled model run with a graph chunk by chunk,
each tower called alone in pass 1's order: Gradient Cache equals it only if pass 1's no-grad
graphs and pass 2's replayed graphs with autograd draw the same masks. Later steps compile nothing.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch._dynamo.utils import counters

from clipscale.compile import compile_towers
from clipscale.gradcache import GradCache, encode
from clipscale.losses import build_loss

from tests.helpers.gradients import grads_of, relative_error, tiny_clip

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
CHUNK = 32


def gradcache(model, images, texts, seed):
    torch.manual_seed(seed)
    model.zero_grad(set_to_none=True)
    GradCache(model, build_loss("infcl"), CHUNK, autocast=torch.bfloat16, reuse_last_chunk=False)(images, texts)
    return grads_of(model)


def chunk_by_chunk(model, images, texts, seed):
    """One graph over the batch, the towers called as Gradient Cache's pass 1 calls them."""
    torch.manual_seed(seed)
    model.zero_grad(set_to_none=True)
    image_features, text_features = [], []
    for start in range(0, len(images), CHUNK):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            image_features.append(encode(model, images[start : start + CHUNK], None).image)
            out = encode(model, None, texts[start : start + CHUNK])
        text_features.append(out.text)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = build_loss("infcl")(torch.cat(image_features), torch.cat(text_features), *out.scalars)
    loss.backward()
    return grads_of(model)


@pytest.mark.parametrize("dropout", [0.0, 0.2], ids=["no-dropout", "dropout"])
def test_compiled_gradient_cache_on_the_gpu(tmp_path, dropout):
    torch._dynamo.reset()
    counters.clear()
    eager = tiny_clip(dropout).cuda()
    compiled = copy.deepcopy(eager)
    compile_towers(compiled, tmp_path / "cache")
    generator = torch.Generator().manual_seed(0)
    images = torch.randn(100, 3, 32, 32, generator=generator).cuda()  # chunks of 32, 32, 32 and 4
    texts = torch.randint(1, 1000, (100, 16), generator=generator).cuda()
    for seed in (1, 2, 3):
        compiled_step = gradcache(compiled, images, texts, seed)
        if seed == 1:
            graphs = counters["stats"]["unique_graphs"]
    assert counters["stats"]["unique_graphs"] == graphs, "a later step compiled new graphs"
    if dropout == 0.0:
        assert relative_error(compiled_step, gradcache(eager, images, texts, 3)) < 2e-2  # bf16, other kernels
    assert relative_error(compiled_step, chunk_by_chunk(compiled, images, texts, 3)) < 2e-2


def test_blocks_replayed_as_cuda_graphs_accumulate_every_chunks_gradient(tmp_path):
    """model.cuda_graphs: each block's forward and backward replayed as CUDA graphs. The gradients
    of a block come out in the graphs' memory, which the next chunk's replay overwrites: kept
    allocated and zeroed in place (TrainStep(cuda_graphs=True)), every chunk adds into memory of
    its own. Set them to None before a step instead, and the first chunk's gradient is lost."""
    torch._dynamo.reset()
    eager = tiny_clip(0.0).cuda()
    graphed = copy.deepcopy(eager)
    compile_towers(graphed, tmp_path / "cache", cuda_graphs=True)
    generator = torch.Generator().manual_seed(0)
    images = torch.randn(100, 3, 32, 32, generator=generator).cuda()
    texts = torch.randint(1, 1000, (100, 16), generator=generator).cuda()
    for seed in (1, 2, 3, 4):  # warm-up, recording, then replays
        torch.manual_seed(seed)
        for parameter in graphed.parameters():
            parameter.grad = torch.zeros_like(parameter) if parameter.grad is None else parameter.grad.zero_()
        GradCache(graphed, build_loss("infcl"), CHUNK, autocast=torch.bfloat16, reuse_last_chunk=False)(images, texts)
        got = grads_of(graphed)
        assert relative_error(got, gradcache(eager, images, texts, seed)) < 2e-2, f"step with seed {seed}"
