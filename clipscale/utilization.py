"""How busy the GPU is: model FLOPs per sample and model FLOPs utilisation (`mfu` in metrics.jsonl).

The towers' forward FLOPs are counted once, at start, by `torch.utils.flop_counter` on one
sample through the real model (whatever its architecture). A trained tower costs three
forwards a sample (forward, and a backward of twice that), a locked one a forward. That is
the model's arithmetic: Gradient Cache's extra forward is not counted, so `mfu` shows what
the re-encoding costs, as it shows any time the GPU waits. The peak is the device's dense
bf16 rate from its data sheet; on other devices `mfu` is not logged.
"""

from __future__ import annotations

import torch
from torch.utils.flop_counter import FlopCounterMode

from clipscale.caption_length import LengthSortedTexts, text_lengths_computed
from clipscale.gradcache import trainable_towers

# Dense bf16 tensor-core peaks (TFLOP/s), from the vendors' data sheets; the first match by name wins.
PEAK_BF16_TFLOPS = (("H100", 989.0), ("H200", 989.0), ("GH200", 989.0), ("B200", 2250.0), ("A100", 312.0),
                    ("L40S", 362.0), ("A10", 125.0))


def peak_bf16_flops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((tflops * 1e12 for key, tflops in PEAK_BF16_TFLOPS if key in name), None)


def forward_flops(model: torch.nn.Module, image_size: int, context_length: int, device: torch.device) -> tuple[int, int]:
    """FLOPs of one sample's forward through the image tower and through the text tower: counted
    on two samples (a BatchNorm needs more than one) in eval mode (no dropout: the run's RNG is
    not touched), halved; with autograd on, as in training (without it nn.MultiheadAttention
    takes a fused path whose FLOPs the counter does not see)."""
    image = torch.zeros(2, 3, image_size, image_size, device=device)
    text = torch.zeros(2, context_length, dtype=torch.long, device=device)
    counts, training = [], model.training
    model.eval()
    try:
        with torch.enable_grad():
            for encode, sample in ((model.encode_image, image), (model.encode_text, text)):
                with FlopCounterMode(display=False) as counter:
                    encode(sample)
                counts.append(counter.get_total_flops() // 2)
    finally:
        model.train(training)
    return counts[0], counts[1]


def train_flops_per_sample(model: torch.nn.Module, image_size: int, context_length: int, device: torch.device,
                           train_image: bool, train_text: bool) -> int:
    """Model FLOPs of one training sample: 3 forwards for a trained tower, 1 for a locked one."""
    image, text = forward_flops(model, image_size, context_length, device)
    return (3 if train_image else 1) * image + (3 if train_text else 1) * text


def train_flops_by_text_length(model: torch.nn.Module, image_size: int, text_order: LengthSortedTexts | None,
                               device: torch.device) -> dict[int, int]:
    """A training sample's model FLOPs at each text length the run computes (its text buckets, or
    the context length): what the metrics' mfu counts, and the least of them, what the data path's
    worker_decode_share=auto reads."""
    towers = trainable_towers(model)
    return {length: train_flops_per_sample(model, image_size, length, device, *towers)
            for length in text_lengths_computed(text_order, model.context_length)}
