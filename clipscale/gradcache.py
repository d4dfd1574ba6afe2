"""Gradient Cache (Gao et al. 2021): a contrastive step whose encoder memory depends on the chunk, not the batch.

`GradCache` encodes the batch chunk by chunk without a graph, takes the loss's gradient at the
features, and re-encodes each chunk under its saved RNG state to backpropagate it: the parameter
gradients of one forward and backward over the whole batch (docs/architecture.md, steps 4 to 6).
Its inputs are tensors or chunk sources (`clipscale.data.chunks.ChunkSource`); its model says
when the backwards reduce their gradients (`clipscale.parallel.ParallelModel`). Given a
`text_order` (`clipscale.caption_length.LengthSortedTexts`), it encodes the texts in chunks of
neighbouring caption lengths, each only as long as its longest caption, and puts their features
and gradients back in the pairs' order: the loss never sees the reordering.

    step = GradCache(model, loss_fn, chunk_size=512, autocast=torch.bfloat16)
    loss = step(images, texts)   # gradients accumulated into model parameters
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from itertools import repeat
from typing import TYPE_CHECKING, Callable, Iterator

import torch
import torch.nn as nn

from clipscale.compile import begin_graph_step
from clipscale.data.chunks import Bounds, chunk_bounds  # the plan of a batch's chunks, not their source
from clipscale.parallel import ParallelModel
from clipscale.precision import autocast_factory

if TYPE_CHECKING:  # only named: Gradient Cache does not know where its chunks come from
    from clipscale.caption_length import TextChunks
    from clipscale.data.chunks import ChunkSource


class RandomState:
    """The CPU and CUDA generator states at one moment, to replay random masks exactly."""

    def __init__(self, device: torch.device):
        self.device = device
        self.cpu = torch.get_rng_state()
        self.cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None

    @contextlib.contextmanager
    def replay(self):
        # fork_rng puts the generators back afterwards, so the step leaves the RNG where a
        # single pass over the batch would have left it.
        with torch.random.fork_rng(devices=[self.device] if self.cuda is not None else []):
            torch.set_rng_state(self.cpu)
            if self.cuda is not None:
                torch.cuda.set_rng_state(self.cuda, self.device)
            yield


class LazyOrder:
    """The texts in their encoding order (`GradCache.text_order`), found when pass 1 first asks for a
    text chunk, not before: all of the batch's tokens are there by then. `source` and `rows` (the
    permutation) are set from then on."""

    def __init__(self, text_order: Callable, texts: torch.Tensor | ChunkSource):
        self.text_order, self.texts = text_order, texts
        self.source: TextChunks | None = None
        self.rows: torch.Tensor | None = None

    def chunks(self, bounds: Bounds, device: torch.device) -> Iterator[torch.Tensor]:
        tokens = self.texts if isinstance(self.texts, torch.Tensor) else self.texts.whole()
        self.source, self.rows = self.text_order(tokens, device)
        yield from self.source.chunks(bounds, device, 1)


@dataclass
class Encoded:
    """What an open_clip model returns, whichever output format it was built with."""

    image: torch.Tensor | None
    text: torch.Tensor | None
    scalars: tuple[torch.Tensor, ...]  # exponentiated logit_scale, and logit_bias if the model has one


def encode(model: nn.Module, images: torch.Tensor | None, texts: torch.Tensor | None) -> Encoded:
    """One forward of an open_clip model (dict or tuple output): normalised features and scalars."""
    out = model(images, texts)
    if isinstance(out, dict):
        scalars = tuple(out[key] for key in ("logit_scale", "logit_bias") if key in out)
        return Encoded(out["image_features"], out["text_features"], scalars)
    image, text, *scalars = out
    return Encoded(image, text, tuple(scalars))


def trainable_towers(module: nn.Module) -> tuple[bool, bool]:
    """(image tower has trainable parameters, text tower has). A locked tower (LiT) is
    encoded once in pass 1 and never re-encoded: its features need no gradient."""
    visual = list(module.visual.parameters())
    visual_ids = {id(p) for p in visual}
    image = any(p.requires_grad for p in visual)
    text = any(
        p.requires_grad
        for name, p in module.named_parameters()
        if id(p) not in visual_ids and not name.startswith("logit_")
    )
    return image, text


@dataclass
class FirstPass:
    """Pass 1's results: every chunk's detached features, the scalars, the RNG state before
    each tower's call, and (with reuse_last_chunk) the last chunk's output with its graph."""

    image_features: torch.Tensor
    text_features: torch.Tensor
    scalars: tuple[torch.Tensor, ...]
    image_states: list[RandomState]
    text_states: list[RandomState]
    last_chunk: Encoded | None
    text_positions: list[int]  # each text chunk's positions (its tokens' width)


@dataclass
class CachedGradients:
    """dL/d(features) of the whole batch and dL/d(scalars), from the loss on pass 1's features;
    backpropagated chunk by chunk through the re-encoded towers."""

    image: torch.Tensor
    text: torch.Tensor
    scalars: list[torch.Tensor]
    train_image: bool
    train_text: bool

    text_rows: torch.Tensor | None = None  # the batch rows of the texts' encoding order, when reordered

    def backward(self, out: Encoded, start: int, stop: int, with_scalars: bool = False) -> None:
        """Backpropagate the gradients of samples [start, stop) through `out`, that chunk's
        encoding (for the texts, rows [start, stop) of their encoding order). The scalars'
        gradient is a whole-batch quantity: added with one chunk only."""
        text_grad = self.text[start:stop] if self.text_rows is None else self.text[self.text_rows[start:stop]]
        outputs, grads = [], []
        for features, grad, trained in ((out.image, self.image[start:stop], self.train_image),
                                        (out.text, text_grad, self.train_text)):
            if trained:
                outputs.append(features)
                grads.append(grad)
        if with_scalars:
            for scalar, grad in zip(out.scalars, self.scalars):
                if scalar.requires_grad:
                    outputs.append(scalar)
                    grads.append(grad)
        if outputs:
            torch.autograd.backward(outputs, grads)


class GradCache:
    """A training step over a large batch, encoded `chunk_size` samples at a time.

    model:      an open_clip CLIP-like module (`visual` tower, forward(image, text) giving
                normalised features and the exponentiated logit scale), plain, in DDP, or as
                `clipscale.parallel.parallelize` placed it (a ParallelModel: its sync and device).
    loss_fn:    loss_fn(image_features, text_features, logit_scale[, logit_bias]) following
                the loss contract (global loss, DDP-style gradients).
    autocast:   None, a dtype (torch.bfloat16, torch.float16) or a context-manager factory;
                used for the encoders and the loss, as open_clip_train does.
    scaler:     a GradScaler for fp16: the loss is scaled, so the cached feature gradients
                and the parameter gradients are too; unscale/step/update stay with the caller.
    reuse_last_chunk: pass 1 encodes the last chunk with its graph and backpropagates it
                right after the loss, so pass 2 re-encodes one chunk fewer (a batch of two
                chunks costs 1.5 forwards instead of 2). Its activations are then held while
                the loss runs: turn it off where the loss's own memory is the limit (the
                b x b losses at their largest batches).
    text_order: None, or a callable taking the batch's tokens [b, context] on the host and the
                device, and returning (a chunk source of the tokens in encoding order, cut per
                chunk; the permutation it applied, on the device), as `LengthSortedTexts`. Pass 1 then encodes every
                image chunk before the first text chunk, which needs all of the batch's tokens.
    After each call, `text_chunks` holds (samples, positions) of each text chunk encoded in pass 1.
    """

    def __init__(
        self,
        model: nn.Module,
        loss_fn: Callable[..., torch.Tensor],
        chunk_size: int,
        autocast=None,
        scaler: torch.amp.GradScaler | None = None,
        reuse_last_chunk: bool = True,
        text_order: Callable[[torch.Tensor, torch.device], tuple[TextChunks, torch.Tensor]] | None = None,
    ):
        if chunk_size < 1:
            raise ValueError(f"chunk_size must be positive, got {chunk_size}")
        self.model = ParallelModel.of(model)
        self.loss_fn = loss_fn
        self.chunk_size = chunk_size
        self.device = self.model.device
        self.autocast = autocast_factory(autocast, self.device)
        self.scaler = scaler
        self.reuse_last_chunk = reuse_last_chunk
        self.text_order = text_order
        self.sync = self.model.sync
        self.text_chunks: list[tuple[int, int]] = []

    def __call__(self, images: torch.Tensor | ChunkSource, texts: torch.Tensor | ChunkSource) -> torch.Tensor:
        loss = self.accumulate_gradients(images, texts)
        self.sync.finish()
        return loss

    def accumulate_gradients(self, images: torch.Tensor | ChunkSource, texts: torch.Tensor | ChunkSource) -> torch.Tensor:
        """The loss, with every chunk's gradients in the parameters (before `sync.finish`)."""
        if len(images) != len(texts):
            raise ValueError(f"{len(images)} images but {len(texts)} texts")
        if len(images) == 0:
            raise ValueError("empty batch")
        bounds = chunk_bounds(len(images), self.chunk_size)
        if len(bounds) == 1:  # the batch is one chunk: a plain step, no second forward needed
            text = next(self.chunks(texts, bounds, 1))
            self.text_chunks = [(len(text), text.shape[1])]
            return self.plain_step(next(self.chunks(images, bounds, 1)), text)
        train_image, train_text = trainable_towers(self.model.module)
        # With reuse_last_chunk, pass 1 encodes the last chunk with its graph and pass 2
        # re-encodes only the chunks before it: the chunks of a trained tower that pass 2 asks for again.
        reencoded = bounds[:-1] if self.reuse_last_chunk else bounds

        image_chunks = self.chunks(images, bounds, 1, reencoded if train_image else ())
        text_rows = None
        if self.text_order is None:
            text_chunks = self.chunks(texts, bounds, 1, reencoded if train_text else ())
        else:  # the texts in their own order: asked for once every image chunk of pass 1 is encoded
            ordered = LazyOrder(self.text_order, texts)
            text_chunks, text_rows = ordered.chunks(bounds, self.device), ordered
        first = self.first_pass(image_chunks, text_chunks, len(bounds), texts_after_images=text_rows is not None)
        if text_rows is not None:
            texts, text_rows = text_rows.source, text_rows.rows
            first.text_features = first.text_features[torch.argsort(text_rows.to(self.device))]  # the pairs' order
        self.text_chunks = [(stop - start, positions) for (start, stop), positions in zip(bounds, first.text_positions)]
        loss, grads = self.loss_and_feature_grads(first, train_image, train_text)
        grads.text_rows = None if text_rows is None else text_rows.to(self.device)
        if first.last_chunk is not None:  # its graph is still there: backpropagate it first, then free it
            with self.sync.deferred():
                grads.backward(first.last_chunk, *bounds[-1])
        states = list(zip(first.image_states, first.text_states))
        del first

        image_chunks = self.chunks(images, reencoded, 2) if train_image else repeat(None)
        text_chunks = self.chunks(texts, reencoded, 2) if train_text else repeat(None)
        final = len(reencoded) - 1
        for k, ((start, stop), image, text) in enumerate(zip(reencoded, image_chunks, text_chunks)):
            begin_graph_step()  # the previous chunk is backpropagated
            # DDP all-reduces in the final backward of the step only.
            with self.sync.deferred() if k < final else contextlib.nullcontext():
                grads.backward(self.reencode(image, text, *states[k]), start, stop, with_scalars=k == final)
        return loss.detach()

    def reencode(self, image: torch.Tensor | None, text: torch.Tensor | None, image_state: RandomState | None,
                 text_state: RandomState | None) -> Encoded:
        """A chunk's encoding with a graph, each tower called alone. In pass 2 under the RNG state
        pass 1 had before calling it, so it draws the same masks: called as in pass 1 (one tower
        a call), a compiled tower runs the same graph but for autograd, whose random ops take the
        same seeds; a call of both towers would be a graph of its own. A None state: no replay."""
        image_out = text_out = None
        if image is not None:
            with image_state.replay() if image_state else contextlib.nullcontext(), self.autocast():
                image_out = encode(self.model, image, None)
        if text is not None:
            with text_state.replay() if text_state else contextlib.nullcontext(), self.autocast():
                text_out = encode(self.model, None, text)
        return Encoded(image_out.image if image_out else None, text_out.text if text_out else None,
                       (text_out or image_out).scalars)

    def plain_step(self, images: torch.Tensor, texts: torch.Tensor) -> torch.Tensor:
        begin_graph_step()
        with self.autocast():
            out = encode(self.model, images, texts)
            loss = self.loss_fn(out.image, out.text, *out.scalars)
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()
        return loss.detach()

    def chunks(self, batch: torch.Tensor | ChunkSource, bounds: Bounds, pass_number: int, keep: Bounds = ()) -> Iterator[torch.Tensor]:
        """The batch's chunks on the device, for pass 1 or 2. A tensor is sliced (and moved when it
        lives elsewhere); a chunk source prepares them, keeping pass 1's `keep` chunks if it can."""
        if isinstance(batch, torch.Tensor):
            return (batch[start:stop].to(self.device, non_blocking=True) for start, stop in bounds)
        return batch.chunks(bounds, self.device, pass_number, keep)

    def first_pass(self, image_chunks: Iterator[torch.Tensor], text_chunks: Iterator[torch.Tensor], count: int,
                   texts_after_images: bool = False) -> FirstPass:
        """Every chunk's features, and the RNG state before each tower's call. The towers run
        separately so that each has its own RNG state: a locked tower is skipped in pass 2,
        and the other must still replay its own masks. With reuse_last_chunk the last chunk
        runs with its graph (through DDP, unsynchronised). Chunk by chunk, image then text;
        `texts_after_images`: every image chunk, then every text chunk."""
        image_features, text_features, image_states, text_states, text_positions = [], [], [], [], []
        last = {}  # the last chunk's output of each tower, with its graph

        def encode_chunk(k: int, image: torch.Tensor | None, text: torch.Tensor | None) -> None:
            begin_graph_step()  # the previous chunk's features are kept outside the towers
            if text is not None:
                text_positions.append(text.shape[1])
            if k == count - 1 and self.reuse_last_chunk:
                with self.sync.deferred():  # each tower alone, as pass 2 calls them: no graph of both to compile
                    out = self.reencode(image, text, None, None)
                for tower, features in (("image", image_features), ("text", text_features)):
                    if getattr(out, tower) is not None:
                        last[tower] = getattr(out, tower)
                        features.append(last[tower].detach())
                last["scalars"] = out.scalars
                return
            with torch.no_grad():
                if image is not None:
                    image_states.append(RandomState(self.device))
                    with self.autocast():
                        image_features.append(encode(self.model.module, image, None).image)
                if text is not None:
                    text_states.append(RandomState(self.device))
                    with self.autocast():
                        out = encode(self.model.module, None, text)
                    text_features.append(out.text)
                    last.setdefault("scalars", out.scalars)

        if texts_after_images:
            for k, image in enumerate(image_chunks):
                encode_chunk(k, image, None)
            for k, text in enumerate(text_chunks):
                encode_chunk(k, None, text)
        else:
            for k, (image, text) in enumerate(zip(image_chunks, text_chunks)):
                encode_chunk(k, image, text)
        last_chunk = Encoded(last["image"], last["text"], last["scalars"]) if "text" in last else None
        return FirstPass(torch.cat(image_features), torch.cat(text_features), tuple(s.detach() for s in last["scalars"]),
                         image_states, text_states, last_chunk, text_positions)

    def loss_and_feature_grads(self, first: FirstPass, train_image: bool, train_text: bool):
        """Pass 1's loss on detached features: its gradient w.r.t. features and scalars."""
        leaves = [t.detach().requires_grad_() for t in (first.image_features, first.text_features, *first.scalars)]
        first.image_features = first.text_features = None  # the leaves hold them now
        with self.autocast():
            loss = self.loss_fn(*leaves)
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()
        grads = [t.grad if t.grad is not None else torch.zeros_like(t) for t in leaves]
        return loss, CachedGradients(grads[0], grads[1], grads[2:], train_image, train_text)
