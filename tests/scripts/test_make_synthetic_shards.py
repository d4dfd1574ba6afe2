"""scripts/make_synthetic_shards.py: web-length captions as its docstring states them, the short
ones as before, and every shard the same whichever process writes it."""

from __future__ import annotations

import sys
import tarfile

import numpy as np
import open_clip
import pytest

from tests.helpers.tiny_runs import REPO

sys.path.insert(0, str(REPO / "scripts"))
import make_synthetic_shards as shards  # noqa: E402

CONTEXT = 77


def members(path) -> dict[str, bytes]:
    with tarfile.open(path) as tar:
        return {member.name: tar.extractfile(member).read() for member in tar if member.isfile()}


def captions(path) -> list[str]:
    return [data.decode() for name, data in sorted(members(path).items()) if name.endswith(".txt")]


@pytest.fixture(scope="module")
def web_shards(module_tmp):
    out = module_tmp("web")
    shards.main(["--out", str(out), "--shards", "2", "--per-shard", "2000", "--size", "8", "--captions", "web"])
    return out


def test_every_filler_word_is_one_clip_token_and_names_no_colour():
    tokenizer = open_clip.get_tokenizer("ViT-B-32")
    positions = (tokenizer(shards.FILLER_WORDS) != 0).sum(dim=1)
    assert positions.tolist() == [3] * len(shards.FILLER_WORDS)  # SOT, the word, EOT
    assert not set(shards.FILLER_WORDS) & set(shards.COLOURS)


def test_web_caption_lengths_follow_the_stated_distribution(web_shards):
    texts = captions(web_shards / "synthetic-0000.tar") + captions(web_shards / "synthetic-0001.tar")
    lengths = (open_clip.get_tokenizer("ViT-B-32")(texts) != 0).sum(dim=1).numpy()  # positions, SOT and EOT included
    words = np.array([len(text.split()) for text in texts])
    assert (lengths == np.minimum(words + 2, CONTEXT)).all()
    below = words[words < shards.WEB_LIST_WORDS[0]]
    assert 15 <= np.median(below) <= 17  # CC12M's median of 16 words
    assert 18 <= below.mean() <= 22.5  # and its mean of 20.2
    at_limit = (lengths == CONTEXT).mean()
    assert 0.03 <= at_limit <= 0.06  # 1.3% of the log-normal + WEB_OVER_LIMIT of keyword lists
    assert (lengths <= 16).mean() > 0.4 and lengths.min() >= 3


def test_every_caption_names_its_images_colour_first(web_shards):
    files = members(web_shards / "synthetic-0000.tar")
    for name, data in list(files.items())[:300]:
        if name.endswith(".txt"):
            label = int(files[name.replace(".txt", ".cls")])
            assert data.decode().split()[0] == list(shards.COLOURS)[label]


def test_a_shard_is_the_same_written_alone_and_the_images_under_either_caption_kind(web_shards, tmp_path):
    shards.write_shard(1, tmp_path, per_shard=2000, size=8, seed=0, captions="web")
    alone, together = members(tmp_path / "synthetic-0001.tar"), members(web_shards / "synthetic-0001.tar")
    assert alone == together
    (tmp_path / "short").mkdir()
    shards.write_shard(1, tmp_path / "short", per_shard=2000, size=8, seed=0)
    short = members(tmp_path / "short" / "synthetic-0001.tar")
    assert {k: v for k, v in short.items() if not k.endswith(".txt")} == \
        {k: v for k, v in together.items() if not k.endswith(".txt")}
    assert {data.decode() for name, data in short.items() if name.endswith(".txt")} <= \
        {f"a photo of {colour}" for colour in shards.COLOURS}


def test_web_images_are_as_img2dataset_writes_them(module_tmp):
    """--images web: a short side of 256, aspects from 3:4 to 16:9 in both orientations, ~26 KiB
    JPEGs, a few progressive and grayscale ones; the same bytes from the same seed."""
    import io

    from PIL import Image

    out = module_tmp("web-images")
    shards.main(["--out", str(out), "--shards", "1", "--per-shard", "400", "--images", "web"])
    jpegs = [data for name, data in sorted(members(out / "synthetic-0000.tar").items()) if name.endswith(".jpg")]
    images = [Image.open(io.BytesIO(data)) for data in jpegs]
    assert all(min(image.size) == shards.WEB_SHORT_SIDE for image in images)
    ratios = {round(max(image.size) / min(image.size), 2) for image in images}
    assert ratios == {round(round(shards.WEB_SHORT_SIDE * a) / shards.WEB_SHORT_SIDE, 2) for a in shards.WEB_ASPECTS}
    assert any(image.width > image.height for image in images) and any(image.width < image.height for image in images)
    assert 20_000 <= np.mean([len(data) for data in jpegs]) <= 32_000
    grayscale = sum(image.mode == "L" for image in images)
    progressive = sum(bool(image.info.get("progressive")) for image in images)
    assert 1 <= grayscale <= 12 and 2 <= progressive <= 20
    again = shards.web_jpeg((1, 2, 3), 0, np.random.default_rng(5)), shards.web_jpeg((1, 2, 3), 0, np.random.default_rng(5))
    assert again[0] == again[1]
