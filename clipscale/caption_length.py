"""The text tower at its captions' own length: length-sorted chunks, padding cut, causal attention kernel.

Every caption is tokenized to the context length (77), and open_clip's text transformer computes
all 77 positions, while web captions mostly need a quarter of them. In open_clip's own text
tower the positions after a caption's end-of-text token cannot change its features:

- the attention is causal (`attn_mask` is -inf above the diagonal), so position p sees only
  positions <= p; layer norms and MLPs act on each position alone;
- the features are taken at the end-of-text token (`text_pool_type` "argmax": the highest token
  id, which is open_clip's EOT; "eos": the first `eos_id`), a position the tokens fix.

So a caption whose pooled token sits at position p gives the same features from its first
p + 1 tokens as from all 77 (`caption_lengths` says p + 1, with open_clip's own pooling). And
the CLIP losses do not change when the pairs of a batch are reordered together (images and
texts by one permutation): vanilla, local, disco and Inf-CL sum a softmax term per row and per
column; SigLIP sums one term per (image, text) pair, marked positive on its own partner; NT-Xent
on [images; texts] pairs row i with row i + b, which one permutation of both halves keeps.
Across ranks each rank reorders its own samples only, so the global batch is permuted within
each rank's block, which the same sums do not see either.

Hence one step can sort its samples by caption length (`length_order`), hand Gradient Cache
chunks of neighbouring lengths, and run each chunk's text only to its longest caption
(`TextChunks`), rounded up to a few buckets (`POSITION_BUCKETS`) so that a compiled tower has few
graphs. The loss and every gradient are those of the unsorted batch at 77 positions (up to
floating-point summation order; tests/test_caption_length.py).

open_clip's towers do not take shorter tokens as they are: CLIP.encode_text adds all 77 rows of
the positional embedding (shorter tokens do not broadcast) and both CLIP and TextTransformer pass
the 77 x 77 mask to every block. `cut_padding(model)` makes them take [n, L] tokens for any L up
to the context length: the positional embedding and the mask cut to L. Where that would change
the features (bidirectional attention, pooling at the first or last position, a class token
appended after the padding, a Hugging Face tower whose attention and pooling are its own) it
changes nothing and says why, for the run to print.

The causal flag: open_clip hands nn.MultiheadAttention a materialised float mask, which rules out
the flash kernels of F.scaled_dot_product_attention; told `is_causal=True` with that mask (a hint
that the mask is causal) nn.MultiheadAttention drops the mask and asks SDPA for causal attention,
the same arithmetic. `use_causal_kernel(model)` adds that hint where the mask is the causal one
and the blocks are nn.MultiheadAttention (open_clip's "custom" blocks take a mask only).

    refusal = cut_padding(model)                   # after build_model, before compile and DDP
    causal_refusal = use_causal_kernel(model)
    lengths = caption_lengths(model, tokens)       # each step, on the host: [b] positions needed
    order = length_order(lengths)                  # one permutation for images and texts
    texts = TextChunks(tokens[order], lengths[order], context_length(model))
    step(images[order], texts)                     # Gradient Cache asks texts for its chunks
"""

from __future__ import annotations

import types
from dataclasses import dataclass
from typing import Iterator, Sequence

import open_clip
import torch
import torch.nn as nn
import torch.nn.functional as F
from open_clip.transformer import ResidualAttentionBlock, TextTransformer, text_global_pool

from clipscale.data.chunks import Bounds

# Positions a text chunk is computed at: the chunk's longest caption rounded up to the first bucket
# that holds it, or to the context length past the last. The text tower's cost is nearly
# proportional to its positions (attention's L x L part is about L / (6 x width) of a block's
# FLOPs: under 3% at 77 positions and width 512), so a bucket costs (bucket - longest) / bucket
# of its chunk's text. Steps of 8 up to 32, where most captions end, then 48 and 64 keep that
# waste at most a third (33 -> 48) and mostly far less, since a length-sorted chunk's captions
# crowd together; every bucket a multiple of 8, so the token rows stay tensor-core friendly. On
# web-length captions (scripts/make_synthetic_shards.py --captions web: 23.4 positions a caption,
# 4% at 77) in sorted chunks of 512 these buckets compute 28.5 positions a sample (77 uncut);
# nine buckets, every multiple of 8, would compute 27.7, and four (16, 32, 48, 64) 31.3.
# Each bucket a batch uses is a set of graphs of a compiled tower (with and without autograd,
# full and last chunk): seven lengths at most, 77 included, against the RECOMPILE_LIMIT in
# clipscale/compile.py, and Inductor's cache keeps them across restarts.
POSITION_BUCKETS = (8, 16, 24, 32, 48, 64)

# open_clip's text pooling types that take the features at a position the tokens fix: the
# end-of-text token ("argmax": open_clip's EOT has the highest id; "eos": the first eos_id).
EOT_POOLING = ("argmax", "eos")


@dataclass(frozen=True)
class TextTower:
    """Where an open_clip model keeps its text transformer: CLIP holds the parts itself
    (`transformer`, `positional_embedding`, `attn_mask`, `text_pool_type`), CustomTextCLIP in
    `text`, a TextTransformer (`pool_type`, `eos_id`)."""

    owner: nn.Module
    pool_type: str
    eos_id: int | None
    context_length: int

    @property
    def transformer(self) -> open_clip.transformer.Transformer:
        return self.owner.transformer

    @property
    def attn_mask(self) -> torch.Tensor | None:
        return self.owner.attn_mask


def text_tower(model: nn.Module) -> TextTower | str:
    """The model's open_clip text transformer, or why it has none (a Hugging Face tower, say)."""
    model = getattr(model, "module", model)  # DDP's wrapped module
    text = getattr(model, "text", None)
    if isinstance(text, TextTransformer):
        return TextTower(text, text.pool_type, text.eos_id, text.context_length)
    if text is not None:
        return (f"the text tower is {type(text).__name__} (a Hugging Face tower, say), not open_clip's text "
                "transformer: its attention and pooling are its own")
    if isinstance(model, open_clip.CLIP):
        return TextTower(model, model.text_pool_type, model.text_eos_id, model.context_length)
    return f"{type(model).__name__} has no open_clip text transformer"


def context_length(model: nn.Module) -> int:
    """The text tower's context length: the tokens' width, and the most positions a chunk computes."""
    tower = text_tower(model)
    if isinstance(tower, str):
        raise ValueError(tower)
    return tower.context_length


def _is_causal(mask: torch.Tensor) -> bool:
    upper = torch.ones_like(mask, dtype=torch.bool).triu(1)
    return bool(torch.isneginf(mask[upper]).all() and (mask[~upper] == 0).all())


def padding_refusal(model: nn.Module) -> str | None:
    """Why computing a caption only up to its end-of-text token would change its features; None
    where it would not (causal attention, pooling at the end-of-text token, nothing after it)."""
    tower = text_tower(model)
    if isinstance(tower, str):
        return tower
    if tower.attn_mask is None:
        return "the text attention is bidirectional (text_cfg.no_causal_mask): every position sees the padding"
    if not _is_causal(tower.attn_mask):
        return "the text tower's attention mask is not the causal one"
    if getattr(tower.owner, "cls_emb", None) is not None:
        return "a class token is appended after the padding (text_cfg.embed_cls) and pooled"
    if tower.pool_type not in EOT_POOLING:
        return (f"the text features are pooled as {tower.pool_type!r} (text_cfg.pool_type), not at the "
                "end-of-text token ('argmax' or 'eos'), so the pooled position depends on the padding")
    if getattr(tower.owner, "output_tokens", False):
        return "the text tower also returns every position's features (text_cfg.output_tokens)"
    return None


def cut_padding(model: nn.Module) -> str | None:
    """Let `model`'s text tower take tokens [n, L] for any L up to its context length, with the
    features of the full-length tokens (the positional embedding and the causal mask cut to L).
    Call once, before compiling and wrapping the model. Returns None, or why the padding stays
    (the model is then untouched and must be given full-length tokens)."""
    refusal = padding_refusal(model)
    if refusal is not None:
        return refusal
    tower = text_tower(model)
    if isinstance(tower.owner, open_clip.CLIP):  # TextTransformer._embeds already cuts its positional embedding
        tower.owner.encode_text = types.MethodType(_encode_text_any_length, tower.owner)
    tower.transformer.register_forward_pre_hook(_cut_mask, with_kwargs=True)
    return None


def _encode_text_any_length(self: open_clip.CLIP, text: torch.Tensor, normalize: bool = False) -> torch.Tensor:
    """open_clip's CLIP.encode_text, but for the positional embedding cut to the tokens' length
    (open_clip adds all its rows); the transformer's hook cuts the mask."""
    cast_dtype = self.transformer.get_cast_dtype()
    x = self.token_embedding(text).to(cast_dtype)
    x = x + self.positional_embedding[: text.shape[1]].to(cast_dtype)
    x = self.transformer(x, attn_mask=self.attn_mask)
    x = self.ln_final(x)
    x = text_global_pool(x, text, self.text_pool_type, eos_token_id=getattr(self, "text_eos_id", None))
    if self.text_projection is not None:
        x = self.text_projection(x) if isinstance(self.text_projection, nn.Linear) else x @ self.text_projection
    return F.normalize(x, dim=-1) if normalize else x


def _cut_mask(transformer: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Transformer.forward's pre-hook: the causal mask cut to the sequence length of x."""
    mask = kwargs.get("attn_mask")
    if mask is None:
        return args, kwargs
    x = args[0] if args else kwargs["x"]
    length = x.shape[1] if transformer.batch_first else x.shape[0]
    return args, {**kwargs, "attn_mask": mask[:length, :length]}


def causal_kernel_refusal(model: nn.Module) -> str | None:
    """Why the text tower's attention cannot be told `is_causal` instead of its mask; None where it can."""
    tower = text_tower(model)
    if isinstance(tower, str):
        return tower
    if tower.attn_mask is None or not _is_causal(tower.attn_mask):
        return "the text attention is not causal"
    if getattr(tower.owner, "cls_emb", None) is not None:
        return "the class token's padding mask is added to the causal one (text_cfg.embed_cls)"
    if not all(isinstance(block, ResidualAttentionBlock) for block in tower.transformer.resblocks):
        return ("the text blocks are open_clip's custom attention (qk_norm, scaled cosine or scaled heads), "
                "which takes a mask only")
    return None


def use_causal_kernel(model: nn.Module) -> str | None:
    """Give each text block's nn.MultiheadAttention the `is_causal` hint beside its causal mask,
    so it runs F.scaled_dot_product_attention's causal kernels (flash on a GPU) instead of a
    masked one. Call once, before compiling and wrapping the model. Returns None, or why not."""
    refusal = causal_kernel_refusal(model)
    if refusal is not None:
        return refusal
    for block in text_tower(model).transformer.resblocks:
        block.attn.register_forward_pre_hook(_causal_hint, with_kwargs=True)
    return None


def _causal_hint(attention: nn.MultiheadAttention, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    return args, {**kwargs, "is_causal": True}


def caption_lengths(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """[b] the positions each caption of `tokens` [b, context] needs: its pooled (end-of-text)
    position + 1, found by open_clip's own pooling applied to the positions themselves."""
    tower = text_tower(model)
    if isinstance(tower, str):
        raise ValueError(tower)
    positions = torch.arange(tokens.shape[1], device=tokens.device).expand(tokens.shape[0], -1)
    pooled = text_global_pool(positions.unsqueeze(-1), tokens, tower.pool_type, eos_token_id=tower.eos_id)
    return pooled[:, 0] + 1


def captions_cut(tokenizer, captions: list[str], tokens) -> int:
    """How many of `captions` the tokenizer cut to `tokens`' width, the context length (open_clip's
    keeps a caption's first context_length - 2 tokens between its start and end-of-text tokens, so
    the rest of the caption is never seen). A caption was cut when the same tokenizer, given one
    position more, writes other tokens into the first context_length positions; only a row whose
    last position is not padding can differ, so only those captions are tokenized again. 0 for a
    tokenizer that gives no [captions, positions] tensor (a test's stand-in)."""
    if not isinstance(tokens, torch.Tensor) or tokens.dim() != 2:
        return 0
    width = tokens.shape[1]
    padding = getattr(getattr(tokenizer, "tokenizer", None), "pad_token_id", None) or 0  # a Hugging Face tokenizer's own
    full = (tokens[:, -1] != padding).nonzero().flatten().tolist()
    if not full:
        return 0
    longer = tokenizer([captions[i] for i in full], context_length=width + 1)
    return int((longer[:, :width] != tokens[full]).any(dim=1).sum())


def length_order(lengths: torch.Tensor) -> torch.Tensor:
    """The permutation that sorts a batch's pairs by caption length, longest first (ties keep
    their order, so a batch always sorts the same way: a resumed run repeats it). Longest first:
    the chunk whose graph pass 1 keeps through the loss (Gradient Cache's last) is the shortest."""
    return torch.sort(lengths, descending=True, stable=True).indices


def positions_for(longest: int, context: int, buckets: Sequence[int] = POSITION_BUCKETS) -> int:
    """The positions a chunk whose longest caption needs `longest` is computed at."""
    return next((bucket for bucket in buckets if longest <= bucket < context), context)


class TextChunks:
    """A batch's tokens handed to Gradient Cache a chunk at a time (its chunk-source interface),
    each chunk cut to `positions_for` its longest caption. `tokens` [b, context] and `lengths` [b]
    in the order of the step (length-sorted, so that neighbours share a bucket); the tokens may
    live on the host or the device."""

    def __init__(self, tokens: torch.Tensor, lengths: torch.Tensor, context: int,
                 buckets: Sequence[int] = POSITION_BUCKETS):
        if tokens.shape != (len(lengths), context):
            raise ValueError(f"tokens {tuple(tokens.shape)} do not fit {len(lengths)} lengths at context {context}")
        self.tokens, self.context, self.buckets = tokens, context, tuple(buckets)
        self.lengths = lengths.cpu()  # read per chunk: on the host, no device synchronisation

    def __len__(self) -> int:
        return len(self.tokens)

    def positions(self, start: int, stop: int) -> int:
        return positions_for(int(self.lengths[start:stop].max()), self.context, self.buckets)

    def chunks(self, bounds: Bounds, device: torch.device, pass_number: int, keep: Bounds = ()) -> Iterator[torch.Tensor]:
        for start, stop in bounds:
            yield self.tokens[start:stop, : self.positions(start, stop)].contiguous().to(device, non_blocking=True)


def to_device_async(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`tensor` on `device`, copied from page-locked memory on a GPU, so the copy does not wait for the GPU."""
    if device.type != "cuda":
        return tensor.to(device)
    return (tensor if tensor.is_pinned() else tensor.pin_memory()).to(device, non_blocking=True)


class LengthSortedTexts:
    """Gradient Cache's `text_order` for a model whose padding is cut (`cut_padding`): a batch's
    tokens sorted by caption length, in chunks each cut to its bucket, and the permutation."""

    def __init__(self, model: nn.Module):
        self.model, self.context = model, context_length(model)

    def __call__(self, tokens: torch.Tensor, device: torch.device | None = None) -> tuple[TextChunks, torch.Tensor]:
        """`device`: where the chunks are wanted. The batch's tokens go there in one asynchronous copy
        and are sorted there: a chunk copied from pageable host memory would wait for the GPU to
        finish all the work queued before it, once per chunk."""
        lengths = caption_lengths(self.model, tokens)
        order = length_order(lengths)
        sorted_lengths = lengths[order]  # read per chunk on the host
        if device is not None and device != tokens.device:
            tokens, order = to_device_async(tokens, device), to_device_async(order, device)
        return TextChunks(tokens[order], sorted_lengths, self.context), order


def text_lengths_for_run(model: nn.Module, cut: bool, causal: bool) -> tuple[LengthSortedTexts | None, list[str]]:
    """What a run asks of the text tower (model.cut_text_padding, model.causal_text_attention),
    applied to `model` before it is compiled and wrapped: Gradient Cache's text order (None: every
    caption at the context length) and, for the console, why what was asked cannot be done."""
    notes = []
    refusal = cut_padding(model) if cut else None
    if refusal is not None:
        notes.append(f"text: {context_length_or_none(model)} positions for every caption (model.cut_text_padding): {refusal}")
    causal_refusal = use_causal_kernel(model) if causal else None
    if causal_refusal is not None:
        notes.append(f"text: attention with its mask, not the causal kernel (model.causal_text_attention): {causal_refusal}")
    return (LengthSortedTexts(model) if cut and refusal is None else None), notes


def context_length_or_none(model: nn.Module) -> str:
    tower = text_tower(model)
    return "all" if isinstance(tower, str) else str(tower.context_length)


def text_lengths_computed(text_order: LengthSortedTexts | None, context: int) -> tuple[int, ...]:
    """The text lengths a run's chunks may have: the buckets below the context length and the
    context length itself when cutting, else the context length alone."""
    if text_order is None:
        return (context,)
    return (*(bucket for bucket in POSITION_BUCKETS if bucket < context), context)
