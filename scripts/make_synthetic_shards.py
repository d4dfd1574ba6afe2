"""Write synthetic image-caption webdataset shards, for throughput and scale runs without real data.

    python scripts/make_synthetic_shards.py --out data/synthetic --shards 8 --per-shard 512 --size 224
    python train.py --config configs/vit_b16_infcl.yaml data.kind=webdataset \
        "data.train_shards=data/synthetic/synthetic-{0000..0007}.tar"

Each sample is a JPEG of a random colour and a caption naming the colour, so a model can learn
something, but nothing here is meant as a benchmark of accuracy. The images:

  --images noise    a square of --size pixels, the colour with strong noise, quality 85 (the default)
  --images web      as img2dataset writes web images (resize_mode keep_ratio, quality 90): a short
                    side of 256, aspect ratios from 3:4 to 16:9, photo-like content (smooth shading,
                    a few shapes, mild grain: ~26 KiB a JPEG), 2% progressive and 1% grayscale JPEGs.
                    What a speed measurement should decode; --size is ignored

The captions:

  --captions short  "a photo of <colour>": 6 tokens with SOT and EOT (the default, as before)
  --captions web    <colour> and filler words, as long as web alt-text (WEB_* below): the text
                    tower's work per sample is then that of real data, for speed measurements

Every shard draws its images and its captions from generators of its own (seed, shard): a shard
is the same whichever process writes it, and the images are the same under either caption kind.
"""

from __future__ import annotations

import argparse
import io
import math
import random
from concurrent.futures import ProcessPoolExecutor
from functools import partial
from pathlib import Path

import numpy as np
import webdataset as wds
from PIL import Image, ImageDraw

COLOURS = {
    "red": (220, 40, 40), "green": (40, 180, 60), "blue": (40, 70, 220), "yellow": (230, 210, 40),
    "purple": (140, 50, 170), "orange": (240, 140, 30), "black": (20, 20, 20), "white": (235, 235, 235),
}

# Web alt-text lengths. CC12M (Changpinyo et al. 2021, "Conceptual 12M") keeps raw alt-text of 3 to
# 256 words (its dataset card says so); its Table 1 gives 20.2 +- 16.3 tokens a caption, median 16,
# against 10.3 for CC3M's cleaned captions (Sharma et al. 2018). Those three figures were written
# from memory of the paper, not checked against it here: check them before quoting them. A log-normal of that mean and spread (sigma = 0.70, median
# 15.6 words) matches CC12M's median too, and puts 1.3% of captions at 75 words or more, the most
# that fit CLIP's 77 positions beside SOT and EOT. LAION keeps alt-texts of any length from 5
# characters on (Schuhmann et al. 2021/2022), keyword lists included, so a further WEB_OVER_LIMIT
# of captions are such lists of 80-150 words, cut at 77 tokens by the tokenizer: that share is our
# assumption, not a published figure. Every word below is one token of CLIP's BPE tokenizer
# (tests/scripts/test_make_synthetic_shards.py), and none names a colour, so a caption of n words takes n + 2
# positions and names its image's colour only.
WEB_MEAN_WORDS, WEB_SD_WORDS = 20.2, 16.3
WEB_SIGMA = math.sqrt(math.log(1 + (WEB_SD_WORDS / WEB_MEAN_WORDS) ** 2))
WEB_MU = math.log(WEB_MEAN_WORDS) - WEB_SIGMA**2 / 2
WEB_OVER_LIMIT, WEB_LIST_WORDS = 0.03, (80, 150)
FILLER_WORDS = (
    "a art background bag beach best cake canvas car cat chairs city decor design dog download dress "
    "fashion flowers for forest free garden high home ideas image in interior kitchen lake leather lights living "
    "men modern mountain new night old on online over painting pattern photo poster price print quality room "
    "sale sea shoes shop sky small stock street summer sunset table texture the vintage wall wedding with "
    "women wooden"
).split()


def synthetic_jpeg(colour: tuple, size: int, rng: np.random.Generator) -> bytes:
    pixels = np.clip(np.array(colour) + rng.normal(0, 40, (size, size, 3)), 0, 255).astype(np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="JPEG", quality=85)
    return buffer.getvalue()


WEB_SHORT_SIDE, WEB_QUALITY = 256, 90
WEB_ASPECTS = (1.0, 4 / 3, 3 / 2, 16 / 9)  # long side / short side, drawn in either orientation
WEB_PROGRESSIVE, WEB_GRAYSCALE = 0.02, 0.01  # shares of the JPEGs


def web_jpeg(colour: tuple, size: int, rng: np.random.Generator) -> bytes:
    """A photo-like JPEG as img2dataset keeps one: smooth shading around `colour`, a few shapes,
    grain; a short side of 256 at an aspect drawn from WEB_ASPECTS, either orientation; a few
    progressive or grayscale (`size` is not used: the short side is fixed)."""
    aspect = WEB_ASPECTS[rng.integers(len(WEB_ASPECTS))]
    width, height = round(WEB_SHORT_SIDE * aspect), WEB_SHORT_SIDE
    if rng.random() < 0.5:
        width, height = height, width
    coarse = np.clip(np.array(colour) + rng.normal(0, 45, (12, 16, 3)), 0, 255).astype(np.uint8)
    image = Image.fromarray(coarse).resize((width, height), Image.BICUBIC)
    draw = ImageDraw.Draw(image)
    for _ in range(rng.integers(3, 9)):
        x, y = rng.integers(0, width), rng.integers(0, height)
        rx, ry = rng.integers(10, width // 3), rng.integers(10, height // 3)
        fill = tuple(int(v) for v in np.clip(np.array(colour) + rng.normal(0, 60, 3), 0, 255))
        (draw.ellipse if rng.random() < 0.5 else draw.rectangle)((x - rx, y - ry, x + rx, y + ry), fill=fill)
    pixels = np.asarray(image, dtype=np.float32) + rng.normal(0, 7, (height, width, 3))
    image = Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8))
    kind = rng.random()
    if kind < WEB_GRAYSCALE:
        image = image.convert("L")
    buffer = io.BytesIO()
    image.save(buffer, format="JPEG", quality=WEB_QUALITY, progressive=bool(WEB_GRAYSCALE <= kind < WEB_GRAYSCALE + WEB_PROGRESSIVE))
    return buffer.getvalue()


IMAGES = {"noise": synthetic_jpeg, "web": web_jpeg}


def short_caption(colour: str, pick: random.Random) -> str:
    return f"a photo of {colour}"


def web_caption(colour: str, pick: random.Random) -> str:
    """The colour, then filler words up to a length drawn as web alt-text's (WEB_* above)."""
    if pick.random() < WEB_OVER_LIMIT:
        words = pick.randint(*WEB_LIST_WORDS)
    else:
        words = max(1, round(pick.lognormvariate(WEB_MU, WEB_SIGMA)))
    return " ".join([colour, *pick.choices(FILLER_WORDS, k=words - 1)])


CAPTIONS = {"short": short_caption, "web": web_caption}


def write_shard(shard: int, out: Path, per_shard: int, size: int, seed: int, captions: str = "short",
                images: str = "noise") -> None:
    """One shard, from generators of its own: shards can be written in parallel and stay the same."""
    rng, pick = np.random.default_rng([seed, shard]), random.Random(f"{seed}/{shard}")
    caption, words = CAPTIONS[captions], random.Random(f"{seed}/{shard}/captions")
    names = list(COLOURS)
    with wds.TarWriter(str(out / f"synthetic-{shard:04d}.tar")) as sink:
        for i in range(shard * per_shard, (shard + 1) * per_shard):
            name = pick.choice(names)
            sink.write({"__key__": f"sample{i:08d}", "jpg": IMAGES[images](COLOURS[name], size, rng),
                        "txt": caption(name, words), "cls": names.index(name)})


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--shards", type=int, default=8)
    parser.add_argument("--per-shard", type=int, default=512)
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--processes", type=int, default=1, help="shards written in parallel")
    parser.add_argument("--captions", choices=sorted(CAPTIONS), default="short",
                        help="short: 'a photo of <colour>'; web: lengths of web alt-text (see above)")
    parser.add_argument("--images", choices=sorted(IMAGES), default="noise",
                        help="noise: --size squares of noise; web: as img2dataset writes web images (see above)")
    args = parser.parse_args(argv)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write = partial(write_shard, out=out, per_shard=args.per_shard, size=args.size, seed=args.seed, captions=args.captions,
                    images=args.images)
    with ProcessPoolExecutor(args.processes) as pool:
        list(pool.map(write, range(args.shards)))
    print(f"wrote {args.shards} shards of {args.per_shard} samples to {out}/synthetic-{{0000..{args.shards - 1:04d}}}.tar")


if __name__ == "__main__":
    main()
