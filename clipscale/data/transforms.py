"""What the loader's workers make of a sample: its image through the training transform, split where
the bytes are smallest, and its caption's token ids.

**The image: uint8 pixels on the host, floats on the device.** open_clip's training transform is PIL
steps (random resized crop, RGB), then `ToTensor` and `Normalize`. Run whole in a loader worker, it
hands the trainer float32 pixels: four times the bytes of uint8, in shared memory, in the pinned
batch and on the bus. So the loader runs the PIL steps and stops at uint8; `to_float` runs ToTensor
and Normalize on the device, after the copy, with the same operations (bit for bit equal on a CPU).

The random draw is separate from applying it (`draw`, then `apply`) so that an offloaded batch can
keep each image's encoded bytes and the crop it drew, and decode it again later as a pure function
of the sample (`decode`), in any process.

**The caption: token ids in one native call a piece** (open_clip's CLIP tokenizer, by
`instant-clip-tokenizer`). open_clip's `SimpleTokenizer` is pure Python, 70-90 us a caption: a fifth
of a loader worker's time per sample. `instant-clip-tokenizer` (Rust) holds the same vocabulary and
merges and gives a piece's ids in one call, about 4 us a caption. It lower-cases but does not clean:
open_clip first applies ftfy's fixes and unescapes HTML entities twice. On printable ASCII without
`&` that cleaning changes only whitespace, which the word pattern skips anyway, so only the other
captions (non-ASCII, entities, control characters) are cleaned in Python, by open_clip's own
function. A caption naming a special token (`<end_of_text>`) goes to open_clip itself.
tests/data/test_captions.py compares every id with open_clip's on thousands of varied captions.

    tokenize = CaptionTokenizer.of(open_clip.get_tokenizer("ViT-B-32"))   # or that tokenizer itself
    tokens = tokenize(captions)    # int64 [n, context_length], as open_clip's
"""

from __future__ import annotations

import io
import re
from typing import Callable, Optional

import simplejpeg
import torch
import torchvision.transforms as T
import torchvision.transforms.functional as TF
from open_clip.tokenizer import SimpleTokenizer, _clean_lower
from PIL import Image

REGION_LIMIT = 4  # crop_region: the most pixels a worker hands over unresized, in outputs' worth


def uint8_image_bytes(height: int, width: int) -> int:
    """An RGB image of height x width as the host and the device hold it before it is made float."""
    return 3 * height * width


def no_try_fits(height: int, width: int, scale, ratio) -> bool:
    """Whether none of `RandomResizedCrop.get_params`'s ten tries can fit the image, whatever it
    draws: it then returns its central crop, having spent ~20 us of scalar torch calls a try.

    A try draws a share s of the area in `scale` and an aspect a in `ratio` (float32, exp of a
    log-uniform draw) and fits where round(sqrt(s A a)) <= width and round(sqrt(s A / a)) <= height.
    Both need s A a <= (width + 1/2)^2 and s A / a <= (height + 1/2)^2, easiest at the smallest s;
    so no a in `ratio` (widened by float32's rounding and more) meeting both means no try fits.
    With open_clip's scale (0.9, 1) that is every image of aspect beyond about 1.48 either way (3:2
    and 16:9 photos: half of make_synthetic_shards' img2dataset-like images), and the tries cost a
    loader worker a fifth of its time."""
    if not 0 < scale[0] <= scale[1] or not 0 < ratio[0] <= ratio[1]:
        return False  # tiny crops fit anything; ranges the wrong way round: get_params' own error
    smallest = height * width * scale[0] * (1 - 1e-6)
    widest = min(ratio[1] * (1 + 1e-5), (width + 0.5) ** 2 / smallest)
    narrowest = max(ratio[0] * (1 - 1e-5), smallest / (height + 0.5) ** 2)
    return narrowest > widest


def central_crop(height: int, width: int, ratio) -> tuple[int, int, int, int]:
    """`RandomResizedCrop.get_params`'s box where no try fits: the largest central crop within
    `ratio` (its own lines; tests/data/test_transforms.py holds them to torchvision's)."""
    in_ratio = float(width) / float(height)
    if in_ratio < min(ratio):
        w = width
        h = int(round(w / min(ratio)))
    elif in_ratio > max(ratio):
        h = height
        w = int(round(h * max(ratio)))
    else:
        w, h = width, height
    return (height - h) // 2, (width - w) // 2, h, w


class SplitTransform:
    """The PIL steps of an open_clip training or eval transform, and its float steps.

    `split` returns None for a transform it cannot split this way (colour jitter, flips,
    timm's pipelines); the caller then runs the whole transform in the loader (float32).

      draw(img)          the random parameters (the crop box) for one image (or its size), from
                         the global RNG: the box the whole transform would draw.
      apply(img, params) the PIL steps with those parameters -> uint8 [3, H, W].
      crop_region        the crop's region of a decoded image, unresized (the device resizes it).
      jpeg_region        the same from a JPEG's bytes, decoded by libjpeg-turbo without PIL.
      apply_to_tensor    `apply` on a decoded uint8 tensor (on the GPU).
      decode(sample)     (bytes, params) -> uint8 [3, H, W]: decode and apply; pure, no RNG.
      to_float(uint8 [n, 3, H, W]) -> what ToTensor and Normalize give, on the tensor's device.
    """

    def __init__(self, pil_steps: list, normalize: list):
        self.pil_steps = pil_steps
        self.normalize = normalize
        self._stats: dict = {}  # per device and dtype: the Normalize means and stds as [3, 1, 1] tensors, and the value table

    @classmethod
    def split(cls, transform: Callable) -> Optional["SplitTransform"]:
        from open_clip.transform import MaybeConvertMode

        steps = list(transform.transforms) if isinstance(transform, T.Compose) else [transform]
        cut = next((k for k, step in enumerate(steps) if isinstance(step, T.ToTensor)), None)
        if cut is None or not all(isinstance(step, T.Normalize) for step in steps[cut + 1 :]):
            return None
        random_steps, resized = 0, False
        for step in steps[:cut]:
            if isinstance(step, T.RandomResizedCrop):
                # The box is drawn from the decoded image's size: only before any resize, and once.
                if resized or random_steps:
                    return None
                random_steps += 1
            elif isinstance(step, (T.Resize, T.CenterCrop)):
                resized = True
            elif not isinstance(step, MaybeConvertMode):
                return None
        return cls(steps[:cut], steps[cut + 1 :])

    def draw(self, img: Image.Image) -> tuple:
        for step in self.pil_steps:
            if isinstance(step, T.RandomResizedCrop):
                _, height, width = TF.get_dimensions(img)
                if no_try_fits(height, width, step.scale, step.ratio):
                    return central_crop(height, width, step.ratio)
                return tuple(step.get_params(img, step.scale, step.ratio))
        return ()

    def apply(self, img: Image.Image, params: tuple) -> torch.Tensor:
        for step in self.pil_steps:
            if isinstance(step, T.RandomResizedCrop):
                img = TF.resized_crop(img, *params, step.size, step.interpolation, antialias=step.antialias)
            else:
                img = step(img)
        return TF.pil_to_tensor(img)

    def crop_region(self, img: Image.Image, params: tuple) -> torch.Tensor:
        """For the device decoder (`only_random_resized_crop`): the drawn crop's region of `img`,
        uint8 [3, h, w], not resized: the device resizes it with the JPEGs' crops, as `apply` would
        within rounding (the resize cost a worker more than the decode). A region of more
        than `REGION_LIMIT` times the output's pixels (a large photo) is resized here, so that a
        worker never hands over more than that."""
        if self.worker_resizes(params):
            return self.apply(img, params)
        top, left, height, width = params
        return TF.pil_to_tensor(img.crop((left, top, left + width, top + height)))

    def jpeg_region(self, data: bytes, params: tuple) -> Optional[torch.Tensor]:
        """`crop_region` of a JPEG the device would take (`decoders.device_decodes`), decoded by
        libjpeg-turbo through simplejpeg: the same pixels as PIL's decode (the same library and
        settings), at half its cost in a worker (PIL's decoder objects, its RGB conversion and a
        copy to a tensor came to as much as the decode). None where simplejpeg refuses the bytes
        (damaged entropy data: PIL judges those) or the region is one `crop_region` resizes."""
        if self.worker_resizes(params):
            return None
        try:
            rows = simplejpeg.decode_jpeg(data, colorspace="RGB")
        except ValueError:
            return None
        top, left, height, width = params
        return torch.from_numpy(rows[top : top + height, left : left + width]).permute(2, 0, 1)

    def worker_resizes(self, params: tuple) -> bool:
        """Whether a crop's region is more than `REGION_LIMIT` outputs' pixels: a worker then resizes
        it (PIL) rather than hand it over for the device to resize."""
        _, _, height, width = params
        out_h, out_w = self.only_random_resized_crop().size
        return height * width > REGION_LIMIT * out_h * out_w

    def apply_to_tensor(self, img: torch.Tensor, params: tuple) -> torch.Tensor:
        """`apply` on a decoded uint8 [3, H, W] tensor, on its device (the GPU decoder's path):
        the same crop, resized by torchvision's tensor kernels (within a grey level or two of PIL's)."""
        for step in self.pil_steps:
            if isinstance(step, T.RandomResizedCrop):
                img = TF.resized_crop(img, *params, step.size, step.interpolation, antialias=step.antialias)
            elif isinstance(step, (T.Resize, T.CenterCrop)):
                img = step(img)
            # MaybeConvertMode: the decoder already gave RGB
        return img

    def only_random_resized_crop(self) -> Optional[T.RandomResizedCrop]:
        """The RandomResizedCrop when it is all the PIL steps do (besides RGB conversion), with an
        antialiased bilinear or bicubic filter: what `crop_resize` runs for a whole chunk at once."""
        from open_clip.transform import MaybeConvertMode

        steps = [step for step in self.pil_steps if not isinstance(step, MaybeConvertMode)]
        if len(steps) == 1 and isinstance(steps[0], T.RandomResizedCrop) and steps[0].antialias is True \
                and steps[0].interpolation in (T.InterpolationMode.BILINEAR, T.InterpolationMode.BICUBIC):
            return steps[0]
        return None

    def decode(self, sample: tuple[bytes, tuple]) -> torch.Tensor:
        data, params = sample
        with Image.open(io.BytesIO(data)) as img:
            return self.apply(img.convert("RGB"), params)

    def to_float(self, pixels: torch.Tensor) -> torch.Tensor:
        if pixels.is_cuda and pixels.dim() == 4 and pixels.shape[1] == 3:
            from clipscale.data.crop_resize import normalized  # Triton: imported where it runs

            # One pass over the chunk instead of ToTensor and Normalize's kernels (about 4% of a
            # ViT-B/32 step): each of the 256 values of each channel as those kernels make it.
            return normalized(pixels, self._value_table(pixels.device))
        return self._eager_to_float(pixels)

    def _eager_to_float(self, pixels: torch.Tensor) -> torch.Tensor:
        images = pixels.to(torch.get_default_dtype()).div(255)  # ToTensor
        for mean, std in self._normalize_stats(images):  # Normalize, as F.normalize does it
            images = images.sub(mean).div(std)
        return images

    def _value_table(self, device: torch.device) -> torch.Tensor:
        """[3, 256] float: what ToTensor and Normalize make of each value of each channel on `device`."""
        key = (device, "table", torch.get_default_dtype())
        if key not in self._stats:
            values = torch.arange(256, device=device).to(torch.uint8).expand(1, 3, 1, 256)
            self._stats[key] = self._eager_to_float(values).reshape(3, 256).contiguous()
        return self._stats[key]

    def _normalize_stats(self, images: torch.Tensor) -> list:
        key = (images.device, images.dtype)
        if key not in self._stats:  # made once: a tensor built per chunk would be a synchronous copy each time
            self._stats[key] = [
                tuple(torch.as_tensor(v, dtype=images.dtype, device=images.device).view(-1, 1, 1) for v in (n.mean, n.std))
                for n in self.normalize
            ]
        return self._stats[key]

    def __getstate__(self) -> dict:  # loader workers get the steps, not device tensors
        return {**self.__dict__, "_stats": {}}


# --- captions --------------------------------------------------------------------------------------

# What open_clip's cleaning leaves as it is, but for whitespace runs and case (see the module doc).
PLAIN = re.compile(r"[\x20-\x25\x27-\x7e\t\n\r]*")
VOCABULARY = 49408  # open_clip's default byte-level BPE (bpe_simple_vocab_16e6), the one the native tokenizer holds


def native_tokenizer():
    import instant_clip_tokenizer

    return instant_clip_tokenizer.Tokenizer()


class CaptionTokenizer:
    """open_clip's `SimpleTokenizer(clean="lower")` ids for a list of captions, in one native call."""

    def __init__(self, tokenizer: SimpleTokenizer):
        self.slow, self.native = tokenizer, native_tokenizer()
        self.context_length = tokenizer.context_length
        self.specials = tuple(token for token, index in tokenizer.encoder.items() if index in tokenizer.all_special_ids)

    def __getstate__(self) -> dict:  # a loader worker started by spawn builds its own native tokenizer
        return {**self.__dict__, "native": None}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state, native=native_tokenizer())

    @classmethod
    def of(cls, tokenizer):
        """The native tokenizer for open_clip's default CLIP tokenizer; any other tokenizer as it is."""
        if (type(tokenizer) is not SimpleTokenizer or tokenizer.reduction_fn is not None
                or tokenizer.clean_fn is not _clean_lower or len(tokenizer.encoder) != VOCABULARY):
            return tokenizer
        return cls(tokenizer)

    def __call__(self, texts: str | list[str], context_length: int | None = None) -> torch.Tensor:
        texts = [texts] if isinstance(texts, str) else list(texts)
        context = context_length or self.context_length
        cleaned = [text if PLAIN.fullmatch(text) else _clean_lower(text) for text in texts]
        tokens = torch.from_numpy(self.native.tokenize_batch(cleaned, context).astype("int64"))
        by_open_clip = [k for k, text in enumerate(cleaned) if any(special in text.lower() for special in self.specials)]
        if by_open_clip:
            tokens[by_open_clip] = self.slow([texts[k] for k in by_open_clip], context_length=context)
        return tokens
