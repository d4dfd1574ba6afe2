"""A validation set, as open_clip's `--val-data`: contrastive loss and image-text retrieval on held-out pairs.

`eval.val_data` names held-out shards (a brace pattern, several joined with "::") or a `.csv` /
`.tsv` table, read with the training data's keys (`data.image_key` / `data.caption_key`, or
`data.csv_*`) by the training reader (`clipscale.data.sources`, `load_sample`): every sample once,
in order, through the model's validation transform. Rank r encodes every world_size-th sample
from the r-th; the features are gathered back into dataset order, so the figures do not depend
on the number of ranks.

- `val_loss`: the configured loss (`loss.name`, `loss.options`) over consecutive batches of
  `eval.batch_size` pairs at the model's logit scale, averaged weighted by batch size, as
  open_clip's `evaluate` computes `clip_val_loss` (it always uses the CLIP loss; this the run's).
- `val_image_retrieval_recall@k`, `val_text_retrieval_recall@k` (k = 1, 5, 10): retrieval over
  the whole set, each image with its own caption (`clipscale.eval.retrieval`).
- `val_num_samples`, `val_num_skipped`: the pairs used, and those skipped as training skips them
  (an image that does not decode, a missing member, an empty caption); a line on stderr names the
  first few skipped and why.
"""

from __future__ import annotations

from itertools import islice
from pathlib import Path
from typing import Iterator

import torch
import torch.distributed as dist

from clipscale.config import Config
from clipscale.data import data_source
from clipscale.data.shards import ShardErrors, load_sample
from clipscale.data.sources import CSV_SUFFIXES, DATA_ERRORS, IMAGE_KEYS, TEXT_KEYS, decode_text, first_member, open_image
from clipscale.distributed import World, is_distributed
from clipscale.eval.datasets import Skipped, Skips, reason_of
from clipscale.eval.gather import concat_over_ranks, sum_over_ranks
from clipscale.eval.inference import Autocast, encode_images, encode_texts, evaluating, say_skipped
from clipscale.eval.retrieval import recall_metrics
from clipscale.losses import build_loss


class Validation:
    """Call it with the model (every rank together) for {"val_loss": ..., "val_<retrieval metric>": ...}."""

    def __init__(self, cfg: Config, towers, world: World, autocast: Autocast):
        val_data = cfg.eval.val_data
        self.source = data_source(cfg.data, val_data, "eval.val_data", csv=val_data.lower().endswith(CSV_SUFFIXES),
                                  sampling=False)
        self.transform, self.tokenizer = towers.val_transform, towers.tokenizer
        self.world, self.autocast, self.batch_size = world, autocast, cfg.eval.batch_size
        # The loss runs on the gathered features, whole on every rank: in a group of its own.
        group = dist.new_subgroups(group_size=1)[0] if is_distributed() else None
        self.loss_fn = build_loss(cfg.loss.name, **cfg.loss.options, **({"group": group} if group else {}))

    def __call__(self, model) -> dict:
        device = self.world.device
        images, texts, order = [], [], []
        self.skips = Skips()
        with evaluating(model) as inner:
            for batch in self._batches():
                indices, pixels, captions = zip(*batch)
                images.append(encode_images(inner, torch.stack(pixels), device, self.autocast))
                texts.append(encode_texts(inner, self.tokenizer, list(captions), device, self.autocast))
                order.append(torch.tensor(indices, device=device))
            if not order:  # this rank has no sample; it still joins the gathers, with none
                texts = [encode_texts(inner, self.tokenizer, [], device, self.autocast)]  # [0, embedding width]
                images, order = [texts[0].clone()], [torch.zeros(0, dtype=torch.long, device=device)]
            dataset_order = torch.argsort(concat_over_ranks(torch.cat(order)))
            image_features = concat_over_ranks(torch.cat(images))[dataset_order]
            text_features = concat_over_ranks(torch.cat(texts))[dataset_order]
            skipped = int(sum_over_ranks(torch.tensor([self.skips.count], device=device)))
            say_skipped("eval.val_data", self.skips, len(image_features) + skipped)
            if len(image_features) == 0:
                raise ValueError(f"eval.val_data: no usable sample in {self.source.shards[:3]}"
                                 + (f": {self.skips.summary()}" if self.skips.count else ""))
            scalars = [inner.logit_scale.exp()]
            if getattr(inner, "logit_bias", None) is not None:
                scalars.append(inner.logit_bias)
            total = image_features.new_zeros(())
            for start in range(0, len(image_features), self.batch_size):
                stop = start + self.batch_size
                loss = self.loss_fn(image_features[start:stop], text_features[start:stop], *scalars)
                total += loss.float() * len(image_features[start:stop])
        metrics = {"loss": (total / len(image_features)).item()}
        metrics.update(recall_metrics(image_features, text_features, torch.arange(len(text_features), device=device)))
        metrics.update(num_samples=len(image_features), num_skipped=skipped)
        return {f"val_{name}": value for name, value in metrics.items()}

    def _samples(self) -> Iterator[tuple[int, torch.Tensor, str]]:
        """(index in the set, pixels, caption) of this rank's usable samples."""
        errors = ShardErrors()
        samples = (sample for shard in self.source.shards for sample in self.source.read(shard, errors))
        for index, raw in islice(enumerate(samples), self.world.rank, None, self.world.world_size):
            loaded = load_sample(raw, self.transform, None, False)
            if loaded is None:
                self.skips.add([self._skipped(raw)])
            else:
                pixels, _, caption = loaded
                yield index, pixels, caption

    def _skipped(self, raw: dict) -> Skipped:
        """The skipped sample named as the user knows it: a table's image file (its row's `__key__` is
        the row's index in the source's rows), or a shard and key; and why."""
        rows = getattr(self.source, "rows", None)
        if raw.get("__url__") is None and rows is not None:
            path = rows[int(raw["__key__"])][0]
            if first_member(raw, IMAGE_KEYS) is None:
                return Skipped(path, "cannot read the file" + ("" if Path(path).exists() else ": no such file"))
            return Skipped(path, why_unusable(raw))
        return Skipped(f"{raw.get('__url__')}: sample {raw.get('__key__')}", why_unusable(raw))

    def _batches(self) -> Iterator[list]:
        samples = self._samples()
        while batch := list(islice(samples, self.batch_size)):
            yield batch


def why_unusable(raw: dict) -> str:
    """Why `load_sample` found a sample unusable (it says only that it is): what is missing, or the
    error its image or caption raises (asked again here, for the few samples skipped)."""
    image_key, text_key = first_member(raw, IMAGE_KEYS), first_member(raw, TEXT_KEYS)
    if image_key is None or text_key is None:
        return f"no {'image' if image_key is None else 'caption'} member"
    try:
        with open_image(raw[image_key]) as image:
            image.convert("RGB")
        if not decode_text(raw[text_key]):
            return "an empty caption"
    except DATA_ERRORS as err:
        return reason_of(err)
    return "unusable"
