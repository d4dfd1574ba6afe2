"""Gradient Cache: a contrastive step whose encoder memory depends on the chunk, not the batch.

Gao et al. 2021. The loss couples every pair of samples, but each encoder treats every
sample on its own. So one step is:

  1. encode the batch chunk by chunk without a graph, remembering the RNG state before
     each chunk (dropout, drop-path, patch dropout);
  2. compute the loss on the detached features and backpropagate it to the features
     (and to the logit scale) only;
  3. re-encode each chunk with a graph under the remembered RNG state, so every random
     mask is drawn again exactly, and backpropagate the cached feature gradient
     through it: dL/dtheta = sum over chunks of (dL/dfeatures_chunk) . dfeatures_chunk/dtheta.

The parameter gradients are those of one forward/backward over the whole batch; the
price is one extra encoder forward. Pass 1 keeps the graph of its last chunk and
backpropagates it as soon as the loss has its gradient, so pass 2 re-encodes all chunks
but that one (`reuse_last_chunk`). A batch of a single chunk takes the plain step. See DESIGN.md, "Gradient Cache and offload".

    step = GradCache(model, loss_fn, chunk_size=512, autocast=torch.bfloat16)
    loss = step(images, texts)   # gradients accumulated into model parameters

Under DistributedDataParallel the re-forward goes through the DDP module, under
`no_sync()` for all chunks but the last, so gradients are all-reduced once per step.
The logit scale's gradient enters the graph only in that last chunk, so DDP averages
it with the rest (the loss contract makes that average the global gradient).
"""

from __future__ import annotations

import contextlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from itertools import repeat
from typing import Callable, ContextManager, Iterator, Sequence

import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

from clipscale.data.offload import HostColumn, HostTensor, stream_chunks

Batch = torch.Tensor | HostColumn


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


def remember(chunks: Iterator[torch.Tensor], store: list | None) -> Iterator[torch.Tensor]:
    """Yield the chunks, appending each to `store` on the way (unless it is None)."""
    for chunk in chunks:
        if store is not None:
            store.append(chunk)
        yield chunk


def autocast_factory(autocast, device: torch.device) -> Callable[[], ContextManager]:
    if autocast is None:
        return contextlib.nullcontext
    if isinstance(autocast, torch.dtype):
        return lambda: torch.autocast(device.type, dtype=autocast)
    return autocast


class GradCache:
    """A training step over a large batch, encoded `chunk_size` samples at a time.

    model:      an open_clip CLIP-like module (`visual` tower, forward(image, text) giving
                normalised features and the exponentiated logit scale), possibly in DDP.
    loss_fn:    loss_fn(image_features, text_features, logit_scale[, logit_bias]) following
                the loss contract (global loss, DDP-style gradients).
    autocast:   None, a dtype (torch.bfloat16, torch.float16) or a context-manager factory;
                used for the encoders and the loss, as open_clip_train does.
    scaler:     a GradScaler for fp16: the loss is scaled, so the cached feature gradients
                and the parameter gradients are too; unscale/step/update stay with the caller.
    offload:    inputs that live on the host (a CPU tensor or `EncodedSamples`) are streamed
                to the device a chunk at a time in both passes, instead of being kept on the
                device between the passes. GPU memory then depends on chunk_size alone.
    reuse_last_chunk: pass 1 encodes the last chunk with its graph and backpropagates it
                right after the loss, so pass 2 re-encodes one chunk fewer (a batch of two
                chunks costs 1.5 forwards instead of 2). Its activations are then held while
                the loss runs: turn it off where the loss's own memory is the limit (the
                b x b losses at their largest batches).
    """

    def __init__(
        self,
        model: nn.Module,
        loss_fn: Callable[..., torch.Tensor],
        chunk_size: int,
        offload: bool = False,
        autocast=None,
        scaler: torch.amp.GradScaler | None = None,
        decode_workers: int = 8,
        reuse_last_chunk: bool = True,
    ):
        if chunk_size < 1:
            raise ValueError(f"chunk_size must be positive, got {chunk_size}")
        self.model = model
        self.module = model.module if isinstance(model, DistributedDataParallel) else model
        self.loss_fn = loss_fn
        self.chunk_size = chunk_size
        self.offload = offload
        self.device = next(self.module.parameters()).device
        self.autocast = autocast_factory(autocast, self.device)
        self.scaler = scaler
        self.reuse_last_chunk = reuse_last_chunk
        self.pool = ThreadPoolExecutor(decode_workers, thread_name_prefix="clipscale-decode")

    def __call__(self, images: Batch, texts: Batch) -> torch.Tensor:
        if len(images) != len(texts):
            raise ValueError(f"{len(images)} images but {len(texts)} texts")
        if len(images) == 0:
            raise ValueError("empty batch")
        bounds = [(s, min(s + self.chunk_size, len(images))) for s in range(0, len(images), self.chunk_size)]
        if len(bounds) == 1:  # the batch is one chunk: a plain step, no second forward needed
            return self.plain_step(next(self.chunks(images, bounds)), next(self.chunks(texts, bounds)))
        train_image, train_text = trainable_towers(self.module)
        # With reuse_last_chunk, pass 1 encodes the last chunk with its graph and pass 2
        # re-encodes only the chunks before it.
        reencoded = bounds[:-1] if self.reuse_last_chunk else bounds

        # Without offload, pass 1's device chunks are kept for pass 2 instead of loaded twice.
        kept_images, kept_texts = [], []
        image_chunks = remember(self.chunks(images, bounds), None if self.offload else kept_images)
        text_chunks = remember(self.chunks(texts, bounds), None if self.offload else kept_texts)
        features, scalars, image_states, text_states, last_chunk = self.first_pass(image_chunks, text_chunks, len(bounds))

        loss, feature_grads, scalar_grads = self.loss_and_feature_grads(features, scalars)
        del features
        if last_chunk is not None:  # its graph is still there: backpropagate it first, then free it
            start, stop = bounds[-1]
            with self.no_sync():
                self.backward(last_chunk, feature_grads, start, stop, train_image, train_text)
            del last_chunk

        image_chunks = self.pass2_chunks(images, reencoded, kept_images) if train_image else repeat(None)
        text_chunks = self.pass2_chunks(texts, reencoded, kept_texts) if train_text else repeat(None)
        states = image_states if train_image else text_states
        final = len(reencoded) - 1
        for k, ((start, stop), image, text) in enumerate(zip(reencoded, image_chunks, text_chunks)):
            # DDP all-reduces in the final backward of the step only.
            with self.no_sync() if k < final else contextlib.nullcontext():
                with states[k].replay(), self.autocast():
                    out = encode(self.model, image, text)
                # the scalars' gradient is a whole-batch quantity: added once
                self.backward(out, feature_grads, start, stop, train_image, train_text, scalar_grads if k == final else None)
        return loss.detach()

    def no_sync(self) -> ContextManager:
        return self.model.no_sync() if self.model is not self.module else contextlib.nullcontext()

    @staticmethod
    def backward(out: Encoded, feature_grads, start, stop, train_image, train_text, scalar_grads=None) -> None:
        """Backpropagate the cached feature gradients of samples [start, stop) through `out`."""
        outputs = [f for f, train in ((out.image, train_image), (out.text, train_text)) if train]
        grads = [g[start:stop] for g, train in zip(feature_grads, (train_image, train_text)) if train]
        if scalar_grads is not None:
            trainable = [(s, g) for s, g in zip(out.scalars, scalar_grads) if s.requires_grad]
            outputs += [s for s, _ in trainable]
            grads += [g for _, g in trainable]
        if outputs:
            torch.autograd.backward(outputs, grads)

    def plain_step(self, images: torch.Tensor, texts: torch.Tensor) -> torch.Tensor:
        with self.autocast():
            out = encode(self.model, images, texts)
            loss = self.loss_fn(out.image, out.text, *out.scalars)
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()
        return loss.detach()

    def chunks(self, batch: Batch, bounds: Sequence[tuple[int, int]]) -> Iterator[torch.Tensor]:
        """The batch's chunks on the device: slices if it is there, else streamed from the host."""
        if isinstance(batch, torch.Tensor):
            if batch.device == self.device:
                return iter([batch[start:stop] for start, stop in bounds])
            batch = HostTensor(batch)
        return stream_chunks(batch, bounds, self.device, self.pool)

    def pass2_chunks(self, batch: Batch, bounds, kept: list[torch.Tensor]) -> Iterator[torch.Tensor]:
        return self.chunks(batch, bounds) if self.offload else iter(kept)

    def first_pass(self, image_chunks, text_chunks, count: int):
        """Pass 1: every chunk's features, and the RNG state before each tower's call. The
        towers run separately so that each has its own RNG state: a locked tower is skipped
        in pass 2, and the other must still replay its own masks. With reuse_last_chunk the
        last chunk runs with its graph (through DDP, unsynchronised), returned as `last_chunk`."""
        image_features, text_features, image_states, text_states = [], [], [], []
        last_chunk = None
        for k, (image, text) in enumerate(zip(image_chunks, text_chunks)):
            if k == count - 1 and self.reuse_last_chunk:
                with self.no_sync(), self.autocast():
                    out = last_chunk = encode(self.model, image, text)
                image_features.append(out.image.detach())
                text_features.append(out.text.detach())
                break
            with torch.no_grad():
                image_states.append(RandomState(self.device))
                with self.autocast():
                    image_features.append(encode(self.module, image, None).image)
                text_states.append(RandomState(self.device))
                with self.autocast():
                    out = encode(self.module, None, text)
                text_features.append(out.text)
        features = (torch.cat(image_features), torch.cat(text_features))
        return features, tuple(s.detach() for s in out.scalars), image_states, text_states, last_chunk

    def loss_and_feature_grads(self, features, scalars):
        """Pass 1's loss on detached features: its gradient w.r.t. features and scalars."""
        leaves = [t.detach().requires_grad_() for t in (*features, *scalars)]
        with self.autocast():
            loss = self.loss_fn(*leaves)
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()
        grads = [t.grad if t.grad is not None else torch.zeros_like(t) for t in leaves]
        return loss, grads[:2], grads[2:]
