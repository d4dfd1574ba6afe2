"""Write synthetic image-caption webdataset shards, for throughput and scale runs without real data.

    python scripts/make_synthetic_shards.py --out data/synthetic --shards 8 --per-shard 512 --size 224
    python train.py --config configs/vit_b16_infcl.yaml data.kind=webdataset \
        "data.train_shards=data/synthetic/synthetic-{0000..0007}.tar"

Each sample is a JPEG of a random colour with noise and the caption "a photo of <colour name>",
so a model can learn something, but nothing here is meant as a benchmark of accuracy.
"""

from __future__ import annotations

import argparse
import io
import random
from concurrent.futures import ProcessPoolExecutor
from functools import partial
from pathlib import Path

import numpy as np
import webdataset as wds
from PIL import Image

COLOURS = {
    "red": (220, 40, 40), "green": (40, 180, 60), "blue": (40, 70, 220), "yellow": (230, 210, 40),
    "purple": (140, 50, 170), "orange": (240, 140, 30), "black": (20, 20, 20), "white": (235, 235, 235),
}


def synthetic_jpeg(colour: tuple, size: int, rng: np.random.Generator) -> bytes:
    pixels = np.clip(np.array(colour) + rng.normal(0, 40, (size, size, 3)), 0, 255).astype(np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="JPEG", quality=85)
    return buffer.getvalue()


def write_shard(shard: int, out: Path, per_shard: int, size: int, seed: int) -> None:
    """One shard, from a generator of its own: shards can be written in parallel and stay the same."""
    rng, pick = np.random.default_rng([seed, shard]), random.Random(f"{seed}/{shard}")
    names = list(COLOURS)
    with wds.TarWriter(str(out / f"synthetic-{shard:04d}.tar")) as sink:
        for i in range(shard * per_shard, (shard + 1) * per_shard):
            name = pick.choice(names)
            sink.write({"__key__": f"sample{i:08d}", "jpg": synthetic_jpeg(COLOURS[name], size, rng),
                        "txt": f"a photo of {name}", "cls": names.index(name)})


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--shards", type=int, default=8)
    parser.add_argument("--per-shard", type=int, default=512)
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--processes", type=int, default=1, help="shards written in parallel")
    args = parser.parse_args(argv)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write = partial(write_shard, out=out, per_shard=args.per_shard, size=args.size, seed=args.seed)
    with ProcessPoolExecutor(args.processes) as pool:
        list(pool.map(write, range(args.shards)))
    print(f"wrote {args.shards} shards of {args.per_shard} samples to {out}/synthetic-{{0000..{args.shards - 1:04d}}}.tar")


if __name__ == "__main__":
    main()
