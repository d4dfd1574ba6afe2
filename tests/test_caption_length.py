"""Length-sorted text chunks with the padding cut: exact, and refused where it would not be.

The reference is always the untouched open_clip model on the unsorted batch at its full context
length; the candidate is the same weights after `cut_padding` and `use_causal_kernel`, on the
batch sorted by caption length with each chunk's text cut to its bucket. With dropout off the
loss and every parameter gradient must agree to float32 rounding, for every loss, in one process
and in a gloo world of two (where each rank sorts its own samples).
"""

from __future__ import annotations

import copy

import open_clip
import pytest
import torch
from torch.nn.parallel import DistributedDataParallel

from clipscale.caption_length import (POSITION_BUCKETS, LengthSortedTexts, TextChunks, caption_lengths, captions_cut,
                                      causal_kernel_refusal, context_length, cut_padding, length_order,
                                      padding_refusal, positions_for, use_causal_kernel)
from clipscale.compile import compile_towers
from clipscale.config import ModelConfig
from clipscale.gradcache import GradCache
from clipscale.losses import build_loss
from clipscale.losses.infcl import ntxent_loss
from clipscale.models import build_model
from tests.helpers.captions import EOT, LENGTHS, make_tokens, tiny_config, tiny_model
from tests.helpers.gloo_world import run_in_gloo_world
from tests.helpers.gradients import grads_of, relative_error
from tests.helpers.towers import timm_hf_config

pytestmark = pytest.mark.timeout(180)

CHUNK = 4


def make_batch(seed: int, lengths: list[int] = LENGTHS) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(len(lengths), 3, 32, 32, generator=generator), make_tokens(lengths, seed)


def short_text_copy(model: torch.nn.Module) -> torch.nn.Module:
    """The same weights, taking tokens of any length, on the causal kernel."""
    model = copy.deepcopy(model)
    assert cut_padding(model) is None
    assert use_causal_kernel(model) is None
    return model


def sorted_and_cut(model, images, tokens) -> tuple[torch.Tensor, TextChunks]:
    """What a step hands Gradient Cache: both columns in length order, the texts cut per chunk."""
    lengths = caption_lengths(model, tokens)
    order = length_order(lengths)
    return images[order], TextChunks(tokens[order], lengths[order], context_length(model))


def step(model, loss_fn, images, texts, sort: bool = False) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Gradient Cache's step; `sort`: as the trainer runs it, texts encoded in length order, cut."""
    model.zero_grad(set_to_none=True)
    unwrapped = getattr(model, "module", model)
    loss = GradCache(model, loss_fn, CHUNK, text_order=LengthSortedTexts(unwrapped) if sort else None)(images, texts)
    return loss, grads_of(model)


def image_text_ntxent(image_features, text_features, logit_scale):
    """NT-Xent with the image and the text of a pair as its two views: [images; texts], row i's
    positive is row i + b (and back), the temperature 1 / logit_scale."""
    return ntxent_loss(torch.cat([image_features, text_features]), 1 / logit_scale, backend="reference")


LOSSES = ("vanilla", "local", "disco", "infcl", "siglip", "ntxent")


def loss_named(name: str):
    if name == "ntxent":
        return image_text_ntxent
    return build_loss(name, backend="reference") if name == "infcl" else build_loss(name)


# --- which towers allow it ---------------------------------------------------------------------------


@pytest.mark.parametrize("text", [{}, {"pool_type": "eos", "eos_id": EOT}])
def test_open_clips_causal_towers_pooled_at_the_end_of_text_allow_both(text):
    for custom_text in (False, True):  # CLIP holds the text parts itself; CustomTextCLIP in .text
        model = tiny_model(text=text, custom_text=custom_text)
        assert padding_refusal(model) is None and causal_kernel_refusal(model) is None


@pytest.mark.parametrize("text, reason, causal", [
    ({"no_causal_mask": True, "pool_type": "last"}, "bidirectional", False),  # open_clip's SigLIP text towers
    ({"pool_type": "last"}, "pooled as 'last'", True),
    ({"pool_type": "first"}, "pooled as 'first'", True),
])
def test_towers_where_the_padding_matters_are_refused_with_the_reason(text, reason, causal):
    model = tiny_model(text=text)
    assert (causal_kernel_refusal(model) is None) == causal  # the kernel needs causal attention only
    before = {name: p.clone() for name, p in model.state_dict().items()}
    refusal = cut_padding(model)
    assert refusal is not None and reason in refusal
    assert "encode_text" not in vars(model) and not model.transformer._forward_pre_hooks  # untouched
    assert all(torch.equal(before[name], p) for name, p in model.state_dict().items())


def test_a_class_token_after_the_padding_is_refused():
    refusal = padding_refusal(tiny_model(text={"embed_cls": True}, custom_text=True))
    assert refusal is not None and "class token" in refusal


def test_a_hugging_face_text_tower_is_refused(hf_folder):
    model = build_model(ModelConfig(custom=timm_hf_config(hf_folder))).model
    for refusal in (padding_refusal(model), causal_kernel_refusal(model)):
        assert refusal is not None and "HFTextEncoder" in refusal


def test_custom_attention_blocks_cut_their_padding_but_keep_their_mask():
    model = tiny_model(text={"qk_norm": True}, custom_text=True)
    assert "custom attention" in causal_kernel_refusal(model)
    assert cut_padding(model) is None
    tokens = make_tokens(LENGTHS, seed=0)
    want = tiny_model(text={"qk_norm": True}, custom_text=True).encode_text(tokens)
    cut = model.encode_text(tokens[:, :48][[4, 2, 7]])
    assert torch.allclose(cut, want[[4, 2, 7]], atol=1e-5, rtol=0)


# --- the pieces ---------------------------------------------------------------------------------------


def test_caption_lengths_come_from_open_clips_tokenizer_and_pooling():
    model = build_model(ModelConfig(custom={**tiny_config(), "text_cfg": {**tiny_config()["text_cfg"], "vocab_size": 49408}})).model
    tokenizer = open_clip.get_tokenizer("ViT-B-32")
    tokens = tokenizer(["a photo of a cat", "cat", "", " ".join(["dog"] * 200)])
    assert caption_lengths(model, tokens).tolist() == [7, 3, 2, 77]  # words + SOT + EOT; a long one cut at 77


def test_captions_cut_are_those_longer_than_the_context_length():
    """At 8 positions open_clip's tokenizer keeps 6 words between its start and end-of-text tokens:
    a caption of 6 words fits exactly (its end token in the last position), 7 words are cut."""
    tokenizer = open_clip.tokenizer.SimpleTokenizer(context_length=8)
    captions = [" ".join(["dog"] * words) for words in (1, 5, 6, 7, 8, 40)]
    assert captions_cut(tokenizer, captions, tokenizer(captions)) == 3
    assert captions_cut(tokenizer, captions[:3], tokenizer(captions[:3])) == 0


def test_eos_pooling_counts_up_to_the_first_eos_token():
    model = tiny_model(text={"pool_type": "eos", "eos_id": 2})
    tokens = torch.tensor([[5, 9, 2, 1, 1, 2] + [1] * 71, [5, 2, 7, 7, 7, 7] + [1] * 71])
    assert caption_lengths(model, tokens).tolist() == [3, 2]


def test_positions_are_the_first_bucket_that_holds_the_longest_caption():
    assert [positions_for(n, 77) for n in (1, 8, 9, 16, 17, 33, 48, 49, 64, 65, 77)] == \
        [8, 8, 16, 16, 24, 48, 48, 64, 64, 77, 77]
    assert [positions_for(n, 16) for n in (3, 9, 16)] == [8, 16, 16]  # a context below the buckets caps them
    assert all(bucket % 8 == 0 for bucket in POSITION_BUCKETS)


def test_the_order_is_longest_first_and_keeps_ties_in_place():
    lengths = torch.tensor([5, 9, 5, 77, 9, 2])
    assert length_order(lengths).tolist() == [3, 1, 4, 0, 2, 5]


def test_text_chunks_cut_each_chunk_to_its_bucket():
    model = tiny_model()
    _, texts = sorted_and_cut(model, *make_batch(0))
    bounds = [(0, 4), (4, 8), (8, 12)]
    shapes = [tuple(chunk.shape) for chunk in texts.chunks(bounds, torch.device("cpu"), 1)]
    assert shapes == [(4, 77), (4, 48), (4, 16)]  # sorted: 77 77 66 40 | 33 24 17 12 | 9 7 5 3


# --- the same features, the same gradients --------------------------------------------------------------


@pytest.mark.parametrize("custom_text", [False, True])
def test_the_cut_tower_gives_the_full_length_features(custom_text):
    reference = tiny_model(custom_text=custom_text)
    model = short_text_copy(reference)
    tokens = make_tokens(LENGTHS, seed=0)
    want = reference.encode_text(tokens)
    assert torch.equal(model.encode_text(tokens), want)  # at full length: open_clip's arithmetic, bit for bit
    for length in (3, 9, 24, 48):
        fits = [row for row, n in enumerate(LENGTHS) if n <= length]
        got = model.encode_text(tokens[fits, :length])
        assert torch.allclose(got, want[fits], atol=1e-5, rtol=0), length


def test_cut_below_a_captions_end_changes_its_features():
    """Guards the test above: one position fewer than the caption needs, and the features differ."""
    model = short_text_copy(tiny_model())
    tokens = make_tokens([12], seed=0)
    assert not torch.allclose(model.encode_text(tokens[:, :11]), model.encode_text(tokens), atol=1e-3)


def test_the_causal_kernel_equals_the_mask_under_bf16_autocast():
    reference = tiny_model()
    model = copy.deepcopy(reference)
    assert use_causal_kernel(model) is None
    tokens = make_tokens(LENGTHS, seed=0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want, got = reference.encode_text(tokens).float(), model.encode_text(tokens).float()
    assert torch.allclose(got, want, atol=2e-2, rtol=0)


def test_compiled_cut_tower_runs_one_graph_for_every_length(tmp_path):
    """Text blocks are compiled with dynamic shapes: chunks cut to other lengths reuse the block's
    graph (static shapes compiled one graph per length, most of a four-minute first step)."""
    reference = tiny_model()
    model = short_text_copy(reference)
    compile_towers(model, tmp_path, backend="aot_eager")
    tokens = make_tokens(LENGTHS, seed=0)
    want = reference(None, tokens)["text_features"]
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    for length in (16, 32, 16):
        fits = [row for row, n in enumerate(LENGTHS) if n <= length][:2]
        got = model(None, tokens[fits, :length])["text_features"]
        assert torch.allclose(got, want[fits], atol=1e-5, rtol=0)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs == 1


@pytest.mark.parametrize("loss_name", LOSSES)
def test_sorted_and_cut_step_equals_the_unsorted_full_length_step(loss_name):
    reference = tiny_model(bias=loss_name == "siglip")
    model, loss_fn = short_text_copy(reference), loss_named(loss_name)
    images, tokens = make_batch(0)
    want_loss, want = step(reference, loss_fn, images, tokens)

    # The order alone: the losses do not see it.
    order = length_order(caption_lengths(reference, tokens))
    loss, grads = step(reference, loss_fn, images[order], tokens[order])
    assert torch.allclose(loss, want_loss, atol=0, rtol=1e-6) and relative_error(grads, want) < 1e-5

    loss, grads = step(model, loss_fn, *sorted_and_cut(model, images, tokens))
    assert torch.allclose(loss, want_loss, atol=0, rtol=1e-6)
    assert relative_error(grads, want) < 1e-5

    # As the trainer runs it: the pairs in their order, the texts encoded in length order.
    loss, grads = step(model, loss_fn, images, tokens, sort=True)
    assert torch.allclose(loss, want_loss, atol=0, rtol=1e-6)
    assert relative_error(grads, want) < 1e-5


@pytest.mark.parametrize("reuse_last_chunk", [True, False])
def test_gradient_cache_encodes_the_texts_in_length_order_cut_per_chunk(reuse_last_chunk):
    reference = tiny_model()
    model = short_text_copy(reference)
    images, tokens = make_batch(0)
    want_loss, want = step(reference, build_loss("vanilla"), images, tokens)
    model.zero_grad(set_to_none=True)
    gradcache = GradCache(model, build_loss("vanilla"), CHUNK, reuse_last_chunk=reuse_last_chunk,
                          text_order=LengthSortedTexts(model))
    loss = gradcache(images, tokens)
    assert torch.allclose(loss, want_loss, atol=0, rtol=1e-6) and relative_error(grads_of(model), want) < 1e-5
    # LENGTHS sorted longest first, in chunks of 4: (77, 77, 66, 40) (33, 24, 17, 12) (9, 7, 5, 3)
    assert gradcache.text_chunks == [(4, 77), (4, 48), (4, 16)]


def test_gradient_checkpointing_cuts_the_padding_too():
    reference = tiny_model()
    model = short_text_copy(reference)
    model.set_grad_checkpointing(True)
    images, tokens = make_batch(0)
    want_loss, want = step(reference, build_loss("vanilla"), images, tokens)
    loss, grads = step(model, build_loss("vanilla"), *sorted_and_cut(model, images, tokens))
    assert torch.allclose(loss, want_loss, atol=0, rtol=1e-6) and relative_error(grads, want) < 1e-5


# --- two ranks, each sorting its own samples ----------------------------------------------------------------


def ddp_worker(rank, world, loss_names):
    errors = {}
    images, tokens = make_batch(seed=10 + rank, lengths=LENGTHS[rank::world] + LENGTHS[: 6])
    for name in loss_names:
        reference = tiny_model(bias=name == "siglip")
        model = short_text_copy(reference)
        loss_fn = loss_named(name)
        want_loss, want = step(DistributedDataParallel(reference), loss_fn, images, tokens)
        loss, grads = step(DistributedDataParallel(model), loss_fn, images, tokens, sort=True)
        errors[name] = (float((loss - want_loss).abs() / want_loss.abs()), relative_error(grads, want))
    return errors


@pytest.mark.slow
def test_two_ranks_sorting_their_own_samples_match_the_unsorted_full_length_step():
    for errors in run_in_gloo_world(ddp_worker, 2, args=(LOSSES,), timeout=170):
        for name, (loss_error, grad_error) in errors.items():
            assert loss_error < 1e-6 and grad_error < 1e-5, (name, loss_error, grad_error)
