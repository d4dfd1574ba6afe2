"""`train.chunk_size: auto` on a real model: the chunk the probe picks for ViT-B-32 (built from
its open_clip config, nothing downloaded) runs a real bf16 Gradient Cache step, its pass-1
image chunks kept on the device for pass 2 as the trainer keeps them, whose peak stays under
the probe's budget and fills most of it (the chunk is not needlessly small).

The probe may use `memory.HEADROOM` of the device; here that share is scaled to 20 GiB, so
that a batch of 3,840 is many chunks on any GPU and the test stays quick. The arithmetic is
the same at any budget (tests/test_memory.py holds it to fixed figures).
"""

from __future__ import annotations

import pytest
import torch

from clipscale import memory
from clipscale.config import ModelConfig, OptimConfig
from clipscale.data.chunks import ChunkSource, KeepBudget
from clipscale.data.transforms import SplitTransform
from clipscale.losses import build_loss
from clipscale.models import build_model
from clipscale.optim import build_optimizer
from clipscale.step import TrainStep

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300)]

BUDGET = 20 * 2**30
BATCH = 3840  # 2^8 * 3 * 5: divisors close together, so the chunk is near what fits


def test_the_auto_chunk_runs_a_real_step_under_the_probes_budget(monkeypatch):
    device = torch.device("cuda")
    monkeypatch.setattr(memory, "HEADROOM", BUDGET / torch.cuda.get_device_properties(device).total_memory)
    towers = build_model(ModelConfig(name="ViT-B-32"))
    model = towers.model.to(device)
    loss_fn = build_loss("infcl")
    optimizer = build_optimizer(model, OptimConfig(), fused=True)
    pixels = torch.randint(0, 256, (BATCH, 3, 224, 224), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    kept = pixels.nbytes  # room for every pass-1 chunk of images to stay on the device for pass 2, as the trainer's
    chunk, figures = memory.largest_chunk(model, loss_fn, batch_size=BATCH, precision_dtype=torch.bfloat16,
                                          image_size=224, context_length=model.context_length,
                                          vocab_size=model.vocab_size, reserved=kept)
    capacity = figures["usable_gib"] * 2**30
    assert capacity == pytest.approx(BUDGET)
    assert figures["fits"] < BATCH, f"the whole batch fits: nothing is tested ({figures})"

    step = TrainStep(model, loss_fn, optimizer, chunk_size=chunk, precision="bf16")
    images = ChunkSource.of_tensor(pixels, SplitTransform.split(towers.train_transform).to_float, budget=KeepBudget(kept))
    texts = ChunkSource.of_tensor(torch.randint(1, model.vocab_size, (BATCH, model.context_length)))
    torch.cuda.reset_peak_memory_stats(device)
    for _ in range(2):  # the first step creates AdamW's moments, which the probe counted from the start
        assert step(images, texts, lr=1e-5).applied
    peak = torch.cuda.max_memory_allocated(device)
    shown = f"chunk {chunk}: peak {peak / 2**30:.2f} GiB of {capacity / 2**30:.2f} ({figures})"
    assert peak <= capacity, shown
    assert peak >= capacity / 2, shown
    print(shown)
