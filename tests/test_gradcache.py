"""GradCache gives the parameter gradients of one plain forward/backward over the whole batch.

"Plain" here means: one graph over the whole batch, one loss, one backward. With dropout
on, a random mask depends on how many samples an encoder call sees, so the plain step
calls the encoders on the same chunks, in the same order, from the same RNG state; then
every mask is the same and the gradients must agree to rounding. Without dropout the
plain step is a single encoder call over the whole batch.
"""

from __future__ import annotations

import io
import threading
import time

import pytest
import torch
import torch.distributed as dist
from PIL import Image
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel
import torchvision.transforms as T

from clipscale.data.chunks import Arrivals, ChunkSource, PinnedRows
from clipscale.data.decoders import DecodePool, EncodedImages
from clipscale.data.transforms import SplitTransform
from clipscale.gradcache import encode
from clipscale.losses import CLIP_INPUTS, _registered, available_losses, build_loss, loss_contract
from tests.helpers.gloo_world import run_in_gloo_world
from tests.helpers.gradients import (PRECISIONS, float64_clip_loss, gradcache_grads, grads_of, make_batch, plain_grads,
                                     relative_error, tiny_clip)

pytestmark = pytest.mark.timeout(180)


def clip_losses() -> list[str]:
    """Every built-in loss with the CLIP contract (image features, text features, scale). Nothing
    is dropped that fails: a loss whose module cannot be imported fails the collection here, and
    one that cannot be built fails each of its tests (`build_loss` in the test body)."""
    return [name for name in available_losses()
            if loss_contract(name).inputs == CLIP_INPUTS and _registered(name).factory.__module__.startswith("clipscale.")]


LOSSES = clip_losses()


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("loss_name", LOSSES)
def test_matches_plain_step_with_dropout(loss_name, precision):
    model, loss_fn = tiny_clip(), build_loss(loss_name)
    images, texts = make_batch(10, seed=0)
    loss, grads = gradcache_grads(model, loss_fn, images, texts, chunk_size=4, precision=precision)
    want_loss, want = plain_grads(model, loss_fn, images, texts, chunk_size=4, precision=precision)
    assert torch.equal(loss, want_loss)
    assert relative_error(grads, want) < 1e-5


@pytest.mark.parametrize("reuse_last_chunk", [True, False])
def test_both_pass_orders_match_plain_step(reuse_last_chunk):
    """Keeping pass 1's last graph (the default) or re-encoding every chunk: same gradients."""
    model, loss_fn = tiny_clip(), build_loss("infcl")
    images, texts = make_batch(11, seed=0)
    _, grads = gradcache_grads(model, loss_fn, images, texts, chunk_size=4, reuse_last_chunk=reuse_last_chunk)
    _, want = plain_grads(model, loss_fn, images, texts, chunk_size=4)
    assert relative_error(grads, want) < 1e-5


@pytest.mark.parametrize("reuse_last_chunk, forwards", [(True, 5), (False, 6)])
def test_reusing_the_last_chunk_saves_a_forward(reuse_last_chunk, forwards):
    model, loss_fn = tiny_clip(), float64_clip_loss
    calls = []
    model.visual.register_forward_hook(lambda *_: calls.append(1))
    images, texts = make_batch(10, seed=0)
    gradcache_grads(model, loss_fn, images, texts, chunk_size=4, reuse_last_chunk=reuse_last_chunk)
    assert len(calls) == forwards  # pass 1: 3 chunks; pass 2: 2 or 3


def test_dropout_is_really_on():
    """Guards the test above: with another seed the masks, hence the gradients, differ."""
    model, loss_fn = tiny_clip(), float64_clip_loss
    images, texts = make_batch(10, seed=0)
    _, one = plain_grads(model, loss_fn, images, texts, chunk_size=4, seed=1)
    _, other = plain_grads(model, loss_fn, images, texts, chunk_size=4, seed=2)
    assert relative_error(one, other) > 1e-3


def test_chunking_is_invisible_without_dropout():
    model, loss_fn = tiny_clip(dropout=0.0), float64_clip_loss
    images, texts = make_batch(10, seed=0)
    _, grads = gradcache_grads(model, loss_fn, images, texts, chunk_size=3)
    _, want = plain_grads(model, loss_fn, images, texts, chunk_size=len(images))
    assert relative_error(grads, want) < 1e-5


def test_one_chunk_is_a_plain_step():
    model, loss_fn = tiny_clip(), float64_clip_loss
    calls = []
    model.visual.register_forward_hook(lambda *_: calls.append(1))
    images, texts = make_batch(10, seed=0)
    _, grads = gradcache_grads(model, loss_fn, images, texts, chunk_size=16)
    assert len(calls) == 1
    _, want = plain_grads(model, loss_fn, images, texts, chunk_size=10)
    assert relative_error(grads, want) == 0.0


def test_leaves_rng_where_one_pass_would():
    model, loss_fn = tiny_clip(), float64_clip_loss
    images, texts = make_batch(10, seed=0)
    gradcache_grads(model, loss_fn, images, texts, chunk_size=4)
    after_gradcache = torch.get_rng_state()
    plain_grads(model, loss_fn, images, texts, chunk_size=4)
    assert torch.equal(after_gradcache, torch.get_rng_state())


def test_combines_with_gradient_checkpointing():
    model, loss_fn = tiny_clip(), float64_clip_loss
    images, texts = make_batch(10, seed=0)
    _, want = plain_grads(model, loss_fn, images, texts, chunk_size=4)
    model.set_grad_checkpointing()
    _, grads = gradcache_grads(model, loss_fn, images, texts, chunk_size=4)
    assert relative_error(grads, want) < 1e-5


def test_locked_image_tower_is_encoded_once():
    model, loss_fn = tiny_clip(), float64_clip_loss
    model.lock_image_tower()
    calls = []
    model.visual.register_forward_hook(lambda *_: calls.append(1))
    images, texts = make_batch(10, seed=0)
    _, grads = gradcache_grads(model, loss_fn, images, texts, chunk_size=4)
    assert len(calls) == 3  # pass 1 only: 3 chunks
    _, want = plain_grads(model, loss_fn, images, texts, chunk_size=4)
    assert not any(n.startswith("visual.") for n in grads)
    assert relative_error(grads, want) < 1e-5


def png_bytes(image: torch.Tensor) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(image.permute(1, 2, 0).numpy()).save(buffer, format="PNG")
    return buffer.getvalue()


def normalise(pixels: torch.Tensor) -> torch.Tensor:
    return (pixels.float() / 255 - 0.5) / 0.25


def test_host_columns_give_the_same_gradients():
    """uint8 pixels on the host, normalised on the device per chunk in both passes, from a batch
    still arriving from another thread == the normalised batch kept whole on the device."""
    model, loss_fn = tiny_clip(), float64_clip_loss
    pixels = torch.randint(0, 256, (10, 3, 32, 32), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    _, texts = make_batch(10, seed=0)
    _, kept = gradcache_grads(model, loss_fn, normalise(pixels), texts, chunk_size=4)
    pinned_images, pinned_texts = ChunkSource.of_tensor(pixels, normalise), ChunkSource.of_tensor(texts)
    _, pinned = gradcache_grads(model, loss_fn, pinned_images, pinned_texts, chunk_size=4)
    assert relative_error(pinned, kept) == 0.0

    arrivals = Arrivals()
    images = ChunkSource(PinnedRows(torch.empty_like(pixels), "images", arrivals), normalise)
    tokens = ChunkSource(PinnedRows(torch.empty_like(texts), "texts", arrivals))

    def arrive():  # two rows at a time, slower than the step asks for them
        for start in range(0, 10, 2):
            time.sleep(0.05)
            rows = slice(start, start + 2)
            piece = {"images": pixels[rows], "texts": texts[rows]}
            images.put(rows, piece)
            tokens.put(rows, piece)
            arrivals.add(2)

    filler = threading.Thread(target=arrive)
    filler.start()
    _, arriving = gradcache_grads(model, loss_fn, images, tokens, chunk_size=4)
    filler.join()
    assert relative_error(arriving, kept) == 0.0


def test_offloaded_images_decoded_again_in_processes_give_the_same_gradients():
    """Pass 1 takes the loader's pixels piece by piece, pass 2 decodes the kept PNG bytes in a
    pool of processes: the gradients are those of the decoded batch kept whole."""
    model, loss_fn = tiny_clip(), float64_clip_loss
    pixels = torch.randint(0, 256, (12, 3, 32, 32), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    _, texts = make_batch(12, seed=0)
    split = SplitTransform.split(T.ToTensor())
    pool = DecodePool(split.decode, processes=2, window=2)
    try:
        arrivals = Arrivals()
        images = pool.column(12, arrivals, split.to_float, None)

        def arrive():  # pieces of 2: the window holds 2, so the loader waits for the first pass
            for start in range(0, 12, 2):
                encoded = EncodedImages.from_samples(tuple(png_bytes(p) for p in pixels[start : start + 2]), ((), ()))
                images.put(slice(start, start + 2), {"images": pixels[start : start + 2], "encoded": encoded})
                arrivals.add(2)

        filler = threading.Thread(target=arrive)
        filler.start()
        _, offloaded = gradcache_grads(model, loss_fn, images, ChunkSource.of_tensor(texts), chunk_size=4)
        filler.join()
    finally:
        pool.close()
    _, kept = gradcache_grads(model, loss_fn, split.to_float(pixels), texts, chunk_size=4)
    assert relative_error(offloaded, kept) == 0.0


# --- DistributedDataParallel in a 2-process gloo world -------------------------------------------

WORLD, PER_RANK, CHUNK = 2, 6, 4


def counting_allreduce(counter: list, bucket):
    counter.append(1)
    return default_hooks.allreduce_hook(None, bucket)


def gold_grads(model, seeds_and_batches, chunk_size):
    """One process, the whole global batch, float64 loss; each rank's chunks with its RNG."""
    model.zero_grad(set_to_none=True)
    outs = []
    for seed, (images, texts) in seeds_and_batches:
        torch.manual_seed(seed)
        outs += [encode(model, images[s : s + chunk_size], texts[s : s + chunk_size]) for s in range(0, len(images), chunk_size)]
    float64_clip_loss(torch.cat([o.image for o in outs]), torch.cat([o.text for o in outs]), outs[0].scalars[0]).backward()
    return grads_of(model)


def averaged_plain_grads(model, loss_fn, images, texts, precision, seed):
    """What DDP does for a plain step: local forward/backward, then the mean over ranks."""
    _, grads = plain_grads(model, loss_fn, images, texts, CHUNK, precision, seed)
    for g in grads.values():
        dist.all_reduce(g)
        g /= dist.get_world_size()
    return grads


def plain_ddp_backward(ddp, images, texts):
    out = encode(ddp, images, texts)
    (out.image.sum() + out.text.sum() + out.scalars[0]).backward()


def ddp_worker(rank, world, loss_names):
    seed = 100 + rank
    batches = [(100 + r, make_batch(PER_RANK, seed=r)) for r in range(world)]
    images, texts = batches[rank][1]
    model = tiny_clip()
    ddp = DistributedDataParallel(model)
    hook_calls: list = []
    ddp.register_comm_hook(hook_calls, counting_allreduce)

    plain_ddp_backward(ddp, images, texts)  # DDP re-buckets after its first backward
    hook_calls.clear()
    plain_ddp_backward(ddp, images, texts)
    buckets = len(hook_calls)

    errors = {}
    hook_calls.clear()
    _, grads = gradcache_grads(ddp, float64_clip_loss_in_world, images, texts, CHUNK, seed=seed)
    errors["allreduce_calls"] = (len(hook_calls), buckets)
    errors["gold"] = relative_error(grads, gold_grads(model, batches, CHUNK))

    for name in loss_names:
        for precision in PRECISIONS:
            loss_fn = build_loss(name)
            _, grads = gradcache_grads(ddp, loss_fn, images, texts, CHUNK, precision, seed=seed)
            errors[name, precision] = relative_error(grads, averaged_plain_grads(model, loss_fn, images, texts, precision, seed))
    return errors


def float64_clip_loss_in_world(image, text, logit_scale):
    """float64_clip_loss over all ranks' features, with the loss contract's gradients: each rank
    computes the global loss, so summing the gathered gradients gives world * dL/dfeatures_r."""
    return float64_clip_loss(gather_with_grad(image), gather_with_grad(text), logit_scale)


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, local):
        parts = [torch.empty_like(local) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, local.contiguous())
        return torch.cat(parts)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad)
        return grad.chunk(dist.get_world_size())[dist.get_rank()]


def gather_with_grad(local: torch.Tensor) -> torch.Tensor:
    return _Gather.apply(local)


@pytest.mark.slow
def test_ddp_gloo_world_matches_plain_step():
    results = run_in_gloo_world(ddp_worker, WORLD, args=(LOSSES,), timeout=150)
    for errors in results:
        assert errors["gold"] < 1e-5, errors
        gradcache_calls, plain_calls = errors["allreduce_calls"]
        assert gradcache_calls == plain_calls > 0, "gradients must be all-reduced once per step"
        for key, error in errors.items():
            if isinstance(key, tuple):
                assert error < 1e-5, (key, error)
