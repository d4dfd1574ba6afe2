"""Where `data.decoder: device` spends its time: one Gradient Cache chunk of 224-px JPEGs
decoded on the GPU by the trainer's own code (`decode_parts`, `DeviceDecoder`), in the calling
thread or in the decoder's thread, alone or beside a training thread that runs the model's
forward and backward passes on other chunks; and, for comparison, with each crop resized image
by image as the decoder did before `crop_resize` (the JSON records how far apart the pixels are).

A component benchmark: the JPEG bytes are already in memory, so it explains what
`scripts/bench_e2e.py` measures through train.py; it does not replace it.

    python scripts/bench_device_decode.py --model ViT-B-32 --out results/bench_device_decode_h100.json
"""

from __future__ import annotations

import argparse
import io
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]
from make_synthetic_shards import COLOURS, synthetic_jpeg  # noqa: E402

from clipscale.config import ModelConfig  # noqa: E402
from clipscale.data.chunks import Arrivals  # noqa: E402
from clipscale.data.device_decode import DeviceDecoder, decode_parts  # noqa: E402
from clipscale.data.encoded import EncodedBatch, EncodedImages  # noqa: E402
from clipscale.data.transforms import SplitTransform  # noqa: E402
from clipscale.models import build_model  # noqa: E402
from clipscale.provenance import provenance  # noqa: E402


def chunk_of_pieces(split: SplitTransform, chunk: int, piece: int, size: int) -> list[tuple[EncodedImages, int, int]]:
    """`chunk` JPEGs as the loader hands them over: pieces of `piece` samples, each with its drawn crops."""
    rng = np.random.default_rng(0)
    colours = list(COLOURS.values())
    parts = []
    for first in range(0, chunk, piece):
        blobs = [synthetic_jpeg(colours[i % len(colours)], size, rng) for i in range(first, min(first + piece, chunk))]
        params = [split.draw(Image.open(io.BytesIO(blob))) for blob in blobs]
        parts.append((EncodedImages.from_samples(tuple(blobs), tuple(params)), 0, len(blobs)))
    return parts


def timed(run, repeats: int) -> float:
    """Median seconds of `run()` (which ends with the GPU idle), after one warm-up."""
    run()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="ViT-B-32")
    parser.add_argument("--chunk", type=int, default=512)
    parser.add_argument("--piece", type=int, default=64)
    parser.add_argument("--size", type=int, default=224, help="side of the synthetic JPEGs")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    device = torch.device("cuda")

    towers = build_model(ModelConfig(name=args.model))
    split = SplitTransform.split(towers.train_transform)
    parts = chunk_of_pieces(split, args.chunk, args.piece, args.size)
    model = towers.model.to(device)
    texts = torch.randint(0, towers.model.vocab_size, (args.chunk, towers.model.context_length), device=device)

    def decode_inline():
        pixels = decode_parts(split, parts, device)
        torch.cuda.synchronize()
        return pixels

    decoder = DeviceDecoder(split, device)
    encoded, arrived = EncodedBatch(), Arrivals()  # the chunk as a batch of pieces, all arrived
    for first, (piece, _, _) in zip(range(0, args.chunk, args.piece), parts):
        encoded.add(first, piece)
    arrived.add(args.chunk)

    def decode_in_thread():
        pixels = decoder.submit(encoded, arrived, 0, args.chunk).on_device(device, None)
        torch.cuda.synchronize()
        return pixels

    images = split.to_float(decode_inline())

    # The same chunk with each crop resized by torchvision image by image (the decoder before
    # crop_resize): how far apart the two are, and what the batched pass saves.
    batched_pixels = decode_inline()
    one_by_one_split = SplitTransform(split.pil_steps, split.normalize)
    one_by_one_split.only_random_resized_crop = lambda: None
    one_by_one_pixels = decode_parts(one_by_one_split, parts, device)
    difference = (batched_pixels.int() - one_by_one_pixels.int()).abs()
    agreement = {"max_abs_difference": int(difference.max()), "fraction_equal": float((difference == 0).float().mean())}
    print(f"batched against image-by-image resize: {agreement}", flush=True)

    def decode_one_by_one():
        pixels = decode_parts(one_by_one_split, parts, device)
        torch.cuda.synchronize()
        return pixels

    def train_chunk():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = (model.encode_image(images).float() * model.encode_text(texts).float()).sum()
        loss.backward()

    def train_only():
        train_chunk()
        torch.cuda.synchronize()

    def inline_then_train():  # the decode before the thread: in the training thread, then the passes
        split.to_float(decode_parts(split, parts, device))
        train_chunk()
        torch.cuda.synchronize()

    def thread_beside_train():  # today's trainer: the next chunk decodes while this one trains
        decoding = decoder.submit(encoded, arrived, 0, args.chunk)
        train_chunk()
        split.to_float(decoding.on_device(device, None))
        torch.cuda.synchronize()

    cases = {"decode, calling thread": decode_inline,
             "decode, calling thread, image-by-image resize (before crop_resize)": decode_one_by_one,
             "decode, DeviceDecoder thread": decode_in_thread,
             "forward+backward only": train_only, "decode then forward+backward, one thread": inline_then_train,
             "decode in DeviceDecoder thread beside forward+backward": thread_beside_train}
    rows = []
    for name, run in cases.items():
        seconds = timed(run, args.repeats)
        rows.append({"case": name, "ms_per_chunk": 1000 * seconds, "ms_per_image": 1000 * seconds / args.chunk})
        print(f"{name}: {1000 * seconds:.1f} ms per chunk of {args.chunk}", flush=True)
    decoder.close()
    record = {**provenance(argv),
              "model": args.model, "chunk": args.chunk, "piece": args.piece, "image_size": args.size,
              "batched_against_image_by_image_resize": agreement, "rows": rows}
    Path(args.out).write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
