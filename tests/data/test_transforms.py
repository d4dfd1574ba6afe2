"""The loader's crop draw (`SplitTransform.draw`) against torchvision's `RandomResizedCrop.get_params`,
which it calls except where no try can fit (`transforms.no_try_fits`: it then returns the central
crop itself, without the ten tries' scalar torch calls).

Every image size from 1 x 1 to the aspects around the boundary where a try stops fitting, under
several per-sample seeds, for open_clip's training crop (scale 0.9 to 1: the boundary near aspect
1.48) and torchvision's default (scale 0.08 to 1: every size fits), as a loader worker draws them:
the global generator seeded for the sample, from a JPEG header's size or a decoded image.
"""

from __future__ import annotations

import pytest
import torch
import torchvision.transforms as T
from PIL import Image

from clipscale.data.decoders import size_only
from clipscale.data.transforms import SplitTransform, no_try_fits

SIZES = ([(1, 1), (1, 7), (7, 1), (2, 3), (3, 2), (5, 9), (9, 5)]
         + [(h, w) for h in (31, 64, 256) for w in range(h, 2 * h + 1, max(1, h // 64))]  # aspects 1 to 2, landscape
         + [(w, h) for h in (31, 64, 256) for w in range(h, 2 * h + 1, max(1, h // 64))])  # and portrait
SEEDS = range(6)


def _transform(scale: tuple[float, float]) -> SplitTransform:
    return SplitTransform.split(T.Compose([T.RandomResizedCrop(224, scale=scale), T.ToTensor()]))


def _torchvisions(height: int, width: int, crop: T.RandomResizedCrop, seed: int) -> tuple:
    torch.random.default_generator.manual_seed(seed)
    return tuple(crop.get_params(size_only(height, width), crop.scale, crop.ratio))


@pytest.mark.parametrize("scale", [(0.9, 1.0), (0.08, 1.0)], ids=["open_clip", "torchvision"])
def test_the_drawn_crop_is_torchvisions_for_every_size_and_seed(scale):
    split = _transform(scale)
    crop = split.only_random_resized_crop()
    skipped = 0
    with torch.random.fork_rng(devices=[]):
        for height, width in SIZES:
            skipped += no_try_fits(height, width, crop.scale, crop.ratio)
            for seed in SEEDS:
                expected = _torchvisions(height, width, crop, seed)
                torch.random.default_generator.manual_seed(seed)
                assert split.draw(size_only(height, width)) == expected, (height, width, seed)
    if scale == (0.9, 1.0):  # the draws above compared both ways of drawing, not one way twice
        assert 0.2 * len(SIZES) < skipped < 0.8 * len(SIZES), skipped
    else:
        assert skipped == 0


def test_a_decoded_image_draws_the_crop_its_header_draws():
    split = _transform((0.9, 1.0))
    with torch.random.fork_rng(devices=[]):
        for height, width in [(256, 455), (256, 300), (400, 256)]:
            torch.random.default_generator.manual_seed(3)
            from_header = split.draw(size_only(height, width))
            torch.random.default_generator.manual_seed(3)
            assert split.draw(Image.new("RGB", (width, height))) == from_header


def test_a_try_that_fits_only_by_rounding_is_not_skipped():
    """An image where only a try whose sides round down to the image's can fit: the check must
    leave it to torchvision's tries."""
    crop = _transform((1.0, 1.0)).only_random_resized_crop()
    # scale 1: a try fits only where both sides round to the image's: a = width / height to
    # within half a pixel, which ratio (0.75, 1.333) holds for a 100 x 133 image (1.33 < 1.3333)
    assert not no_try_fits(100, 133, crop.scale, crop.ratio)
    assert no_try_fits(100, 135, crop.scale, crop.ratio)  # 1.35: beyond the widest aspect, whatever rounds


@pytest.mark.parametrize("scale", [(0.9, 1.0), (0.08, 1.0), (1.0, 1.0)], ids=["open_clip", "torchvision", "whole"])
def test_no_try_fits_only_where_no_draw_of_scale_and_aspect_fits(scale):
    """Against get_params' own test of a try, over a grid of its two draws that includes their
    ranges' ends: wherever the check skips the tries, no draw would have fit."""
    ratio = (3 / 4, 4 / 3)
    shares = torch.linspace(*scale, 41, dtype=torch.float64).tolist()
    aspects = torch.linspace(*torch.log(torch.tensor(ratio, dtype=torch.float64)), 81).exp().tolist()
    for height, width in SIZES:
        if not no_try_fits(height, width, scale, ratio):
            continue
        area = height * width
        for share in shares:
            for aspect in aspects:
                w, h = round((area * share * aspect) ** 0.5), round((area * share / aspect) ** 0.5)
                assert not (0 < w <= width and 0 < h <= height), (height, width, share, aspect)


def test_a_scale_from_zero_draws_torchvisions_crop_and_a_reversed_one_fails_as_torchvisions():
    with torch.random.fork_rng(devices=[]):
        split = _transform((0.0, 1.0))
        crop = split.only_random_resized_crop()
        for height, width in [(256, 455), (1, 9)]:
            torch.random.default_generator.manual_seed(5)
            assert split.draw(size_only(height, width)) == _torchvisions(height, width, crop, 5)
        reversed_scale = _transform((1.0, 0.9))
        crop = reversed_scale.only_random_resized_crop()
        with pytest.raises(RuntimeError) as torchvisions:
            _torchvisions(256, 455, crop, 0)
        with pytest.raises(RuntimeError) as ours:
            reversed_scale.draw(size_only(256, 455))
        assert str(ours.value) == str(torchvisions.value)
